"""Residual add + RMSNorm in one kernel: in torch a norm is 8 launches (cast, pow,
mean, add, rsqrt, mul, cast, mul) and the residual add one more, ~45% of the kernels of a
graphed step (results/peers/h200/prefusion_profile_*). One program per row.

``add_rms_norm(x, w, eps, delta)`` returns ``(s, rms_norm(s) * w)`` with ``s = x + delta``
(``s = x`` when delta is None), rounded as ``kernels.reference.add_rms_norm`` rounds: the sum
once to the input dtype, the variance in fp32, the normalised row once, the product with the
weight once. Only the fp32 summation order differs from the reference. ``q8=True`` also writes the normalised
row's q8_0 blocks (``reference.q8_rows`` of y: gguf's codec), the next matmul's ``xq`` under
``model.weights=q8_0_int8`` (``kernels/q8_gemv.py``), so that matmul's programs do not each quantize it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import kwargs as pdl_kwargs, wait_then_release
from kernels.q8_gemv import QK, q8_quant, q8_scale


@triton.jit
def _add_rms_norm_kernel(x, delta, w, s_out, y_out, q_out, d_out, row_stride, hidden, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    # the row as [BLOCK / 32, 32], q8_0's blocks, with or without Q8: the same layout, so the same sum order
    # and the same y whether or not its blocks are written
    o_b = tl.arange(0, BLOCK // 32)
    o = o_b[:, None] * 32 + tl.arange(0, 32)[None, :]
    m = o < hidden
    v = tl.load(x + row * row_stride + o, mask=m, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta + row * hidden + o, mask=m, other=0.0)
        v = (v.to(tl.float32) + d.to(tl.float32)).to(v.dtype)
        tl.store(s_out + row * hidden + o, v, mask=m)
    f = v.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(f * f, axis=1), axis=0) / hidden + eps)
    normed = (f * rstd).to(v.dtype).to(tl.float32)
    g = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    y = (normed * g).to(v.dtype)
    tl.store(y_out + row * hidden + o, y, mask=m)
    if Q8:  # y's q8_0 blocks (past hidden: blocks of zeros, not written)
        y_d, inv = q8_scale(tl.max(tl.abs(y.to(tl.float32)), 1))
        tl.store(q_out + row * hidden + o, q8_quant(y.to(tl.float32) * inv[:, None]).to(tl.int8), mask=m)
        tl.store(d_out + row * (hidden // 32) + o_b, y_d.to(tl.float16), mask=o_b < hidden // 32)


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None, pdl: bool = False, q8: bool = False):
    """x [n, hidden] (rows may be strided), w [hidden], delta [n, hidden] contiguous or None -> (s, y);
    ``q8`` (hidden a multiple of 32): (s, y, (quants int8 [n, hidden], scales fp16 [n, hidden / 32])).
    ``pdl``: launched as a programmatic dependent of the kernel before (CUDA; ``kernels/pdl.py``)."""
    if x.dim() != 2 or x.stride(-1) != 1 or w.shape != (x.shape[1],):
        raise ValueError(f"x must be [n, hidden] with contiguous rows and w [hidden], got "
                         f"{tuple(x.shape)} stride {x.stride()} and w {tuple(w.shape)}")
    if delta is not None and (delta.shape != x.shape or not delta.is_contiguous() or delta.dtype != x.dtype):
        raise ValueError(f"delta must be contiguous {tuple(x.shape)} {x.dtype}, got {tuple(delta.shape)} "
                         f"{delta.dtype} contiguous={delta.is_contiguous()}")
    n, hidden = x.shape
    if q8 and hidden % QK:
        raise ValueError(f"q8 blocks need hidden a multiple of {QK}, got {hidden}")
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    yq = (torch.empty((n, hidden), dtype=torch.int8, device=x.device),
          torch.empty((n, hidden // QK), dtype=torch.float16, device=x.device)) if q8 else (y, y)
    s = torch.empty_like(y) if delta is not None else x
    block = max(triton.next_power_of_2(hidden), QK)
    _add_rms_norm_kernel[(n,)](x, delta if delta is not None else x, w, s, y, *yq, x.stride(0), hidden, eps,
                               HAS_DELTA=delta is not None, BLOCK=block, Q8=q8, num_warps=4 if block <= 2048 else 8,
                               **pdl_kwargs(pdl, x.device))
    return (s, y, yq) if q8 else (s, y)
