"""A one-thread kernel that adds ``sign`` x the GPU's global timer (ns) to an int64 counter.

Launched just before and just after a wait on a stream (-1, then +1), the pair adds the wait's
length to the counter in device time: unlike a host timer or an event, it also measures a wait
inside a captured CUDA graph that the host has already queued the next replay of. The counter is
only ever changed in stream order, so one program and a plain load / store suffice. CUDA only
(the timer is a PTX register; the interpreter has none): the caller times CPU work on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda


@triton.jit
def _stamp_kernel(acc, SIGN: tl.constexpr):
    t = tl_cuda.globaltimer().to(tl.int64)
    tl.store(acc, tl.load(acc) + SIGN * t)


def stamp(acc: torch.Tensor, sign: int) -> None:
    """``acc[0] += sign * globaltimer`` on the current stream; ``acc`` a CUDA int64 tensor."""
    if acc.device.type != "cuda" or acc.dtype != torch.int64 or acc.numel() < 1:
        raise ValueError(f"stamp needs a CUDA int64 counter, got {acc.dtype} [{acc.numel()}] on {acc.device}")
    if sign not in (-1, 1):
        raise ValueError(f"stamp sign must be -1 (before a wait) or +1 (after it), got {sign}")
    _stamp_kernel[(1,)](acc, SIGN=sign, num_warps=1)
