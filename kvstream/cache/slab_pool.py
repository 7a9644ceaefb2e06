"""A phase's compute buffers inside the arena's slab (CUDA).

torch's caching allocator is kept (block splitting, per-stream reuse, CUDA-graph pools), but
given a ``torch.cuda.MemPool`` whose segments come from a callback instead of ``cudaMalloc``:
``SlabPool`` carves them first-fit out of the slab region, so activations, attention partials
and captured graphs' buffers live in the one arena allocation and a phase that needs more
than its slab fails with ``ArenaTooSmall`` naming the numbers. ``Segments()`` without a
region hands out ``cudaMalloc``'d segments and records their peak: the reserve pass that sizes
a slab (``cache_factory.reserve_slab``) measures with it.

Two torch rules shape this: the allocator keys blocks by address, so no segment may start
where another torch block does (the arena's own block starts at the slab's first byte: it is
skipped); and cuBLAS allocates a workspace per stream at its first matmul, for good, so each
stream runs one small matmul outside the pool before its first pooled pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

import torch

from kvstream.cache.arena import MIB, ArenaTooSmall
from kvstream.cache.cudart import device_free, device_malloc

SEGMENT_ALIGN = 512  # torch's smallest block: segment starts stay aligned to it
_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_CALLBACKS = []  # torch may call a pool's callbacks until its last segment is freed: never collected
_BLAS_READY: set[int] = set()  # streams whose cuBLAS workspace exists (outside any pool)


def _up(n: int) -> int:
    return -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN


class Segments:
    """Segment bookkeeping for one pool: first-fit in [base, base + nbytes), or cudaMalloc
    (``nbytes=None``: a measuring pool). Only integers here: the callbacks outlive the pool."""

    def __init__(self, base: int = 0, nbytes: int | None = None):
        start = _up(base + 1)  # never the region's first byte (see the module docstring)
        self.holes = [] if nbytes is None else [(start, base + nbytes - start)] if base + nbytes > start else []
        self.measuring = nbytes is None
        self.live: dict[int, int] = {}
        self.bytes = self.peak = 0
        self.refused = 0  # the last request that did not fit (bytes)
        self.error = ""  # what went wrong inside a callback (they must not raise)

    def alloc(self, size: int, device: int, stream) -> int | None:
        try:  # a ctypes callback must not raise: None is torch's out-of-memory
            n = _up(size)
            if self.measuring:
                ptr = device_malloc(n)
            else:
                i = next((i for i, (_, free) in enumerate(self.holes) if free >= n), None)
                if i is None:
                    self.refused = n
                    return None
                ptr, free = self.holes[i]
                self.holes[i:i + 1] = [(ptr + n, free - n)] if free > n else []
            self.live[ptr] = n
            self.bytes += n
            self.peak = max(self.peak, self.bytes)
            return ptr
        except Exception as e:  # noqa: BLE001 - torch sees out of memory; scope() reports this
            self.error = f"{type(e).__name__}: {e}"
            return None

    def free(self, ptr: int, size: int, device: int, stream) -> None:
        n = self.live.pop(ptr, 0)
        self.bytes -= n
        if self.measuring:
            device_free(ptr)
            return
        holes = sorted(self.holes + [(ptr, n)])
        merged = [holes[0]]
        for p, m in holes[1:]:  # coalesce neighbours
            q, k = merged[-1]
            merged[-1:] = [(q, k + m)] if q + k == p else [(q, k), (p, m)]
        self.holes = merged

    def allocator(self):
        """A torch allocator whose segments these are (for ``torch.cuda.MemPool``)."""
        alloc, free = _ALLOC(self.alloc), _FREE(self.free)
        _CALLBACKS.append((alloc, free))
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value
        return torch._C._cuda_customAllocator(address(alloc), address(free))


def _ready_blas(device: torch.device) -> None:
    """cuBLAS / cuBLASLt workspaces of the current stream, allocated outside any pool."""
    stream = torch.cuda.current_stream(device).cuda_stream
    if stream not in _BLAS_READY:
        a = torch.ones(16, 16, device=device)
        torch.addmm(a[0], a, a)
        torch.addmm(a[0].bfloat16(), a.bfloat16(), a.bfloat16())
        _BLAS_READY.add(stream)


class SlabPool:
    """A MemPool over ``region`` (a uint8 CUDA view: the slab), or measuring (``region=None``)."""

    def __init__(self, region: torch.Tensor | None = None, name: str = "slab"):
        self.name = name
        self.nbytes = None if region is None else region.numel()
        self.base = None if region is None else region.data_ptr()
        self.device = torch.device("cuda") if region is None else region.device
        self.segments = Segments() if region is None else Segments(region.data_ptr(), region.numel())
        self.allocator = self.segments.allocator()
        self.pool = torch.cuda.MemPool(self.allocator)

    @property
    def id(self):
        """The pool's id, for ``torch.cuda.graph(pool=...)``: captured steps allocate here."""
        return self.pool.id

    @property
    def peak(self) -> int:
        """Most segment bytes held at once, plus the skipped first bytes: the slab this needs."""
        return self.segments.peak + SEGMENT_ALIGN

    @contextlib.contextmanager
    def scope(self, route: bool = True):
        """This thread's allocations come from the pool (``route=False``: only the errors, for a
        graph capture that routes its own); out of memory becomes ``ArenaTooSmall``."""
        _ready_blas(self.device)
        self.segments.refused, self.segments.error = 0, ""
        try:
            with torch.cuda.use_mem_pool(self.pool) if route else contextlib.nullcontext():
                yield
        except torch.cuda.OutOfMemoryError as e:
            if self.segments.error:
                raise RuntimeError(f"{self.name}: a segment request failed: {self.segments.error}") from e
            if not self.segments.refused:
                raise
            raise ArenaTooSmall(
                f"the {self.name} of {self.nbytes / MIB:.2f} MiB cannot hold the compute buffers: a "
                f"{self.segments.refused / MIB:.2f} MiB segment did not fit beside the "
                f"{self.segments.bytes / MIB:.2f} MiB in use: the reserve pass measured less than this "
                f"phase uses (a wider batch than reserved, or eager and captured steps on one cache: "
                f"each stream takes its own segments)") from e

    def recycle(self) -> None:
        """A fresh pool over the same region: torch keeps a pool's cached segments and, inside a
        MemPool, does not release them to retry a request that does not fit, so passes whose
        buffer sizes change (prefill chunks: attention grows with the prefix) each start empty."""
        if self.segments.bytes:
            self.close(collect=False)  # per pass: no cycle collection, the pass's tensors are gone
            self.pool = torch.cuda.MemPool(self.allocator)

    def close(self, collect: bool = True) -> None:
        """Give the region back: every tensor and graph from the pool must be gone by now."""
        if self.pool is None:
            return
        self.pool = None
        if collect:
            gc.collect()  # tensors in reference cycles
        if self.segments.live and not self.segments.measuring:
            raise RuntimeError(f"{self.name}: {len(self.segments.live)} segments "
                               f"({self.segments.bytes / MIB:.2f} MiB) still hold tensors or graphs while the "
                               f"slab is given back; drop them (and any CUDA graph captured into it) first")
