"""RoPE (NEOX halves, as llama.cpp and HF's ``rotate_half``) for all q and k heads of a step in
one kernel, angles computed in place from the positions: the torch version is ~12 launches
(angles, cos, sin, casts, four products, two sums, a cat) and one temporary per step.

``rope(x, pos, inv_freq, scale=1.0)``: x [n, heads, D] (rows may be strided, e.g. a view of the
fused QKV output), pos [n] int64, inv_freq [D/2] fp32 -> a new contiguous [n, heads, D]. Rounded as
``kernels.reference.rope`` rounds: cos/sin once to x's dtype, each product once, each sum once.
One program per token covers every head.

YaRN (long context, e.g. Qwen2.5's 128K = 4 x 32K): the kernel is the same; the host builds
the blended frequencies and the scale once with ``kernels.reference.rope_inv_freq``, which the
reference path uses too. ``scale`` (YaRN's attention factor, 0.1 ln(factor) + 1) multiplies cos
and sin in fp32 before their rounding, as transformers does, so q.k grows by its square; at
scale 1 the product is exact and the result is plain RoPE's bit for bit. Positions stay int64
until their one conversion to fp32 (exact below 2^24, then rounded to nearest as torch's
``pos.float()``); pointer offsets are int64 (the token index), so no size overflows int32. Compiled without FMA
contraction, as ``kernels.rope_store`` (which the store's exactness needs) is: cos / sin then come out
the same in both, so the fused kernel's rows equal this one's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def cos_sin(p, inv_freq, scale, dt):
    """cos and sin of position ``p`` (fp32) times ``inv_freq`` (fp32), times ``scale``, rounded once
    to the rows' dtype ``dt`` (as fp32 values): the reference's ``rope_angles``."""
    ang = p * inv_freq
    return (tl.cos(ang) * scale).to(dt).to(tl.float32), (tl.sin(ang) * scale).to(dt).to(tl.float32)


@triton.jit
def rotate(x, partner, c, s, first, dt):
    """RoPE of element x (fp32) whose NEOX partner (the other half's element) is ``partner``:
    x c - partner s in the first half, x c + partner s in the second, each product rounded once
    to ``dt`` as the reference's torch ops round it (the sum's rounding is the caller's store)."""
    xc = (x * c).to(dt).to(tl.float32)
    ps = (partner * s).to(dt).to(tl.float32)
    return tl.where(first, xc - ps, xc + ps)


@triton.jit
def _rope_kernel(x,         # [n, heads, 2 * HALF], rows and heads strided
                 pos,       # [n] int64
                 inv_freq,  # [HALF] fp32
                 out,       # [n, heads, 2 * HALF] contiguous
                 token_stride, head_stride, n_heads, scale,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    m = h < n_heads
    src = x + t * token_stride + h * head_stride + j
    x1 = tl.load(src, mask=m, other=0.0)
    x2 = tl.load(src + HALF, mask=m, other=0.0)
    dt = x1.dtype  # one rounding per torch op of the reference
    c, s = cos_sin(tl.load(pos + t).to(tl.float32), tl.load(inv_freq + j), scale, dt)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    dst = out + t * n_heads * 2 * HALF + h * 2 * HALF + j
    tl.store(dst, rotate(a1, a2, c, s, True, dt).to(dt), mask=m)
    tl.store(dst + HALF, rotate(a2, a1, c, s, False, dt).to(dt), mask=m)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2:
        raise ValueError(f"x must be [n, heads, even head_dim] with contiguous heads, got {tuple(x.shape)} "
                         f"stride {x.stride()}")
    n, heads, d = x.shape
    if pos.shape != (n,) or pos.dtype != torch.int64 or inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"pos must be int64 [{n}] and inv_freq fp32 [{d // 2}], got {pos.dtype} {tuple(pos.shape)} "
                         f"and {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if d // 2 != triton.next_power_of_2(d // 2):
        raise ValueError(f"head_dim / 2 must be a power of two, got {d // 2}")
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(n,)](x, pos, inv_freq, out, x.stride(0), x.stride(1), heads, float(scale),
                       HALF=d // 2, BLOCK_H=triton.next_power_of_2(heads), num_warps=4, enable_fp_fusion=False)
    return out
