"""RoPE and quantize-on-store in one launch: a decode step's q heads rotated, its K rows rotated
and stored, its V rows stored, where ``rope`` then ``store`` (twice) take three.

``rope_store(qk, v, pos, inv_freq, k_pool, v_pool, slots, k_fmt, v_fmt, scale=1.0)``: qk [n,
n_heads + n_kv_heads, D] (the q heads, then the k heads, not yet rotated; rows and heads may be
strided, e.g. views of the fused QKV output), v [n, n_kv_heads, D] -> the rotated q [n, n_heads, D]
(a new contiguous tensor); the rotated K rows and the V rows go to their page slots [n] int64 as
``kernels.store.store`` writes them (a negative slot skips its row's K and V).

Exactness: the rotation rounds as ``kernels.rope.rope`` does (cos/sin once to the rows' dtype,
each product once, the sum once: the shared ``cos_sin`` / ``rotate``), and the rotated K rows are
quantized from those rounded values by ``store``'s own code (``store_row``): the bytes and q equal
``rope`` followed by ``store``. Both are compiled without FMA contraction (the store's requirement):
with it, cos / sin and fp32 rows' x c - p s come out otherwise.

One program per (token, head slot): slots 0..n_heads-1 are q heads, then n_kv_heads K heads, then
n_kv_heads V heads; one warp each, as the store kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import kwargs as pdl_kwargs, wait_then_release
from kernels.formats import PageFormat
from kernels.rope import cos_sin, rotate
from kernels.store import ROW_DTYPES, check_pool, store_row


@triton.jit
def _rope_store_kernel(
    qk,  # [n, N_HEADS + N_KV_HEADS, HEAD_DIM], last dim contiguous
    v,  # [n, N_KV_HEADS, HEAD_DIM], last dim contiguous
    pos,  # [n] int64
    inv_freq,  # [HEAD_DIM / 2] fp32
    q_out,  # [n, N_HEADS, HEAD_DIM] contiguous
    k_pool,  # [n_pages, K_PAGE_BYTES] uint8
    v_pool,  # [n_pages, V_PAGE_BYTES] uint8
    slots,  # [n] int64 flat slots
    stride_qk_t,
    stride_qk_h,
    stride_v_t,
    stride_v_h,
    scale,
    N_HEADS: tl.constexpr,
    N_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_FMT: tl.constexpr,
    K_PAGE_BYTES: tl.constexpr,
    K_SCALE_OFF: tl.constexpr,
    V_FMT: tl.constexpr,
    V_PAGE_BYTES: tl.constexpr,
    V_SCALE_OFF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    NB: tl.constexpr = HEAD_DIM // 32
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    o_b = tl.arange(0, NB)
    o_j = tl.arange(0, 16)
    o_e = o_b[:, None] * 32 + o_j[None, :]  # [NB, 16]: elements 0..15 of each block (16..31: + 16)
    slot = tl.load(slots + t).to(tl.int64)
    if h < N_HEADS + N_KV_HEADS:  # a q or k head: rotated
        src = qk + t * stride_qk_t + h * stride_qk_h
        x_lo = tl.load(src + o_e)
        x_hi = tl.load(src + o_e + 16)
        dt = x_lo.dtype
        # each element's NEOX partner: the same element of the other half
        p_lo = tl.load(src + (o_e + HALF) % HEAD_DIM).to(tl.float32)
        p_hi = tl.load(src + (o_e + 16 + HALF) % HEAD_DIM).to(tl.float32)
        p = tl.load(pos + t).to(tl.float32)
        c_lo, s_lo = cos_sin(p, tl.load(inv_freq + o_e % HALF), scale, dt)
        c_hi, s_hi = cos_sin(p, tl.load(inv_freq + (o_e + 16) % HALF), scale, dt)
        r_lo = rotate(x_lo.to(tl.float32), p_lo, c_lo, s_lo, o_e < HALF, dt).to(dt)
        r_hi = rotate(x_hi.to(tl.float32), p_hi, c_hi, s_hi, o_e + 16 < HALF, dt).to(dt)
        if h < N_HEADS:
            dst = q_out + (t * N_HEADS + h) * HEAD_DIM + o_e
            tl.store(dst, r_lo)
            tl.store(dst + 16, r_hi)
        else:  # K is quantized from the rounded rotated values, as store reads rope's output
            store_row(k_pool, slot, h - N_HEADS, r_lo.to(tl.float32), r_hi.to(tl.float32), o_b, o_j,
                      K_FMT, HEAD_DIM, K_PAGE_BYTES, K_SCALE_OFF)
    else:
        i_h = h - N_HEADS - N_KV_HEADS
        m_x = (slot + 0 * o_e) >= 0
        p_v = v + t * stride_v_t + i_h * stride_v_h + o_e  # (Triton: a name must keep one type across branches)
        store_row(v_pool, slot, i_h, tl.load(p_v, mask=m_x).to(tl.float32), tl.load(p_v + 16, mask=m_x).to(tl.float32),
                  o_b, o_j, V_FMT, HEAD_DIM, V_PAGE_BYTES, V_SCALE_OFF)


def rope_store(qk: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
               k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k_fmt: PageFormat,
               v_fmt: PageFormat, scale: float = 1.0, pdl: bool = False) -> torch.Tensor:
    """Rotate q, rotate and store K, store V (module docstring); returns q [n, n_heads, D].
    ``pdl``: launched as a programmatic dependent of the kernel before (CUDA, ``kernels/pdl.py``)."""
    h, d = k_fmt.n_kv_heads, k_fmt.head_dim
    if (v_fmt.n_kv_heads, v_fmt.head_dim) != (h, d):
        raise ValueError(f"K and V formats must agree on n_kv_heads and head_dim: {k_fmt} vs {v_fmt}")
    if qk.dim() != 3 or qk.shape[2] != d or qk.shape[1] <= h or qk.stride(-1) != 1 or qk.dtype not in ROW_DTYPES:
        raise ValueError(f"qk must be [n, n_heads + {h}, {d}] in {ROW_DTYPES} with contiguous heads, got "
                         f"{qk.dtype} {tuple(qk.shape)} stride {qk.stride()}")
    n, n_heads = qk.shape[0], qk.shape[1] - h
    if v.shape != (n, h, d) or v.stride(-1) != 1 or v.dtype != qk.dtype:
        raise ValueError(f"v must be [{n}, {h}, {d}] in {qk.dtype} with contiguous heads, got {v.dtype} "
                         f"{tuple(v.shape)} stride {v.stride()}")
    if (pos.shape != (n,) or pos.dtype != torch.int64 or inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32
            or (n and pos.stride(0) != 1) or inv_freq.stride(0) != 1):
        raise ValueError(f"pos must be contiguous int64 [{n}] and inv_freq contiguous fp32 [{d // 2}], got {pos.dtype} "
                         f"{tuple(pos.shape)} and {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if slots.dtype != torch.int64 or slots.shape != (n,) or slots.stride(0) != 1:
        raise ValueError(f"slots must be contiguous int64 [{n}], got {slots.dtype} {tuple(slots.shape)}")
    check_pool(k_pool, k_fmt, "k_pool")
    check_pool(v_pool, v_fmt, "v_pool")
    q = torch.empty((n, n_heads, d), dtype=qk.dtype, device=qk.device)
    if n:
        _rope_store_kernel[(n, n_heads + 2 * h)](
            qk, v, pos, inv_freq, q, k_pool, v_pool, slots, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1),
            float(scale), N_HEADS=n_heads, N_KV_HEADS=h, HEAD_DIM=d,
            K_FMT=k_fmt.kv_type.code, K_PAGE_BYTES=k_fmt.page_bytes, K_SCALE_OFF=k_fmt.scale_offset,
            V_FMT=v_fmt.kv_type.code, V_PAGE_BYTES=v_fmt.page_bytes, V_SCALE_OFF=v_fmt.scale_offset,
            num_warps=1, enable_fp_fusion=False, **pdl_kwargs(pdl, qk.device),
        )
    return q
