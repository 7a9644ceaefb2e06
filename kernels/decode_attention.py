"""Paged decode attention over quantized KV pages, with the verify batch, split-K and merge.

``decode_attention(q, k_pool, v_pool, page_table, seq_len, k_fmt, v_fmt)``: the queries of
one sequence, q [n_q, n_heads, head_dim] (n_q = 1..16: 1 + draft length) at positions
[L - n_q, L), attend causally to the keys at logical positions [key_start, key_end) ∩ [0, L)
(default: all of [0, L)). Logical page i lives at pool page ``page_table[i]`` (int32),
pages laid out as in ``kernels.formats``; K and V may have different block types.

- GQA: one program per (KV head, split) covers all of its query heads x query tokens
  (``n_q * n_heads / n_kv_heads`` rows, padded to BLOCK_M >= 16 for tl.dot), so each
  dequantized K/V tile is loaded once and reused by every row.
- Split-K: each program takes an equal share of the key tiles in the range (computed on the
  device from seq_len / key_start / key_end, which may be int or 1-element device tensors)
  and writes partials (m, l, acc in base 2, see ``kernels.reference``); ``merge`` combines
  them. Grids and split counts come from shapes only, so the call is CUDA-graph capturable
  when the lengths are device tensors.
- Segments: ``return_partials=True`` returns the partials; partials of disjoint key sets
  (resident pages from the arena pool, streamed pages from ring slots, each with its own
  page table and key range) merge with ``merge`` to the one-pass result, up to fp32 rounding
  (another summation order).
- Rounds: ``carry=`` runs one call's splits over keys read in increasing, tile-aligned ranges
  (pages streamed through a ring), each split's state carried in ``partials`` from round to
  round: the result equals the one call's bit for bit (a merge of segments does not).
- Precision: q (scaled by scale * log2 e), the dequantized K/V tiles and the probabilities
  are rounded to fp16 for tl.dot (pages hold fp16 values or fp16 scales, so fp16 loses
  nothing more for K/V; a bf16 q beyond fp16 range after scaling would overflow);
  accumulation, softmax and partials are fp32.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.formats import PAGE_TOKENS, PageFormat
from kernels.gather import load_tile, use_asm
from kernels.pdl import kwargs as pdl_kwargs, wait_then_release
from kernels.q8_gemv import QK, q8_quant, q8_scale
from kernels.reference import LOG2E, Partials
from kernels.store import check_pool

Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_N_Q = 16

# merge: splits per pass, columns per program. A grid of at most one program per SM (n_q = 1:
# 12 rows x 4) is latency-bound: one pass over up to 512 splits (4.7 -> 3.4 us at 264 splits on
# the H200); larger grids keep 256 (512 was slower at n_q = 6, 528 splits: 12.9 vs 10.4 us).
# results/kernels/variants/flat_tiles_and_merge.csv
MERGE_BLOCK_S, MERGE_BLOCK_S_FEW, MERGE_BLOCK_D = 256, 512, 32
# BLOCK_M (query rows per KV head, padded) -> (BLOCK_N keys per tile, num_warps, num_stages,
# programs per SM that split-K aims for). Swept on the H200 (sm_90) at head_dim 128, 64K,
# q8_0/q4_0 and f16/f16 (bench_kernels.py --sweep, kernels/NOTES.md). The kernel is bound by
# its instruction count and their latency (dequantization, layout moves, global loads), not
# DRAM. 16/32 rows: 2 warps, 64-key tiles,
# ~4 programs per SM (f16 31 us vs 41 us with 4 warps; q8_0/q4_0 26.3 vs 26.6 us).
# 64 rows: 128-key tiles and 4 warps keep wgmma tiles full (34.5 us vs 36.0 with 64 keys).
# 128 rows (n_q * GQA > 64): 8 warps to hold the 128 x head_dim fp32 accumulator; not swept.
# Capping registers (maxnreg 128: 16 warps per SM) gained at most 6-9% at 16 rows and nothing at
# 32 / 64 rows, so no row caps them (results/kernels/variants/launch_regs).
# Pointers whose offset follows the layer or the plan (a page-table row, a round's key scalars,
# partials rows a caller places in a larger buffer): Triton compiles one variant per 16-byte
# alignment of a specialized pointer, so these are not specialized: with rows of max_pages int32
# (max_pages % 4 != 0), 3 layers in 4 would need other variants of the multi-round calls,
# compiled at the first multi-round step in mid-decode (2.3-2.5 s on the H200). They are scalar
# loads and small stores; part_acc's rows are always 16-byte multiples and stay specialized.
UNALIGNED = ["page_table", "p_len", "p_start", "p_end", "part_m", "part_l"]


class Launch(NamedTuple):
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    programs_per_sm: int  # what the split count aims for
    maxnreg: int | None = None  # registers per thread cap (more programs resident per SM)


LAUNCH = {16: Launch(64, 2, 2, 4), 32: Launch(64, 2, 2, 4), 64: Launch(128, 4, 2, 2),
          128: Launch(64, 8, 2, 2)}


@triton.jit
def _tile(b_q_lo, b_q_hi, b_m, b_l, b_acc_lo, b_acc_hi, k_pool, v_pool, page_table, i_t, i_h, ks, ke, q_pos,
          K_FMT: tl.constexpr, K_PAGE_BYTES: tl.constexpr, K_SCALE_OFF: tl.constexpr, V_FMT: tl.constexpr,
          V_PAGE_BYTES: tl.constexpr, V_SCALE_OFF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
          ASM: tl.constexpr, MASKED: tl.constexpr):
    """One key tile's online-softmax update of the (m, l, acc) state. MASKED: some of its keys may lie
    outside [ks, ke) or after a query's position (without it: none do, so nothing is masked)."""
    TPP: tl.constexpr = 256 // BLOCK_N  # tiles per page
    page = tl.load(page_table + i_t // TPP).to(tl.int64)
    row0 = i_h * 256 + (i_t % TPP) * BLOCK_N
    o_k = i_t * BLOCK_N + tl.arange(0, BLOCK_N)  # logical key positions
    m_k = (o_k >= ks) & (o_k < ke)
    b_k_lo, b_k_hi = load_tile(k_pool, page, row0, m_k, K_FMT, HEAD_DIM, K_PAGE_BYTES,
                               K_SCALE_OFF, BLOCK_N, tl.float16, ASM, FLAT=True, MASKED=MASKED)
    b_s = tl.dot(b_q_lo, tl.trans(b_k_lo))
    b_s = tl.dot(b_q_hi, tl.trans(b_k_hi), b_s)
    if MASKED:
        b_s = tl.where(m_k[None, :] & (o_k[None, :] <= q_pos[:, None]), b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    if MASKED:
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows with nothing seen yet
    else:  # every row saw this tile's keys
        b_m_use = b_m_new
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_v_lo, b_v_hi = load_tile(v_pool, page, row0, m_k, V_FMT, HEAD_DIM, V_PAGE_BYTES,
                               V_SCALE_OFF, BLOCK_N, tl.float16, ASM, FLAT=True, MASKED=MASKED)
    b_p = b_p.to(tl.float16)
    b_acc_lo = tl.dot(b_p, b_v_lo, b_acc_lo * b_alpha[:, None])
    b_acc_hi = tl.dot(b_p, b_v_hi, b_acc_hi * b_alpha[:, None])
    return b_m_new, b_l, b_acc_lo, b_acc_hi


@triton.jit(do_not_specialize=["n_splits"], do_not_specialize_on_alignment=UNALIGNED)
def _decode_attention_kernel(
    q,  # [N_Q, N_HEADS, HEAD_DIM], last dim contiguous
    k_pool,  # [n_pages_k, K_PAGE_BYTES] uint8
    v_pool,  # [n_pages_v, V_PAGE_BYTES] uint8
    page_table,  # [max_pages] int32: logical page -> pool page
    p_len,  # [1] int: sequence length L (queries at [L - N_Q, L))
    p_start,  # [1] int: first key position (HAS_START)
    p_end,  # [1] int: end of the key range (HAS_END)
    out,  # [N_Q, N_HEADS, HEAD_DIM] (WRITE_OUT)
    part_m,  # [n_splits, N_Q, N_HEADS] fp32
    part_l,  # [n_splits, N_Q, N_HEADS] fp32
    part_acc,  # [n_splits, N_Q, N_HEADS, HEAD_DIM] fp32
    sm_scale,  # softmax scale * log2(e)
    n_splits,  # programs per KV head (grid axis 1)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    N_Q: tl.constexpr,
    GQA: tl.constexpr,
    N_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_FMT: tl.constexpr,
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
    ROUND: tl.constexpr,  # the splits of one call over [0, L); this call runs their tiles in [ks, ke)
    CARRY: tl.constexpr,  # ROUND: start from the state the partials rows hold (an earlier round's)
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    NB: tl.constexpr = HEAD_DIM // 32
    # int64 where a value can pass 2^31: page * PAGE_BYTES (in load_tile); positions, rows
    # and offsets inside a page or a small tensor stay int32 (per-element int64 address math
    # costs instructions in the hot loop)
    i_h = tl.program_id(0)
    i_s = tl.program_id(1)

    # key range [ks, ke) and this split's share of its tiles (BLOCK_N keys, inside one page)
    L = tl.load(p_len).to(tl.int32)
    ks = L * 0
    if HAS_START:
        ks = tl.maximum(tl.load(p_start).to(tl.int32), 0)
    ke = L
    if HAS_END:
        ke = tl.minimum(tl.load(p_end).to(tl.int32), L)
    if ROUND:  # split i_s of one call over every key, restricted to this round's tiles
        t_all = (L + BLOCK_N - 1) // BLOCK_N
        per = (t_all + n_splits - 1) // n_splits
        t0 = tl.maximum(i_s * per, ks // BLOCK_N)
        t1 = tl.minimum(tl.minimum(i_s * per + per, t_all), (ke + BLOCK_N - 1) // BLOCK_N)
    else:
        t_lo = ks // BLOCK_N
        t_hi = tl.maximum((ke + BLOCK_N - 1) // BLOCK_N, t_lo)
        per = (t_hi - t_lo + n_splits - 1) // n_splits
        t0 = t_lo + i_s * per
        t1 = tl.minimum(t0 + per, t_hi)

    # rows: m = i_q * GQA + i_g  <->  query token i_q, query head i_h * GQA + i_g
    o_m = tl.arange(0, BLOCK_M)
    i_q = o_m // GQA
    m_m = o_m < N_Q * GQA
    o_row = i_q * N_HEADS + i_h * GQA + o_m % GQA  # (token, head) row index
    q_pos = L - N_Q + i_q  # [BLOCK_M] query positions
    o_e = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]
    m_e = m_m[:, None, None] & (o_e >= 0)
    p_q = q + i_q[:, None, None] * stride_qt \
        + (i_h * GQA + o_m % GQA)[:, None, None] * stride_qh + o_e
    b_q_lo = tl.reshape(tl.load(p_q, mask=m_e, other=0.0).to(tl.float32) * sm_scale,
                        (BLOCK_M, HEAD_DIM // 2)).to(tl.float16)
    b_q_hi = tl.reshape(tl.load(p_q + 16, mask=m_e, other=0.0).to(tl.float32) * sm_scale,
                        (BLOCK_M, HEAD_DIM // 2)).to(tl.float16)

    o_p = i_s * (N_Q * N_HEADS) + o_row  # [BLOCK_M] partial rows of this split
    p_a = part_acc + o_p[:, None, None] * HEAD_DIM + o_e
    # a round with no tile of this split leaves its state as it is (CARRY) or starts it (first round)
    m_w = m_m
    if CARRY:  # the state exactly as the last round left it: the same sums as one call's
        m_w = m_m & (o_m * 0 + t0 < t1)
        b_m = tl.load(part_m + o_p, mask=m_w, other=float("-inf"))
        b_l = tl.load(part_l + o_p, mask=m_w, other=0.0)
        m_a = m_w[:, None, None] & (o_e >= 0)
        b_acc_lo = tl.reshape(tl.load(p_a, mask=m_a, other=0.0), (BLOCK_M, HEAD_DIM // 2))
        b_acc_hi = tl.reshape(tl.load(p_a + 16, mask=m_a, other=0.0), (BLOCK_M, HEAD_DIM // 2))
    else:
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_acc_lo = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
        b_acc_hi = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    # tiles whose keys all lie in [ks, ke) and at or before every query's position need no mask:
    # the predicated loads, the causal select and the guard for rows with nothing seen are 12-21%
    # of the loop's sm_90 instructions at n_q = 1 and 21-34% at n_q = 6 (results/kernels/sass).
    # Only a range's first tile and its last one or two can be partial (run unpipelined), and the
    # tiles keep the one loop's order, so every sum is as before
    t_a = tl.minimum(tl.maximum((ks + BLOCK_N - 1) // BLOCK_N, t0), t1)
    t_b = tl.minimum(tl.maximum(tl.minimum(ke, L - N_Q + 1) // BLOCK_N, t_a), t1)
    if HAS_START:
        for i_t in tl.range(t0, t_a, num_stages=1):
            b_m, b_l, b_acc_lo, b_acc_hi = _tile(
                b_q_lo, b_q_hi, b_m, b_l, b_acc_lo, b_acc_hi, k_pool, v_pool, page_table, i_t, i_h, ks, ke,
                q_pos, K_FMT, K_PAGE_BYTES, K_SCALE_OFF, V_FMT, V_PAGE_BYTES, V_SCALE_OFF, HEAD_DIM, BLOCK_N,
                ASM, True)
    for i_t in range(t_a, t_b):
        b_m, b_l, b_acc_lo, b_acc_hi = _tile(
            b_q_lo, b_q_hi, b_m, b_l, b_acc_lo, b_acc_hi, k_pool, v_pool, page_table, i_t, i_h, ks, ke,
            q_pos, K_FMT, K_PAGE_BYTES, K_SCALE_OFF, V_FMT, V_PAGE_BYTES, V_SCALE_OFF, HEAD_DIM, BLOCK_N,
            ASM, False)
    for i_t in tl.range(t_b, t1, num_stages=1):
        b_m, b_l, b_acc_lo, b_acc_hi = _tile(
            b_q_lo, b_q_hi, b_m, b_l, b_acc_lo, b_acc_hi, k_pool, v_pool, page_table, i_t, i_h, ks, ke,
            q_pos, K_FMT, K_PAGE_BYTES, K_SCALE_OFF, V_FMT, V_PAGE_BYTES, V_SCALE_OFF, HEAD_DIM, BLOCK_N,
            ASM, True)

    if WRITE_OUT:  # single split: normalise here, no combine launch
        b_inv = 1.0 / tl.where(b_l == 0, 1.0, b_l)
        p_o = out + i_q[:, None, None] * stride_ot \
            + (i_h * GQA + o_m % GQA)[:, None, None] * stride_oh + o_e
        b_o_lo = tl.reshape(b_acc_lo * b_inv[:, None], (BLOCK_M, NB, 16))
        b_o_hi = tl.reshape(b_acc_hi * b_inv[:, None], (BLOCK_M, NB, 16))
        tl.store(p_o, b_o_lo.to(out.dtype.element_ty), mask=m_e)
        tl.store(p_o + 16, b_o_hi.to(out.dtype.element_ty), mask=m_e)
    else:
        tl.store(part_m + o_p, b_m, mask=m_w)
        tl.store(part_l + o_p, b_l, mask=m_w)
        m_a = m_w[:, None, None] & (o_e >= 0)
        tl.store(p_a, tl.reshape(b_acc_lo, (BLOCK_M, NB, 16)), mask=m_a)
        tl.store(p_a + 16, tl.reshape(b_acc_hi, (BLOCK_M, NB, 16)), mask=m_a)


@triton.jit(do_not_specialize=["n_splits"])
def _merge_kernel(
    part_m,  # [n_splits, N_Q * N_HEADS] fp32
    part_l,  # [n_splits, N_Q * N_HEADS] fp32
    part_acc,  # [n_splits, N_Q * N_HEADS, HEAD_DIM] fp32
    out,  # [N_Q, N_HEADS, HEAD_DIM], last dim contiguous
    q_out,  # [N_Q, N_HEADS * HEAD_DIM] int8 (Q8): each output row's q8_0 quants
    d_out,  # [N_Q, N_HEADS * HEAD_DIM / 32] fp16 (Q8): their scales
    n_splits,
    stride_ot,
    stride_oh,
    N_ROWS: tl.constexpr,
    N_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q8: tl.constexpr,  # also the output's q8_0 blocks (BLOCK_D = 32: a program's columns are one block)
    PDL: tl.constexpr,
):
    wait_then_release(PDL)
    # one program per (row, BLOCK_D columns): all splits' loads in flight at once (a loop
    # of dependent loads in 12 programs took 19 us at 132 splits)
    i_r = tl.program_id(0)  # row = i_q * N_HEADS + head
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    b_mx = tl.full([], float("-inf"), tl.float32)
    b_l = tl.zeros([], tl.float32)
    b_acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < n_splits
        b_ms = tl.load(part_m + o_s * N_ROWS + i_r, mask=m_s, other=float("-inf"))
        b_ls = tl.load(part_l + o_s * N_ROWS + i_r, mask=m_s, other=0.0)
        b_mx_new = tl.maximum(b_mx, tl.max(b_ms, 0))
        b_m_use = tl.where(b_mx_new == float("-inf"), 0.0, b_mx_new)
        b_alpha = tl.exp2(b_mx - b_m_use)
        b_w = tl.exp2(b_ms - b_m_use)  # empty splits (m = -inf) weigh 0
        # not masked by l > 0: the acc loads then wait for nothing (empty splits hold zeros)
        m_a = m_s[:, None] & (o_d >= 0)[None, :]
        b_a = tl.load(part_acc + (o_s * N_ROWS + i_r)[:, None] * HEAD_DIM + o_d[None, :],
                      mask=m_a, other=0.0)
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_a, 0)
        b_l = b_l * b_alpha + tl.sum(b_w * b_ls, 0)
        b_mx = b_mx_new
    b_o = (b_acc / tl.where(b_l == 0, 1.0, b_l)).to(out.dtype.element_ty)
    p_o = out + (i_r // N_HEADS) * stride_ot + (i_r % N_HEADS) * stride_oh + o_d
    tl.store(p_o, b_o)
    if Q8:  # the rounded output's block, as the output projection's programs would quantize it (gguf's codec)
        f = b_o.to(tl.float32)
        b_d, inv = q8_scale(tl.max(tl.abs(f), 0))
        row = (i_r // N_HEADS) * (N_HEADS * HEAD_DIM) + (i_r % N_HEADS) * HEAD_DIM  # the [N_Q, H * D] row's offset
        tl.store(q_out + row + o_d, q8_quant(f * inv).to(tl.int8))
        tl.store(d_out + (row + tl.program_id(1) * BLOCK_D) // BLOCK_D, b_d.to(tl.float16))


@functools.lru_cache(maxsize=None)
def _n_sm(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # CPU / interpreter: a few splits, so tests exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(n_kv_heads: int, max_tiles: int, device: torch.device,
               programs_per_sm: int = 2) -> int:
    """Splits per KV head: ~programs_per_sm programs per SM in all, at least a tile each."""
    return max(1, min(max_tiles, triton.cdiv(programs_per_sm * _n_sm(device), n_kv_heads)))


def block_rows(n_q: int, gqa: int) -> int:
    """BLOCK_M: a KV head's query rows (n_q x its query heads), padded for tl.dot; LAUNCH's key."""
    return max(16, triton.next_power_of_2(n_q * gqa))


def splits_for(n_q: int, n_heads: int, n_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """The split count ``decode_attention`` uses for ``max_keys`` keys (its launch table's tile)."""
    launch = LAUNCH[block_rows(n_q, n_heads // n_kv_heads)]
    return num_splits(n_kv_heads, triton.cdiv(max_keys, launch.block_n) + 1, device, launch.programs_per_sm)


def round_state(q: torch.Tensor, page_table: torch.Tensor, k_fmt: PageFormat) -> Partials:
    """The ``partials`` that rounds (``carry=``) of one call over ``page_table``'s keys carry their
    state in: a row per split of that call, a size from shapes alone."""
    n_q, n_heads, d = q.shape
    rows = splits_for(n_q, n_heads, k_fmt.n_kv_heads, page_table.shape[0] * PAGE_TOKENS, q.device)
    f32 = dict(dtype=torch.float32, device=q.device)
    return Partials(torch.empty(rows, n_q, n_heads, **f32), torch.empty(rows, n_q, n_heads, **f32),
                    torch.empty(rows, n_q, n_heads, d, **f32))


def _device_scalar(x, device: torch.device, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype not in (torch.int32, torch.int64) or x.device != device:
            raise ValueError(f"{name} must be an int or a 1-element int32/int64 tensor on "
                             f"{device}, got {x.dtype} {tuple(x.shape)} on {x.device}")
        return x.reshape(1)
    return torch.full((1,), int(x), dtype=torch.int64, device=device)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     page_table: torch.Tensor, seq_len, k_fmt: PageFormat, v_fmt: PageFormat, *,
                     scale: float | None = None, key_start=None, key_end=None,
                     n_splits: int | None = None, return_partials: bool = False,
                     out: torch.Tensor | None = None, partials: Partials | None = None,
                     carry: bool | None = None, pdl: bool = False, q8_out: tuple | None = None):
    """Attention of q [n_q, n_heads, head_dim] over paged K/V: out [n_q, n_heads, head_dim]
    in q.dtype, or its Partials ([n_splits, n_q, n_heads(, head_dim)] fp32) when
    return_partials. seq_len, key_start, key_end: int or 1-element int tensor on q's device.
    ``partials``: where the partials go (its first n_splits rows, returned as a view), e.g. one
    buffer for several calls whose partials then merge without a copy.

    Rounds (``carry`` not None): a caller that reads the keys of [0, L) in rounds, contiguous
    tile-aligned key ranges in increasing order (pages streamed through a ring), gets exactly
    the one call's result. Each round runs that call's splits (``splits_for`` the whole table)
    on its own tiles, each split continuing from the state an earlier round left in
    ``partials`` (``carry=True``; the first round ``carry=False`` starts it): the same tiles in
    the same order, the same sums. Earlier rounds return the state (``return_partials=True``);
    the last one (``return_partials=False``) the output, bit-identical to one call's.
    ``pdl``: this call's kernels launch as programmatic dependents of the kernel before them
    (CUDA, ``kernels/pdl.py``). ``q8_out``: the output rows' q8_0 blocks written too (``merge``'s; the
    output then always comes from the merge, so with ``n_splits=1`` its last bit may differ from the
    call's without them, which normalises in the attention kernel). Not with ``return_partials``."""
    if q.dim() != 3 or q.dtype not in Q_DTYPES or q.stride(-1) != 1:
        raise ValueError(f"q must be [n_q, n_heads, head_dim] in {Q_DTYPES} with last dim "
                         f"contiguous, got {q.dtype} {tuple(q.shape)} stride {q.stride()}")
    n_q, n_heads, d = q.shape
    if (k_fmt.n_kv_heads, k_fmt.head_dim) != (v_fmt.n_kv_heads, v_fmt.head_dim):
        raise ValueError(f"K and V formats must agree on n_kv_heads and head_dim: {k_fmt} vs {v_fmt}")
    h = k_fmt.n_kv_heads
    if d != k_fmt.head_dim or n_heads % h:
        raise ValueError(f"q must be [n_q, a multiple of {h}, {k_fmt.head_dim}] for {k_fmt}, "
                         f"got {tuple(q.shape)}")
    if not 1 <= n_q <= MAX_N_Q:
        raise ValueError(f"n_q must be in [1, {MAX_N_Q}], got {n_q}")
    gqa = n_heads // h
    block_m = block_rows(n_q, gqa)
    if block_m not in LAUNCH:
        raise ValueError(f"n_q * n_heads / n_kv_heads must be <= {max(LAUNCH)}, got {n_q * gqa}")
    check_pool(k_pool, k_fmt, "k_pool")
    check_pool(v_pool, v_fmt, "v_pool")
    if page_table.dtype != torch.int32 or page_table.dim() != 1 or page_table.stride(0) != 1:
        raise ValueError(f"page_table must be contiguous int32 [max_pages], got {page_table.dtype} "
                         f"{tuple(page_table.shape)} stride {page_table.stride()}")
    dev = q.device
    if not (k_pool.device == v_pool.device == page_table.device == dev):
        raise ValueError(f"q, pools and page_table must share a device, got {dev}, "
                         f"{k_pool.device}, {v_pool.device}, {page_table.device}")
    max_keys = page_table.shape[0] * PAGE_TOKENS
    end = key_end if isinstance(key_end, int) else seq_len if isinstance(seq_len, int) else None
    if end is not None and end > max_keys:
        raise ValueError(f"page_table [{page_table.shape[0]}] covers {max_keys} tokens, the key "
                         f"range needs {end} ({-(-end // PAGE_TOKENS)} pages)")
    if q8_out is not None:
        if return_partials:
            raise ValueError("q8_out is the merged output's blocks: a call that returns partials has none")
        check_q8_out(q8_out, n_q, n_heads, d, dev)
    if carry is not None:  # rounds: the splits of one call over the whole table
        if partials is None or n_splits is not None:
            raise ValueError("rounds (carry=...) keep their state in partials= and take one call's split count")
        n_splits = splits_for(n_q, n_heads, h, max_keys, dev)
    if isinstance(key_start, int) and isinstance(key_end, int):
        max_keys = min(max_keys, max(1, key_end - key_start))
    launch = LAUNCH[block_m]
    if n_splits is None:
        n_splits = splits_for(n_q, n_heads, h, max_keys, dev)
    write_out = n_splits == 1 and not return_partials and q8_out is None
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype not in Q_DTYPES or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(q.shape)} in {Q_DTYPES} with last dim contiguous, "
                         f"got {out.dtype} {tuple(out.shape)} stride {out.stride()}")
    f32 = dict(dtype=torch.float32, device=dev)
    if partials is None:
        part = Partials(torch.empty(n_splits, n_q, n_heads, **f32),
                        torch.empty(n_splits, n_q, n_heads, **f32),
                        torch.empty(n_splits, n_q, n_heads, d, **f32))
    else:
        part = Partials(*(x[:n_splits] for x in partials))
        want = [(n_splits, n_q, n_heads)] * 2 + [(n_splits, n_q, n_heads, d)]
        if [tuple(x.shape) for x in part] != want or any(
                x.dtype != torch.float32 or x.device != dev or not x.is_contiguous() for x in part):
            raise ValueError(f"partials must be contiguous fp32 m, l [>= {n_splits}, {n_q}, {n_heads}] and acc "
                             f"[>= {n_splits}, {n_q}, {n_heads}, {d}] on {dev}, got "
                             f"{[(x.dtype, tuple(x.shape)) for x in partials]}")
    p_len = _device_scalar(seq_len, dev, "seq_len")
    p_start = _device_scalar(key_start, dev, "key_start") if key_start is not None else p_len
    p_end = _device_scalar(key_end, dev, "key_end") if key_end is not None else p_len
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _decode_attention_kernel[(h, n_splits)](
        q, k_pool, v_pool, page_table, p_len, p_start, p_end, out, *part, scale * LOG2E, n_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        N_Q=n_q, GQA=gqa, N_HEADS=n_heads, HEAD_DIM=d,
        K_FMT=k_fmt.kv_type.code, K_PAGE_BYTES=k_fmt.page_bytes, K_SCALE_OFF=k_fmt.scale_offset,
        V_FMT=v_fmt.kv_type.code, V_PAGE_BYTES=v_fmt.page_bytes, V_SCALE_OFF=v_fmt.scale_offset,
        BLOCK_M=block_m, BLOCK_N=launch.block_n,
        HAS_START=key_start is not None, HAS_END=key_end is not None, WRITE_OUT=write_out,
        ROUND=carry is not None, CARRY=bool(carry), ASM=use_asm(dev), **pdl_kwargs(pdl, dev),
        num_warps=launch.num_warps, num_stages=launch.num_stages,
        **({"maxnreg": launch.maxnreg} if launch.maxnreg else {}),
    )
    if return_partials:
        return part
    if not write_out:
        merge(part, out=out, pdl=pdl, q8_out=q8_out)
    return out


def check_q8_out(q8_out: tuple, n_q: int, n_heads: int, d: int, device: torch.device) -> None:
    """``q8_out`` must be (quants int8 [n_q, n_heads * d], scales fp16 [n_q, n_heads * d / 32]), contiguous, on
    ``device`` (a merge program's columns are one block)."""
    want = [((n_q, n_heads * d), torch.int8), ((n_q, n_heads * d // QK), torch.float16)]
    if MERGE_BLOCK_D != QK or [(tuple(x.shape), x.dtype) for x in q8_out] != want \
            or not all(x.is_contiguous() and x.device == device for x in q8_out):
        raise ValueError(f"q8_out must be contiguous {want} on {device}, got "
                         f"{[(tuple(x.shape), x.dtype, str(x.device)) for x in q8_out]}")


def merge(*parts: Partials, out: torch.Tensor | None = None,
          dtype: torch.dtype = torch.float16, pdl: bool = False, q8_out: tuple | None = None) -> torch.Tensor:
    """Combine partials over disjoint key sets (any split counts) -> out [n_q, n_heads, D].
    An empty split (m = -inf, l = 0) weighs 0, and its acc is read: it must be finite (the
    attention kernel writes zeros). ``q8_out``: (quants int8 [n_q, n_heads * D], scales fp16
    [n_q, n_heads * D / 32]) to write the output rows' q8_0 blocks into, as ``reference.q8_rows``
    makes them from out (the output projection's ``xq`` under ``model.weights=q8_0_int8``)."""
    if not parts:
        raise ValueError("merge needs at least one Partials")
    n_q, n_heads, d = parts[0].acc.shape[1:]
    for p in parts:
        if p.m.dtype != torch.float32 or p.acc.shape[1:] != (n_q, n_heads, d) \
                or p.m.shape != p.acc.shape[:3] or p.l.shape != p.m.shape:
            raise ValueError(f"partials must be fp32 m, l [S, {n_q}, {n_heads}] and acc "
                             f"[S, {n_q}, {n_heads}, {d}], got {p.m.dtype} "
                             f"{tuple(p.m.shape)} {tuple(p.l.shape)} {tuple(p.acc.shape)}")
    m, l, acc = (torch.cat(x).contiguous() if len(parts) > 1 else x[0].contiguous()
                 for x in zip(*parts))
    if out is None:
        out = torch.empty(n_q, n_heads, d, dtype=dtype, device=m.device)
    if out.shape != (n_q, n_heads, d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{n_q}, {n_heads}, {d}] with last dim contiguous, got "
                         f"{tuple(out.shape)} stride {out.stride()}")
    if q8_out is not None:
        check_q8_out(q8_out, n_q, n_heads, d, m.device)
    grid = (n_q * n_heads, d // MERGE_BLOCK_D)
    most = MERGE_BLOCK_S_FEW if grid[0] * grid[1] <= _n_sm(m.device) else MERGE_BLOCK_S
    block_s = min(most, triton.next_power_of_2(m.shape[0]))
    _merge_kernel[grid](
        m, l, acc, out, *(q8_out or (out, out)), m.shape[0], out.stride(0), out.stride(1),
        N_ROWS=n_q * n_heads, N_HEADS=n_heads, HEAD_DIM=d, BLOCK_S=block_s,
        BLOCK_D=MERGE_BLOCK_D, Q8=q8_out is not None, num_warps=4, **pdl_kwargs(pdl, m.device),
    )
    return out
