"""Greedy acceptance of a verify pass, in one launch: a device round's end (the torch ops it
replaces took ~16 launches, each a host dispatch and a few us of device time, between the
verify and the round's readback).

``accept(logits, tokens, valid, keep, scratch, result, kept)``: logits fp32 [1 + n, V] of the
verify pass (row i predicts the token after draft token i - 1), the n drafted ``tokens``,
``valid`` (bool [n], the ``p_min`` stop as a mask: a prefix) and, for synthetic acceptance,
``keep`` (bool [n]: whether each token counts as accepted whatever its content; None: greedy,
token i is kept where it equals row i's argmax). Writes ``result`` int64 [2n + 3] = [accepted
count, valid count, tokens, the 1 + n argmaxes] (what the host reads back) and ``kept`` int64
[1 + n] (the accepted drafts, then the target's token after them, repeated to the end: a
drafter stages its next round from it on the device). The argmaxes are torch.argmax's (first
maximum, NaN largest; ``kernels.argmax``'s keys, ``block_key``); the counts and rows equal
``reference.accept``'s, which is the torch expression.

Each program takes a block of one row's logits to one int64 key (value, -index) and an atomic
max into the row's slot of ``scratch``; the last program to finish (an atomic counter) reads
the rows' keys (resetting them), compares, counts and writes. ``scratch``: ``scratch_for(rows,
device)``, left as it was made by every launch, so a captured graph replays it as is.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.argmax import block_key, index_of

BLOCK = 4096
INT64_MIN = -0x7FFFFFFFFFFFFFFF - 1


@triton.jit(do_not_specialize=["n"])  # (the draft length: ROWS's buckets are the variants)
def _accept_kernel(logits, V, stride_l, tokens, valid, keep, scratch, result, kept, n,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, SYNTHETIC: tl.constexpr):
    row = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_max(scratch + 1 + row, block_key(logits + row * stride_l, i, V))
    total = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(scratch, 1) == total - 1:  # the last program: every row's maximum is in
        o = tl.arange(0, ROWS)
        # the atomics left the keys in L2, and the counter's acq_rel ordered them before this read; a
        # volatile load reads L2 (plain loads and stores here: the vector form of an atomic's returned
        # values is not one Triton promises for replicated elements)
        top_key = tl.load(scratch + 1 + o, mask=o <= n, other=0, volatile=True)
        tl.store(scratch + 1 + o, tl.full([ROWS], -0x7FFFFFFFFFFFFFFF - 1, tl.int64), mask=o <= n)
        top = index_of(top_key)
        d = o < n
        tok = tl.load(tokens + o, mask=d, other=0)
        is_valid = tl.load(valid + o, mask=d, other=0) != 0
        if SYNTHETIC:
            ok = is_valid & (tl.load(keep + o, mask=d, other=0) != 0)
        else:
            ok = is_valid & (tok == top)
        accepted = tl.min(tl.where(d & ~ok, o, n), axis=0)  # the first token not kept (n: all kept)
        n_valid = tl.sum(is_valid.to(tl.int64), axis=0)
        tl.store(result, accepted.to(tl.int64))
        tl.store(result + 1, n_valid)
        tl.store(result + 2 + o, tok, mask=d)
        tl.store(result + 2 + n + o, top, mask=o <= n)
        after = tl.sum(tl.where(o == accepted, top, 0), axis=0)  # the target's token after the kept drafts
        tl.store(kept + o, tl.where(o < accepted, tok, after), mask=o <= n)
        tl.atomic_xchg(scratch, 0)


def scratch_for(rows: int, device: torch.device | str) -> torch.Tensor:
    """The launches' shared state for verify passes of up to ``rows`` rows: int64 [1 + rows], the
    programs done (0), then each row's best key (the smallest int64)."""
    s = torch.full((1 + rows,), INT64_MIN, dtype=torch.int64, device=device)
    s[0] = 0
    return s


def accept(logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor | None,
           scratch: torch.Tensor, result: torch.Tensor | None = None,
           kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(result int64 [2n + 3], kept int64 [1 + n]) of the verify ``logits`` [1 + n, V] (fp32, rows
    contiguous) for the drafted ``tokens`` int64 [n] (module docstring). ``scratch``: made by
    ``scratch_for(rows, ...)`` with rows >= 1 + n (one launch at a time); ``result`` / ``kept``:
    buffers to write (else new ones)."""
    n = tokens.shape[0]
    if logits.dim() != 2 or logits.shape[0] != n + 1 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"accept needs fp32 logits [1 + n, V] with contiguous rows for {n} tokens, got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if not 0 < n or valid.shape != (n,) or (keep is not None and keep.shape != (n,)) or tokens.dtype != torch.int64:
        raise ValueError(f"accept: tokens int64 [n > 0] with valid (and keep) [n], got tokens {tuple(tokens.shape)} "
                         f"{tokens.dtype}, valid {tuple(valid.shape)}")
    if scratch.dim() != 1 or scratch.shape[0] < n + 2 or scratch.dtype != torch.int64:
        raise ValueError(f"accept's scratch must be int64 [>= {n + 2}] (scratch_for({n + 1})), got "
                         f"{tuple(scratch.shape)} {scratch.dtype}")
    result = torch.empty(2 * n + 3, dtype=torch.int64, device=logits.device) if result is None else result
    kept = torch.empty(n + 1, dtype=torch.int64, device=logits.device) if kept is None else kept
    grid = (n + 1, triton.cdiv(logits.shape[1], BLOCK))
    _accept_kernel[grid](logits, logits.shape[1], logits.stride(0), tokens, valid, valid if keep is None else keep,
                         scratch, result, kept, n, ROWS=triton.next_power_of_2(n + 1), BLOCK=BLOCK,
                         SYNTHETIC=keep is not None, num_warps=8)
    return result, kept
