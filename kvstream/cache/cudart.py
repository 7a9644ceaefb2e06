"""``cudaMemcpy2DAsync``, ``cudaMalloc`` / ``cudaFree`` and the graph calls that read and set a
captured graph's memcpy nodes, from the CUDA runtime torch has loaded (through ctypes).

torch copies into a strided pinned host view (one page of every layer of the host store)
through a pageable temporary and a host sync; one 2-D copy is asynchronous: the decode step's
write-back then overlaps the next step instead of stalling the host for the whole step. The
graph calls let a captured decode step copy other host rows (a new streaming plan) without a
new capture (``kvstream.engine.graph_copies``).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_MEMCPY_NODE = 1  # cudaGraphNodeTypeMemcpy


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class Memcpy3D(ctypes.Structure):
    """``cudaMemcpy3DParms``: what a memcpy node copies."""
    _fields_ = [("srcArray", ctypes.c_void_p), ("srcPos", _Pos), ("srcPtr", _PitchedPtr),
                ("dstArray", ctypes.c_void_p), ("dstPos", _Pos), ("dstPtr", _PitchedPtr),
                ("extent", _Pos), ("kind", ctypes.c_int)]

    def rows(self) -> tuple[int, int, int, int, int, int]:
        """(dst, dst pitch, src, src pitch, width, rows): the 2-D copy it is."""
        return (self.dstPtr.ptr or 0, self.dstPtr.pitch, self.srcPtr.ptr or 0, self.srcPtr.pitch,
                self.extent.x, self.extent.y)


def rows_of(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """``Memcpy3D.rows`` of the copy ``copy_rows(dst, src)`` issues (one row: pitches = width,
    whatever strides the views have)."""
    rows, width = src.shape
    if rows == 1:
        return dst.data_ptr(), width, src.data_ptr(), width, width, 1
    return dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), width, rows


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
            p = ctypes.c_void_p
            lib.cudaGraphGetNodes.argtypes = [p, p, ctypes.POINTER(ctypes.c_size_t)]
            lib.cudaGraphNodeGetType.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
            lib.cudaGraphMemcpyNodeGetParams.argtypes = [p, ctypes.POINTER(Memcpy3D)]
            lib.cudaGraphMemcpyNodeSetParams.argtypes = [p, ctypes.POINTER(Memcpy3D)]
            lib.cudaGraphExecMemcpyNodeSetParams.argtypes = [p, p, ctypes.POINTER(Memcpy3D)]
            lib.cudaGraphExecUpdate.argtypes = [p, p, p]
            lib.cudaGetErrorString.argtypes = [ctypes.c_int]
            lib.cudaGetErrorString.restype = ctypes.c_char_p
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
    memcpy_2d(rows_of(dst, src), stream)


def memcpy_2d(rows: tuple[int, int, int, int, int, int], stream: torch.cuda.Stream) -> None:
    """One ``cudaMemcpy2DAsync`` of ``rows`` = (dst, dst pitch, src, src pitch, width, rows) on
    ``stream``: ``copy_rows`` without the views (``PagedCache._row_copies`` computes them)."""
    d, dpitch, s, spitch, width, n = rows
    err = _runtime().cudaMemcpy2DAsync(d, dpitch, s, spitch, width, n, _DEFAULT, stream.cuda_stream)
    if err:
        raise RuntimeError(f"cudaMemcpy2DAsync of {n} rows x {width} bytes failed with CUDA error {err}")


def device_malloc(nbytes: int) -> int:
    """A raw ``cudaMalloc`` (the measuring slab pool's segments): the address."""
    ptr = ctypes.c_void_p()
    err = _runtime().cudaMalloc(ctypes.byref(ptr), nbytes)
    if err:
        raise RuntimeError(f"cudaMalloc of {nbytes} bytes failed with CUDA error {err}")
    return ptr.value


def device_free(ptr: int) -> None:
    _runtime().cudaFree(ctypes.c_void_p(ptr))


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUDA error {err} "
                           f"({_runtime().cudaGetErrorString(err).decode()})")


def memcpy_nodes(graph: int) -> list[tuple[int, Memcpy3D]]:
    """(node, its parameters) of every memcpy node of a captured ``cudaGraph_t``."""
    rt, n = _runtime(), ctypes.c_size_t(0)
    _check(rt.cudaGraphGetNodes(graph, None, ctypes.byref(n)), "cudaGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(rt.cudaGraphGetNodes(graph, nodes, ctypes.byref(n)), "cudaGraphGetNodes")
    out, kind = [], ctypes.c_int()
    for node in nodes:
        _check(rt.cudaGraphNodeGetType(node, ctypes.byref(kind)), "cudaGraphNodeGetType")
        if kind.value == _MEMCPY_NODE:
            params = Memcpy3D()
            _check(rt.cudaGraphMemcpyNodeGetParams(node, ctypes.byref(params)), "cudaGraphMemcpyNodeGetParams")
            out.append((node, params))
    return out


def retarget(params: Memcpy3D, rows: tuple[int, int, int, int, int, int]) -> None:
    """Point ``params`` at another 2-D copy (``rows_of``'s tuple), in place."""
    params.dstPtr.ptr, params.dstPtr.pitch, params.srcPtr.ptr, params.srcPtr.pitch, width, height = rows
    params.extent.x, params.extent.y = width, height
    params.srcPtr.xsize = params.dstPtr.xsize = width
    params.srcPtr.ysize = params.dstPtr.ysize = height


def set_exec_memcpy(graph_exec: int, node: int, params: Memcpy3D) -> int:
    """The instantiated graph's copy at ``node`` becomes ``params`` (0, or the CUDA error)."""
    return _runtime().cudaGraphExecMemcpyNodeSetParams(graph_exec, node, ctypes.byref(params))


def set_graph_memcpy(node: int, params: Memcpy3D) -> None:
    """The graph's (not yet its instance's) copy at ``node`` becomes ``params`` (with
    ``update_exec``: the other way to re-point a copy, which ``experiments/probe_memcpy_nodes.py``
    tries; it refuses 2-D copies too)."""
    _check(_runtime().cudaGraphMemcpyNodeSetParams(node, ctypes.byref(params)), "cudaGraphMemcpyNodeSetParams")


def update_exec(graph_exec: int, graph: int) -> None:
    """Bring the instance up to its graph's node parameters (``cudaGraphExecUpdate``)."""
    info = (ctypes.c_void_p * 4)()  # cudaGraphExecUpdateResultInfo: an enum and two nodes
    _check(_runtime().cudaGraphExecUpdate(graph_exec, graph, info), "cudaGraphExecUpdate")
