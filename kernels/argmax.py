"""The index of a vector's largest value, in one launch: a greedy decode's next token inside its
captured step (torch's argmax over the 1.5B's 151936 logits took 8 us in one block, plus a copy;
this one 4.7 us: results/step/greedy).

``argmax(x)``: x fp32 [n] -> int64 [1], torch.argmax's answer: the first index of the largest
value, any NaN counting as largest (the first NaN's index), -0.0 equal to +0.0. Each program
turns its elements into int64 keys ordered as (value, -index): the value's bits as a signed int
in the floats' order (a negative float's non-sign bits flipped; NaN the top) above 2**32 - 1 -
index, so the largest key is the first largest value. The programs meet in one atomic max; the
last to finish (an atomic counter) writes the index and resets the key and the counter, so the
16-byte ``scratch`` is ready for the next launch (a graph's replay too).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import kwargs as pdl_kwargs, wait_then_release

BLOCK = 4096


@triton.jit
def block_key(x, i, n):
    """The largest int64 key of the values ``x[i]`` (``i < n``; others the smallest int64): keys
    ordered as (value, -index), so the largest is the first largest value's; ``index_of`` reads it."""
    v = tl.load(x + i, mask=i < n, other=0.0)
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 compares equal to +0.0: one key for both
    s = v.to(tl.int32, bitcast=True)
    s = tl.where(s < 0, s ^ 0x7FFFFFFF, s)  # signed ints in the floats' order
    s = tl.where(v != v, 0x7FFFFFFF, s)  # NaN: above +inf
    key = (s.to(tl.int64) << 32) | (0xFFFFFFFF - i.to(tl.int64))
    return tl.max(tl.where(i < n, key, -0x7FFFFFFFFFFFFFFF - 1), axis=0)


@triton.jit
def index_of(key):
    return 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def _argmax_kernel(x, n, out, scratch, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    tl.atomic_max(scratch, block_key(x, tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n))
    if tl.atomic_add(scratch + 1, 1) == tl.num_programs(0) - 1:  # the last program: every max is in
        top = tl.atomic_xchg(scratch, -0x7FFFFFFFFFFFFFFF - 1)
        tl.store(out, index_of(top))
        tl.atomic_xchg(scratch + 1, 0)


def scratch_for(device: torch.device | str) -> torch.Tensor:
    """The launches' shared state: int64 [2], the best key so far (the smallest int64) and the
    programs done (0)."""
    return torch.tensor([torch.iinfo(torch.int64).min, 0], dtype=torch.int64, device=device)


def argmax(x: torch.Tensor, scratch: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x fp32 [n] (contiguous, n < 2**32) -> int64 [1]: ``torch.argmax(x)``. ``scratch``:
    ``scratch_for(x.device)``, as made between launches (each launch leaves it so); one launch at a
    time per scratch. ``out``: an int64 [1] to write (else a new one). ``pdl``: launched as a
    programmatic dependent (``kernels/pdl.py``)."""
    if x.dim() != 1 or x.dtype != torch.float32 or not x.is_contiguous() or not 0 < x.numel() < 2 ** 32:
        raise ValueError(f"argmax needs a contiguous fp32 [n], 0 < n < 2**32; got {tuple(x.shape)} {x.dtype} "
                         f"contiguous={x.is_contiguous()}")
    if scratch.shape != (2,) or scratch.dtype != torch.int64 or scratch.device != x.device:
        raise ValueError(f"scratch must be int64 [2] on {x.device} (scratch_for), got {tuple(scratch.shape)} "
                         f"{scratch.dtype} on {scratch.device}")
    if out is None:
        out = torch.empty(1, dtype=torch.int64, device=x.device)
    elif out.shape != (1,) or out.dtype != torch.int64 or out.device != x.device:
        raise ValueError(f"out must be int64 [1] on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    _argmax_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, x.numel(), out, scratch, BLOCK=BLOCK, num_warps=8,
                                                     **pdl_kwargs(pdl, x.device))
    return out
