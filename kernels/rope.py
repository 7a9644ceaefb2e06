"""RoPE (NEOX halves, as llama.cpp and HF's ``rotate_half``) for all q and k heads of a step in
one kernel, angles computed in place from the positions: the torch version is ~12 launches
(angles, cos, sin, casts, four products, two sums, a cat) and one temporary per step.

``rope(x, pos, inv_freq)``: x [n, heads, D] (rows may be strided, e.g. a view of the fused QKV
output), pos [n] int64, inv_freq [D/2] fp32 -> a new contiguous [n, heads, D]. Rounded as
``kernels.reference.rope`` rounds: cos/sin once to x's dtype, each product once, each sum once.
One program per token covers every head.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x, pos, inv_freq, out, token_stride, head_stride, n_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    m = h < n_heads
    ang = tl.load(pos + t).to(tl.float32) * tl.load(inv_freq + j)
    src = x + t * token_stride + h * head_stride + j
    x1 = tl.load(src, mask=m, other=0.0)
    x2 = tl.load(src + HALF, mask=m, other=0.0)
    c = tl.cos(ang).to(x1.dtype).to(tl.float32)
    s = tl.sin(ang).to(x1.dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    dt = x1.dtype  # one rounding per torch op of the reference
    o1 = (a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)
    o2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
    dst = out + t * n_heads * 2 * HALF + h * 2 * HALF + j
    tl.store(dst, o1.to(x1.dtype), mask=m)
    tl.store(dst + HALF, o2.to(x1.dtype), mask=m)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [n, heads, even head_dim] with contiguous heads, got {tuple(x.shape)} "
                         f"stride {x.stride()}")
    n, heads, d = x.shape
    if pos.shape != (n,) or inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"pos must be [{n}] and inv_freq fp32 [{d // 2}], got {tuple(pos.shape)} and "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    if d // 2 != triton.next_power_of_2(d // 2):
        raise ValueError(f"head_dim / 2 must be a power of two, got {d // 2}")
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(n,)](x, pos, inv_freq, out, x.stride(0), x.stride(1), heads,
                       HALF=d // 2, BLOCK_H=triton.next_power_of_2(heads), num_warps=4)
    return out
