"""SwiGLU activation: ``silu(gate) * up`` from the fused gate/up matmul output in one kernel
(torch: a chunk, a silu and a product, two launches and a temporary).

``silu_mul(gu)``: gu [n, 2F] (gate columns first) -> [n, F], rounded as
``kernels.reference.silu_mul``: silu once to gu's dtype, the product once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import kwargs as pdl_kwargs, wait_then_release

BLOCK = 1024


@triton.jit
def silu_times(g, u):
    """silu(g) * u for g, u in their storage dtype, rounded as ``reference.silu_mul``: silu in fp32, once
    to the dtype, the product in fp32, once to the dtype (``kernels/gemv.py``'s gate/up epilogue too)."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (act * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _silu_mul_kernel(gu, out, ffn, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < ffn
    g = tl.load(gu + row * 2 * ffn + o, mask=m, other=0.0)
    u = tl.load(gu + row * 2 * ffn + ffn + o, mask=m, other=0.0)
    tl.store(out + row * ffn + o, silu_times(g, u), mask=m)


def silu_mul(gu: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``pdl``: launched as a programmatic dependent of the kernel before (CUDA; ``kernels/pdl.py``)."""
    if gu.dim() != 2 or not gu.is_contiguous() or gu.shape[1] % 2:
        raise ValueError(f"gu must be a contiguous [n, 2 * ffn], got {tuple(gu.shape)} contiguous={gu.is_contiguous()}")
    n, ffn = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((n, ffn), dtype=gu.dtype, device=gu.device)
    _silu_mul_kernel[(n, triton.cdiv(ffn, BLOCK))](gu, out, ffn, BLOCK=BLOCK, num_warps=4, **pdl_kwargs(pdl, gu.device))
    return out
