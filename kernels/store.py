"""Quantize-on-store: new K (or V) rows -> their page slots, in the pool's block type.

``store(pool, rows, slots, fmt)`` writes rows [n, n_kv_heads, head_dim] (fp16 / bf16 / fp32)
into pool [n_pages, page_bytes] (layout: ``kernels.formats``) at flat slots [n] int64
(``page * 256 + token``; a negative slot skips its row). Blocks are byte-exact with
``gguf.quants.quantize`` (see ``kernels.reference.quantize`` for the exact arithmetic);
the kernel is compiled with ``enable_fp_fusion=False`` so that q4_0's ``x * id + 8.5`` is
not contracted into an FMA (which moves rare near-ties by one level, see the tests), and
divides with ``div_rn`` (Triton's ``/`` on fp32 is not correctly rounded on NVIDIA).
One program per (row, KV head); slots must point into the pool (not checked: that would
read them back to the host).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import PAGE_TOKENS, PageFormat

ROW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_half_away(v):
    """roundf as gguf's np_roundf: floor(|v|) + floor(2 * frac(|v|)), sign of v."""
    a = tl.abs(v)
    fl = tl.floor(a)
    r = fl + tl.floor(2.0 * (a - fl))
    return tl.where(v < 0, -r, r)


@triton.jit
def _inverse(d):
    """gguf's id = (d == 0 ? 0 : 1 / d), correctly rounded (Triton's fp32 `/` is not, on NVIDIA)."""
    return tl.where(d == 0, 0.0, tl.div_rn(tl.zeros_like(d) + 1.0, tl.where(d == 0, 1.0, d)))


@triton.jit
def store_row(pool, slot, i_h, b_lo, b_hi, o_b, o_j, FMT: tl.constexpr, HEAD_DIM: tl.constexpr,
              PAGE_BYTES: tl.constexpr, SCALE_OFF: tl.constexpr):
    """One (token, KV head) row, as fp32 elements 0..15 (``b_lo``) and 16..31 (``b_hi``) of each
    block [NB, 16], quantized into its page slot (``slot`` < 0: nothing written). Also the fused
    RoPE + store kernel's (kernels/rope_store.py), so both write the same bytes."""
    NB: tl.constexpr = HEAD_DIM // 32
    o_e = o_b[:, None] * 32 + o_j[None, :]  # [NB, 16]: element j < 16 of each block
    m_x = (slot + 0 * o_e) >= 0  # [NB, 16]: the interpreter mishandles scalar & tensor masks
    page = tl.where(slot >= 0, slot, 0) // 256
    row = i_h * 256 + tl.where(slot >= 0, slot, 0) % 256  # (head, token) row inside the page
    p_page = pool + page * PAGE_BYTES

    if FMT == 0:  # f16
        p_o = p_page.to(tl.pointer_type(tl.float16)) + row * HEAD_DIM + o_e
        tl.store(p_o, b_lo.to(tl.float16), mask=m_x)
        tl.store(p_o + 16, b_hi.to(tl.float16), mask=m_x)
    else:
        if FMT == 1:  # q8_0: d = amax / 127, q = roundf(x * (1 / d))
            b_amax = tl.maximum(tl.max(tl.abs(b_lo), 1), tl.max(tl.abs(b_hi), 1))
            b_d = tl.div_rn(b_amax, 127.0)
            b_id = _inverse(b_d)[:, None]
            q_lo = _round_half_away(b_lo * b_id)
            q_hi = _round_half_away(b_hi * b_id)
            q_lo = tl.where(tl.abs(q_lo) < 256, q_lo, 0.0)  # NaN/inf (1/d overflowed) -> 0 as gguf
            q_hi = tl.where(tl.abs(q_hi) < 256, q_hi, 0.0)
            p_q = p_page + row * HEAD_DIM + o_e
            tl.store(p_q, q_lo.to(tl.int8).to(tl.uint8, bitcast=True), mask=m_x)
            tl.store(p_q + 16, q_hi.to(tl.int8).to(tl.uint8, bitcast=True), mask=m_x)
        else:  # q4_0: d = v / -8 (v: first element of largest |x|), q = min(15, trunc(x/d + 8.5))
            a_lo = tl.abs(b_lo)
            a_hi = tl.abs(b_hi)
            b_amax = tl.maximum(tl.max(a_lo, 1), tl.max(a_hi, 1))[:, None]
            i_lo = tl.min(tl.where(a_lo == b_amax, o_j[None, :], 32), 1)
            i_hi = tl.min(tl.where(a_hi == b_amax, o_j[None, :] + 16, 32), 1)
            i_mx = tl.minimum(i_lo, i_hi)[:, None]
            b_mx = tl.maximum(tl.max(tl.where(o_j[None, :] == i_mx, b_lo, float("-inf")), 1),
                              tl.max(tl.where(o_j[None, :] + 16 == i_mx, b_hi, float("-inf")), 1))
            b_d = b_mx * -0.125  # == b_mx / -8 exactly (power of two), sign of zero included
            b_id = _inverse(b_d)[:, None]
            v_lo = b_lo * b_id + 8.5  # not contracted: enable_fp_fusion=False at launch
            v_hi = b_hi * b_id + 8.5
            q_lo = tl.minimum(tl.where(tl.abs(v_lo) < 256, v_lo, 0.0).to(tl.int32), 15)
            q_hi = tl.minimum(tl.where(tl.abs(v_hi) < 256, v_hi, 0.0).to(tl.int32), 15)
            p_q = p_page + row * (HEAD_DIM // 2) + o_b[:, None] * 16 + o_j[None, :]
            tl.store(p_q, (q_lo | (q_hi << 4)).to(tl.uint8), mask=m_x)
        p_s = (p_page + SCALE_OFF).to(tl.pointer_type(tl.float16)) + row * NB + o_b
        tl.store(p_s, b_d.to(tl.float16), mask=(slot + 0 * o_b) >= 0)


@triton.jit
def _store_kernel(
    x,  # [n, N_KV_HEADS, HEAD_DIM] fp16/bf16/fp32, last dim contiguous
    slots,  # [n] int64 flat slots
    pool,  # [n_pages, PAGE_BYTES] uint8
    stride_xn,
    stride_xh,
    FMT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
):
    NB: tl.constexpr = HEAD_DIM // 32
    i_n = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_b = tl.arange(0, NB)
    o_j = tl.arange(0, 16)
    o_e = o_b[:, None] * 32 + o_j[None, :]
    m_x = (slot + 0 * o_e) >= 0
    p_x = x + i_n * stride_xn + i_h * stride_xh + o_e
    b_lo = tl.load(p_x, mask=m_x).to(tl.float32)  # elements 0..15 of each block
    b_hi = tl.load(p_x + 16, mask=m_x).to(tl.float32)  # elements 16..31
    store_row(pool, slot, i_h, b_lo, b_hi, o_b, o_j, FMT, HEAD_DIM, PAGE_BYTES, SCALE_OFF)


def check_pool(pool: torch.Tensor, fmt: PageFormat, name: str = "pool") -> None:
    """A pool is uint8 [n_pages, fmt.page_bytes], rows contiguous, 16-byte aligned."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != fmt.page_bytes:
        raise ValueError(f"{name} must be uint8 [n_pages, {fmt.page_bytes}] for {fmt}, "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if pool.stride() != (fmt.page_bytes, 1):
        raise ValueError(f"{name} rows must be contiguous: stride ({fmt.page_bytes}, 1) expected, "
                         f"got {pool.stride()}")
    if pool.data_ptr() % 16:
        raise ValueError(f"{name} must start 16-byte aligned, data_ptr % 16 = {pool.data_ptr() % 16}")


def store(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fmt: PageFormat) -> None:
    """Quantize rows [n, n_kv_heads, head_dim] into pool at slots [n] int64 (in place)."""
    check_pool(pool, fmt)
    h, d = fmt.n_kv_heads, fmt.head_dim
    if rows.dim() != 3 or rows.shape[1:] != (h, d):
        raise ValueError(f"rows must be [n, {h}, {d}] for {fmt}, got {tuple(rows.shape)}")
    if rows.dtype not in ROW_DTYPES:
        raise ValueError(f"rows dtype must be one of {ROW_DTYPES}, got {rows.dtype}")
    if rows.stride(-1) != 1:
        raise ValueError(f"rows last dim must be contiguous (stride 1), got strides {rows.stride()}")
    if slots.dtype != torch.int64 or slots.shape != (rows.shape[0],) or slots.stride(0) != 1:
        raise ValueError(f"slots must be contiguous int64 [{rows.shape[0]}] (page * {PAGE_TOKENS} + "
                         f"token), got {slots.dtype} {tuple(slots.shape)} stride {slots.stride()}")
    if not (pool.device == rows.device == slots.device):
        raise ValueError(f"pool, rows, slots must share a device, got {pool.device}, "
                         f"{rows.device}, {slots.device}")
    if rows.shape[0] == 0:
        return
    _store_kernel[(rows.shape[0], h)](
        rows, slots, pool, rows.stride(0), rows.stride(1),
        FMT=fmt.kv_type.code, HEAD_DIM=d, PAGE_BYTES=fmt.page_bytes, SCALE_OFF=fmt.scale_offset,
        num_warps=1, enable_fp_fusion=False,
    )
