"""``cudaMemcpy2DAsync``, ``cudaMalloc`` and ``cudaFree`` from the CUDA runtime torch has
loaded (through ctypes).

torch copies into a strided pinned host view (one page of every layer of the host store)
through a pageable temporary and a host sync; one 2-D copy is asynchronous: the decode step's
write-back then overlaps the next step instead of stalling the host for the whole step.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


@functools.cache
def _runtime() -> ctypes.CDLL:
    torch.cuda.init()  # loads libcudart; find the very file torch uses (pip wheel or system)
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    for path in sorted(paths):
        if os.path.basename(path).startswith("libcudart.so"):
            lib = ctypes.CDLL(path)
            fn = lib.cudaMemcpy2DAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            lib.cudaFree.argtypes = [ctypes.c_void_p]
            return lib
    raise RuntimeError(f"libcudart is not among this process's mapped libraries (torch {torch.__version__}); "
                       f"cannot issue 2-D copies")


def copy_rows(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """dst[i] = src[i] for 2-D uint8 tensors whose rows are contiguous (any row strides), one
    ``cudaMemcpy2DAsync`` on ``stream``; host memory must be pinned for it to be asynchronous."""
    if dst.shape != src.shape or dst.dim() != 2 or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copy_rows needs two 2-D uint8 tensors of one shape, got {tuple(dst.shape)} {dst.dtype} "
                         f"and {tuple(src.shape)} {src.dtype}")
    if dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError(f"copy_rows needs contiguous rows, got strides {dst.stride()} and {src.stride()}")
    rows, width = src.shape
    err = _runtime().cudaMemcpy2DAsync(dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), width, rows,
                                       _DEFAULT, stream.cuda_stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync of {rows} rows x {width} bytes failed with CUDA error {err}")


def device_malloc(nbytes: int) -> int:
    """A raw ``cudaMalloc`` (the measuring slab pool's segments): the address."""
    ptr = ctypes.c_void_p()
    err = _runtime().cudaMalloc(ctypes.byref(ptr), nbytes)
    if err:
        raise RuntimeError(f"cudaMalloc of {nbytes} bytes failed with CUDA error {err}")
    return ptr.value


def device_free(ptr: int) -> None:
    _runtime().cudaFree(ctypes.c_void_p(ptr))
