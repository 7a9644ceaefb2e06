"""Rows of a q8_0 weight dequantized in one launch: a tied q8_0 embedding's lookup (torch's
gathers of the block-major quants and scales, their conversions and the product: six launches and
~15 us of a 1.5B decode step on the H200, results/step/greedy; this kernel not yet timed there).

``q8_rows(tokens, q, d, dtype)``: tokens int64 [n] (each in [0, N)), q int8 [K/32, N, 32], d fp16
[K/32, N] (``kvstream.model.weights.Q8``'s layout) -> [n, K] in ``dtype``: each value q x d in
fp32, rounded once, as ``Q8.embedding``'s torch expression (the reference), bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _q8_rows_kernel(tokens, q, d, out, N, NB, BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(tokens + row).to(tl.int64)
    b = tl.arange(0, BLOCKS)
    j = tl.arange(0, 32)
    m = b < NB
    qv = tl.load(q + (b[:, None].to(tl.int64) * N + t) * 32 + j[None, :], mask=m[:, None], other=0)
    dv = tl.load(d + b.to(tl.int64) * N + t, mask=m, other=0.0)
    y = qv.to(tl.float32) * dv.to(tl.float32)[:, None]
    tl.store(out + row * NB * 32 + b[:, None] * 32 + j[None, :], y.to(out.dtype.element_ty), mask=m[:, None])


def q8_rows(tokens: torch.Tensor, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``tokens`` of the q8_0 weight (q, d), dequantized to ``dtype`` [n, K]. The ids are
    not checked on the device (a host check would wait for it): they must lie in [0, N)."""
    if tokens.dim() != 1 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64 [n], got {tuple(tokens.shape)} {tokens.dtype}")
    if q.dim() != 3 or q.shape[2] != 32 or q.dtype != torch.int8 or d.shape != q.shape[:2] or d.dtype != torch.float16:
        raise ValueError(f"a q8_0 weight is int8 [K/32, N, 32] and fp16 [K/32, N], got {tuple(q.shape)} {q.dtype} "
                         f"and {tuple(d.shape)} {d.dtype}")
    if not (tokens.is_contiguous() and q.is_contiguous() and d.is_contiguous() and tokens.device == q.device == d.device):
        raise ValueError("tokens, q and d must be contiguous and on one device")
    nb, n_cols = q.shape[0], q.shape[1]
    out = torch.empty((tokens.shape[0], nb * 32), dtype=dtype, device=q.device)
    if tokens.shape[0]:
        _q8_rows_kernel[(tokens.shape[0],)](tokens, q, d, out, n_cols, nb, BLOCKS=triton.next_power_of_2(nb),
                                            num_warps=4)
    return out
