"""Benchmark-only variant of ``kernels.decode_attention``: S = Q K^T in int8 for q8_0 K pages.

Same call, split-K and partials as ``decode_attention.decode_attention`` (the merge is
``decode_attention.merge``, unchanged); only q8_0 K takes the new path, every other K type calls
the current kernel. Lead 1 of kernels/NOTES.md ("Leads from other implementations"), as
llama.cpp's vector kernel does with q8_1:

- once per program, the query rows (times scale * log2 e, in fp32) are quantized per row and
  32-block: ``q ~ q8 * qd``, q8 int8 in [-127, 127] rounded half away from zero, qd = amax / 127;
- per key tile, ``S = sum_b tl.dot(q8_b [rows, 32], k8_b^T [32, keys]) * qd[row, b] * kd[key, b]``
  with int32 accumulation: the raw K quants go from the (pipelined) shared-memory stage into the
  int8 MMA, no dequantization. K's bytes of one 32-block are 32 contiguous bytes of the key's row,
  so k8_b^T is K-major, the only layout 8-bit MMA operands have (no transposed byte loads).

Numerics: K and the int32 dot are exact; only q's rounding to int8 (<= qd / 2 per element) and
the fp32 products differ from the fp32 reference (the current kernel rounds q and K to fp16
instead). The tolerance is stated in tests/kernels/test_decode_attention_i8k.py. V, the softmax
and the partials are the current kernel's.

SASS (sm_90, triton 3.6, Qwen2.5-Coder-1.5B shapes; /tmp compile as experiments/kernel_sass.py):
n_q = 1 runs IMMA.16832.S8.S8 fed by ldmatrix from the cp.async (16-byte) stage, loop body 1362 ->
1191 instructions (QROW 1105) for q8_0/q4_0, but 194 -> 254 registers. n_q = 6 (64 padded rows)
runs wgmma s8 (IGMMA.64x128x32) but grows to 2236 (QROW 2075) with spills: the per-block fp32
epilogue costs per S element and block (rows x keys x NB), the dequantization it replaces per K
element (keys x D), so int8 QK pays only for <= ~32 padded rows.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels import decode_attention as da
from kernels.formats import PAGE_TOKENS, Q8_0, PageFormat
from kernels.gather import load_tile, use_asm
from kernels.reference import LOG2E, Partials

# int32 bits of the fp32 2^23 + 2^22: as fp32, the bits MAGIC + i are 2^23 + 2^22 + i for |i| < 2^22
MAGIC = tl.constexpr(0x4B400000)
MAGIC_F = tl.constexpr(12582912.0)


@triton.jit
def _load_q(q, i_q, o_h, m_m, stride_qt, stride_qh, sm_scale, B: tl.constexpr):
    """Query rows' 32-block B times sm_scale, fp32 [BLOCK_M, 32]."""
    o_d = B * 32 + tl.arange(0, 32)
    p = q + i_q[:, None] * stride_qt + o_h[:, None] * stride_qh + o_d[None, :]
    return tl.load(p, mask=m_m[:, None], other=0.0).to(tl.float32) * sm_scale


@triton.jit
def _quant_q(x, amax):
    """x [BLOCK_M, 32] -> int8 quants (half away from zero) and fp32 scales amax / 127 [BLOCK_M].
    div_rn: Triton's fp32 `/` is not correctly rounded on NVIDIA; the test emulates the quants."""
    c127 = tl.full(amax.shape, 127.0, tl.float32)
    inv = tl.where(amax > 0, tl.div_rn(c127, tl.where(amax > 0, amax, 1.0)), 0.0)  # rows of padding: 0
    r = x * inv[:, None]
    q8 = (r + tl.where(r >= 0, 0.5, -0.5)).to(tl.int32)  # trunc(r +- 0.5)
    return tl.minimum(tl.maximum(q8, -127), 127).to(tl.int8), tl.div_rn(amax, c127)


@triton.jit
def _qk_block(b_s, q8, qd, p_k, m_k, kd, B: tl.constexpr, QROW: tl.constexpr):
    """b_s plus block B's int8 dot q8 . k8_B^T, scaled: by qd[:, None] * kd[None, :] (QROW False),
    or (QROW) by kd only, as the fp32 whose bits are int32 MAGIC + dot: the MMA's accumulator
    starts at MAGIC, so the conversion costs nothing; the caller subtracts 2^23 + 2^22 per
    unit of kd and applies the row scale once. Exact: |dot| <= 32 * 127 * 128 < 2^22."""
    k8 = tl.load(p_k + B * 32, mask=m_k[:, None], other=0)  # [BLOCK_N, 32] int8, 2 x 16 B per key
    if QROW:
        b_i = tl.dot(q8, tl.trans(k8), tl.full(b_s.shape, MAGIC, tl.int32), out_dtype=tl.int32)
        return b_s + b_i.to(tl.float32, bitcast=True) * kd[None, :]
    b_i = tl.dot(q8, tl.trans(k8), out_dtype=tl.int32)
    return b_s + b_i.to(tl.float32) * (qd[:, None] * kd[None, :])


@triton.jit(do_not_specialize=["n_splits"], do_not_specialize_on_alignment=da.UNALIGNED)
def _decode_attention_i8k_kernel(
    q, k_pool, v_pool, page_table, p_len, p_start, p_end, out, part_m, part_l, part_acc,
    sm_scale, n_splits, stride_qt, stride_qh, stride_ot, stride_oh,
    N_Q: tl.constexpr,
    GQA: tl.constexpr,
    N_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_FMT: tl.constexpr,  # 1 (q8_0) only; kept so the signature is the current kernel's
    K_PAGE_BYTES: tl.constexpr,
    K_SCALE_OFF: tl.constexpr,
    V_FMT: tl.constexpr,
    V_PAGE_BYTES: tl.constexpr,
    V_SCALE_OFF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_END: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    ASM: tl.constexpr,
    QROW: tl.constexpr = False,  # one q scale per row (not per 32-block): fewer ops per S element
):
    # arguments, key range, split share, rows, loop and write-out: as _decode_attention_kernel
    NB: tl.constexpr = HEAD_DIM // 32
    TPP: tl.constexpr = 256 // BLOCK_N
    i_h = tl.program_id(0)
    i_s = tl.program_id(1)
    L = tl.load(p_len).to(tl.int32)
    ks = L * 0
    if HAS_START:
        ks = tl.maximum(tl.load(p_start).to(tl.int32), 0)
    ke = L
    if HAS_END:
        ke = tl.minimum(tl.load(p_end).to(tl.int32), L)
    t_lo = ks // BLOCK_N
    t_hi = tl.maximum((ke + BLOCK_N - 1) // BLOCK_N, t_lo)
    per = (t_hi - t_lo + n_splits - 1) // n_splits
    t0 = t_lo + i_s * per
    t1 = tl.minimum(t0 + per, t_hi)

    o_m = tl.arange(0, BLOCK_M)
    i_q = o_m // GQA
    m_m = o_m < N_Q * GQA
    o_h = i_h * GQA + o_m % GQA
    o_row = i_q * N_HEADS + o_h
    q_pos = L - N_Q + i_q
    o_e = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]
    m_e = m_m[:, None, None] & (o_e >= 0)

    # the query blocks, quantized once (HEAD_DIM is 64 or 128: 2 or 4 blocks)
    x_0 = _load_q(q, i_q, o_h, m_m, stride_qt, stride_qh, sm_scale, 0)
    x_1 = _load_q(q, i_q, o_h, m_m, stride_qt, stride_qh, sm_scale, 1)
    a_0 = tl.max(tl.abs(x_0), 1)
    a_1 = tl.max(tl.abs(x_1), 1)
    if NB == 4:
        x_2 = _load_q(q, i_q, o_h, m_m, stride_qt, stride_qh, sm_scale, 2)
        x_3 = _load_q(q, i_q, o_h, m_m, stride_qt, stride_qh, sm_scale, 3)
        a_2 = tl.max(tl.abs(x_2), 1)
        a_3 = tl.max(tl.abs(x_3), 1)
        if QROW:
            a_0 = tl.maximum(tl.maximum(a_0, a_1), tl.maximum(a_2, a_3))
            a_1, a_2, a_3 = a_0, a_0, a_0
        q8_2, qd_2 = _quant_q(x_2, a_2)
        q8_3, qd_3 = _quant_q(x_3, a_3)
    elif QROW:
        a_0 = tl.maximum(a_0, a_1)
        a_1 = a_0
    q8_0, qd_0 = _quant_q(x_0, a_0)
    q8_1, qd_1 = _quant_q(x_1, a_1)

    o_c = tl.arange(0, 32)
    o_b = tl.arange(0, NB)
    b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc_lo = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    b_acc_hi = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    for i_t in range(t0, t1):
        page = tl.load(page_table + i_t // TPP).to(tl.int64)
        row0 = i_h * 256 + (i_t % TPP) * BLOCK_N
        o_k = i_t * BLOCK_N + tl.arange(0, BLOCK_N)
        m_k = (o_k >= ks) & (o_k < ke)
        o_r = row0 + tl.arange(0, BLOCK_N)
        p_page = k_pool + page * K_PAGE_BYTES
        p_k = p_page.to(tl.pointer_type(tl.int8)) + o_r[:, None] * HEAD_DIM + o_c[None, :]
        # the tile's scales as one [BLOCK_N, NB] load (8 bytes per key at D 128), split in registers
        p_sc = (p_page + K_SCALE_OFF).to(tl.pointer_type(tl.float16))
        b_kd = tl.load(p_sc + o_r[:, None] * NB + o_b[None, :], mask=m_k[:, None], other=0.0).to(tl.float32)
        b_s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if QROW:  # each block's fp32 carries 2^23 + 2^22 times its kd: start from minus their sum
            b_s += (tl.sum(b_kd, 1) * -MAGIC_F)[None, :]
        if NB == 4:  # column b = 2 * i + j of [BLOCK_N, 2, 2]: split j, then i
            kd_02, kd_13 = tl.split(tl.reshape(b_kd, (BLOCK_N, 2, 2)))
            kd_0, kd_2 = tl.split(kd_02)
            kd_1, kd_3 = tl.split(kd_13)
            b_s = _qk_block(b_s, q8_0, qd_0, p_k, m_k, kd_0, 0, QROW)
            b_s = _qk_block(b_s, q8_1, qd_1, p_k, m_k, kd_1, 1, QROW)
            b_s = _qk_block(b_s, q8_2, qd_2, p_k, m_k, kd_2, 2, QROW)
            b_s = _qk_block(b_s, q8_3, qd_3, p_k, m_k, kd_3, 3, QROW)
        else:
            kd_0, kd_1 = tl.split(b_kd)
            b_s = _qk_block(b_s, q8_0, qd_0, p_k, m_k, kd_0, 0, QROW)
            b_s = _qk_block(b_s, q8_1, qd_1, p_k, m_k, kd_1, 1, QROW)
        if QROW:
            b_s = b_s * qd_0[:, None]
        b_s = tl.where(m_k[None, :] & (o_k[None, :] <= q_pos[:, None]), b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_use)
        b_p = tl.exp2(b_s - b_m_use[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v_lo, b_v_hi = load_tile(v_pool, page, row0, m_k, V_FMT, HEAD_DIM, V_PAGE_BYTES,
                                   V_SCALE_OFF, BLOCK_N, tl.float16, ASM, FLAT=True)
        b_p = b_p.to(tl.float16)
        b_acc_lo = tl.dot(b_p, b_v_lo, b_acc_lo * b_alpha[:, None])
        b_acc_hi = tl.dot(b_p, b_v_hi, b_acc_hi * b_alpha[:, None])
        b_m = b_m_new

    if WRITE_OUT:
        b_inv = 1.0 / tl.where(b_l == 0, 1.0, b_l)
        p_o = out + i_q[:, None, None] * stride_ot + o_h[:, None, None] * stride_oh + o_e
        tl.store(p_o, tl.reshape(b_acc_lo * b_inv[:, None], (BLOCK_M, NB, 16)).to(out.dtype.element_ty), mask=m_e)
        tl.store(p_o + 16, tl.reshape(b_acc_hi * b_inv[:, None], (BLOCK_M, NB, 16)).to(out.dtype.element_ty),
                 mask=m_e)
    else:
        o_p = i_s * (N_Q * N_HEADS) + o_row
        tl.store(part_m + o_p, b_m, mask=m_m)
        tl.store(part_l + o_p, b_l, mask=m_m)
        p_a = part_acc + o_p[:, None, None] * HEAD_DIM + o_e
        tl.store(p_a, tl.reshape(b_acc_lo, (BLOCK_M, NB, 16)), mask=m_e)
        tl.store(p_a + 16, tl.reshape(b_acc_hi, (BLOCK_M, NB, 16)), mask=m_e)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     page_table: torch.Tensor, seq_len, k_fmt: PageFormat, v_fmt: PageFormat, *,
                     scale: float | None = None, key_start=None, key_end=None,
                     n_splits: int | None = None, return_partials: bool = False,
                     out: torch.Tensor | None = None, partials: Partials | None = None,
                     qrow: bool = False):
    """``decode_attention.decode_attention`` with int8 QK for q8_0 K; other K types (and inputs the
    q8_0 path does not take) call the current launcher. Benchmark-only: for q8_0 K it checks only
    what the launch needs (the current launcher's checks are not repeated). qrow: one q scale per
    row instead of per (row, 32-block)."""
    kw = dict(scale=scale, key_start=key_start, key_end=key_end, n_splits=n_splits,
              return_partials=return_partials, out=out, partials=partials)
    if k_fmt.kv_type != Q8_0:
        return da.decode_attention(q, k_pool, v_pool, page_table, seq_len, k_fmt, v_fmt, **kw)
    n_q, n_heads, d = q.shape
    h = k_fmt.n_kv_heads
    if q.stride(-1) != 1 or d != k_fmt.head_dim or n_heads % h or not 1 <= n_q <= da.MAX_N_Q:
        return da.decode_attention(q, k_pool, v_pool, page_table, seq_len, k_fmt, v_fmt, **kw)  # raises
    gqa = n_heads // h
    block_m = da.block_rows(n_q, gqa)
    dev = q.device
    max_keys = page_table.shape[0] * PAGE_TOKENS
    if isinstance(key_start, int) and isinstance(key_end, int):
        max_keys = min(max_keys, max(1, key_end - key_start))
    block_n, num_warps, num_stages, _ = da.LAUNCH[block_m]
    if n_splits is None:
        n_splits = da.splits_for(n_q, n_heads, h, max_keys, dev)
    write_out = n_splits == 1 and not return_partials
    if out is None:
        out = torch.empty_like(q)
    f32 = dict(dtype=torch.float32, device=dev)
    if partials is None:
        part = Partials(torch.empty(n_splits, n_q, n_heads, **f32), torch.empty(n_splits, n_q, n_heads, **f32),
                        torch.empty(n_splits, n_q, n_heads, d, **f32))
    else:
        part = Partials(*(x[:n_splits] for x in partials))
    p_len = da._device_scalar(seq_len, dev, "seq_len")
    p_start = da._device_scalar(key_start, dev, "key_start") if key_start is not None else p_len
    p_end = da._device_scalar(key_end, dev, "key_end") if key_end is not None else p_len
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _decode_attention_i8k_kernel[(h, n_splits)](
        q, k_pool, v_pool, page_table, p_len, p_start, p_end, out, *part, scale * LOG2E, n_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        N_Q=n_q, GQA=gqa, N_HEADS=n_heads, HEAD_DIM=d,
        K_FMT=k_fmt.kv_type.code, K_PAGE_BYTES=k_fmt.page_bytes, K_SCALE_OFF=k_fmt.scale_offset,
        V_FMT=v_fmt.kv_type.code, V_PAGE_BYTES=v_fmt.page_bytes, V_SCALE_OFF=v_fmt.scale_offset,
        BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_START=key_start is not None, HAS_END=key_end is not None, WRITE_OUT=write_out,
        ASM=use_asm(dev), QROW=qrow, num_warps=num_warps, num_stages=num_stages,
    )
    if return_partials:
        return part
    if not write_out:
        da.merge(part, out=out)
    return out
