"""Page gather: pages of a pool -> contiguous dequantized K (or V), for prefill attention.

``gather(pool, page_ids, n_tokens, fmt, dtype)`` returns [n_tokens, n_kv_heads, head_dim]
in fp16 / bf16 / fp32: token i is row i % 256 of page ``page_ids[i // 256]``. Values equal
``kernels.reference.gather`` exactly (dequantization is exact in fp32, then one rounding;
on CUDA the fp16 output comes from a PTX bit trick that rounds once too). One program per
(BLOCK_T tokens of a page, KV head) reads one contiguous run of quants and one of scales.
``load_tile`` (the dequantizing tile load) is shared with decode attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import PAGE_TOKENS, PageFormat
from kernels.store import check_pool

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (BLOCK_T tokens per program, num_warps). Swept on the H200 at 128K tokens, 2 KV heads x 128:
# many tiny programs win (more loads in flight per SM): (8, 1) f16 84% / q8_0 81% / q4_0 79%
# of the copy ceiling, (16, 2) 73 / 79 / 76%, (64, 4) 72 / 67 / 70%, (4, 1) 74 / 58 / 48%
# (head-major grid). Heads minor, (8, 1): 87.5 / 83.3 / 81.6% (results/kernels/variants/gather_sweep).
LAUNCH = (8, 1)


def use_asm(device: torch.device) -> bool:
    """The PTX dequantization path: NVIDIA GPUs only (not the interpreter, not ROCm)."""
    return device.type == "cuda" and torch.version.hip is None


# fp16 bit tricks (no conversion instructions: those run at 1/8 of the FMA rate and made
# dequantization, not memory, the bound): 0x6400 | u is the fp16 1024 + u for u in 0..1023.
# q8_0: u = byte ^ 0x80 = q + 128, so q = x - 1152; q4_0: u = nibble, so q = x - 1032.
_ASM_Q8 = """{ .reg .b32 t, m, a, b, c;
xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; mov.b32 c, 0x64806480;
prmt.b32 a, t, m, 0x4140; prmt.b32 b, t, m, 0x4342;
sub.rn.f16x2 a, a, c; sub.rn.f16x2 b, b, c; mul.rn.f16x2 $0, a, $3; mul.rn.f16x2 $1, b, $4; }"""
_ASM_Q4 = """{ .reg .b32 z, a, b, c;
mov.b32 z, 0; mov.b32 c, 0x64086408;
prmt.b32 a, $2, z, 0x4140; prmt.b32 b, $2, z, 0x4342; SHIFT
lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA;
sub.rn.f16x2 a, a, c; sub.rn.f16x2 b, b, c; mul.rn.f16x2 $0, a, $3; mul.rn.f16x2 $1, b, $4; }"""
_ASM_Q4_LO = tl.constexpr(_ASM_Q4.replace("SHIFT", ""))
_ASM_Q4_HI = tl.constexpr(_ASM_Q4.replace("SHIFT", "shr.b32 a, a, 4; shr.b32 b, b, 4;"))
_ASM_Q8 = tl.constexpr(_ASM_Q8)


@triton.jit
def _dequant(b_q, b_s, KIND: tl.constexpr, OUT_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """Quant bytes b_q (uint8) times fp16 scales b_s (broadcast) -> OUT_DTYPE, exactly one
    rounding. KIND 1: q8_0 byte; 2 / 3: low / high nibble of a q4_0 byte."""
    if OUT_DTYPE == tl.float16:
        if ASM:  # CUDA: 4 elements per PRMT/LOP3 pair, packed fp16x2 sub and mul
            if KIND == 1:
                return tl.inline_asm_elementwise(_ASM_Q8, "=r,=r,r,r,r", [b_q, b_s], dtype=tl.float16,
                                                 is_pure=True, pack=4)
            elif KIND == 2:
                return tl.inline_asm_elementwise(_ASM_Q4_LO, "=r,=r,r,r,r", [b_q, b_s],
                                                 dtype=tl.float16, is_pure=True, pack=4)
            else:
                return tl.inline_asm_elementwise(_ASM_Q4_HI, "=r,=r,r,r,r", [b_q, b_s],
                                                 dtype=tl.float16, is_pure=True, pack=4)
        if KIND == 1:
            b_x = ((b_q ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1152.0
        elif KIND == 2:
            b_x = ((b_q & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        else:
            b_x = ((b_q >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        return b_x * b_s
    if KIND == 1:
        b_x = b_q.to(tl.int8, bitcast=True).to(tl.float32)
    elif KIND == 2:
        b_x = (b_q & 15).to(tl.float32) - 8.0
    else:
        b_x = (b_q >> 4).to(tl.float32) - 8.0
    return (b_x * b_s.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _load(p, mask, MASKED: tl.constexpr):
    """p's elements; masked-off ones read as 0 when MASKED."""
    if MASKED:
        return tl.load(p, mask=mask, other=0)
    return tl.load(p)


@triton.jit
def _load_flat(pool, page, o_r, m_n, FMT: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_BYTES: tl.constexpr,
               SCALE_OFF: tl.constexpr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr, ASM: tl.constexpr,
               MASKED: tl.constexpr):
    """``load_tile(FLAT=True)`` of a q8_0 / q4_0 page: the quants through 2-D pointers; the
    scales load as [BLOCK_N, NB] and broadcast in registers (2-D scale pointers made Triton
    load every element's scale separately)."""
    NB: tl.constexpr = HEAD_DIM // 32
    HD2: tl.constexpr = HEAD_DIM // 2
    o_c = tl.arange(0, HD2)[None, :]
    m_e = m_n[:, None] & (o_c >= 0)
    p_page = pool + page * PAGE_BYTES
    p_s = (p_page + SCALE_OFF).to(tl.pointer_type(tl.float16))
    o_b = tl.arange(0, NB)[None, :]
    b_s = _load(p_s + o_r[:, None] * NB + o_b, m_n[:, None] & (o_b >= 0), MASKED)
    b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, NB, 16)), (BLOCK_N, HD2))
    if FMT == 1:  # q8_0: the lo half's column c is element (c // 16) * 32 + c % 16 of the row
        p_q = p_page + o_r[:, None] * HEAD_DIM + (o_c // 16) * 32 + o_c % 16
        b_lo = _dequant(_load(p_q, m_e, MASKED), b_s, 1, OUT_DTYPE, ASM)
        b_hi = _dequant(_load(p_q + 16, m_e, MASKED), b_s, 1, OUT_DTYPE, ASM)
    else:  # q4_0: byte c of the row holds the lo half's column c (low nibble) and the hi half's
        b_q = _load(p_page + o_r[:, None] * HD2 + o_c, m_e, MASKED)
        b_lo = _dequant(b_q, b_s, 2, OUT_DTYPE, ASM)
        b_hi = _dequant(b_q, b_s, 3, OUT_DTYPE, ASM)
    return b_lo, b_hi


@triton.jit
def load_tile(
    pool,  # [n_pages, PAGE_BYTES] uint8
    page,  # int64 scalar: pool page (page * PAGE_BYTES may pass 2^31)
    row0,  # int32 scalar: first (head * 256 + token) row of the tile inside the page
    m_n,  # [BLOCK_N] bool: rows to load (others read as 0)
    FMT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ASM: tl.constexpr,
    FLAT: tl.constexpr = False,
    MASKED: tl.constexpr = True,
):
    """Rows [row0, row0 + BLOCK_N) of a page, dequantized to OUT_DTYPE (exact, then one
    rounding), as halves (lo, hi), each [BLOCK_N, HEAD_DIM // 2]: lo holds elements 0..15 of
    every 32-block, hi 16..31 (the q4_0 nibble split; q8_0 / f16 use it too so callers have
    one code path). ASM: use the PTX fast path (CUDA only). FLAT: address the quants of
    q8_0 / q4_0 with 2-D pointers (column c = element (c // 16) * 32 + c % 16) instead of 3-D
    ones reshaped after the load. For a tile that feeds tl.dot, Triton then swizzles the
    bytes it stages in shared memory; the 3-D form got an unswizzled layout, whose bank
    conflicts made decode attention 11-27% slower (kernels/NOTES.md). Gather has no shared
    memory stage: it keeps the 3-D form. MASKED=False: every row is loaded (``m_n`` unread),
    which saves the predicates of a tile known to be whole."""
    NB: tl.constexpr = HEAD_DIM // 32
    o_r = row0 + tl.arange(0, BLOCK_N)  # int32: offsets inside a page
    if FLAT and FMT != 0:
        return _load_flat(pool, page, o_r, m_n, FMT, HEAD_DIM, PAGE_BYTES, SCALE_OFF, BLOCK_N, OUT_DTYPE, ASM,
                          MASKED)
    o_e = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]
    m_e = m_n[:, None, None] & (o_e >= 0)
    p_page = pool + page * PAGE_BYTES
    if FMT == 0:  # f16
        p_e = p_page.to(tl.pointer_type(tl.float16)) + o_r[:, None, None] * HEAD_DIM + o_e
        b_lo = _load(p_e, m_e, MASKED).to(OUT_DTYPE)
        b_hi = _load(p_e + 16, m_e, MASKED).to(OUT_DTYPE)
    else:
        p_s = (p_page + SCALE_OFF).to(tl.pointer_type(tl.float16))
        o_b = tl.arange(0, NB)[None, :]
        b_s = _load(p_s + o_r[:, None] * NB + o_b, m_n[:, None] & (o_b >= 0), MASKED)
        b_s = b_s[:, :, None]  # [BLOCK_N, NB, 1] fp16
        if FMT == 1:  # q8_0: int8 quants, element e of the row at byte e
            p_q = p_page + o_r[:, None, None] * HEAD_DIM + o_e
            b_lo = _dequant(_load(p_q, m_e, MASKED), b_s, 1, OUT_DTYPE, ASM)
            b_hi = _dequant(_load(p_q + 16, m_e, MASKED), b_s, 1, OUT_DTYPE, ASM)
        else:  # q4_0: byte j of a block = element j (low nibble) | element j + 16 (high)
            o_q = tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
            b_q = _load(p_page + o_r[:, None, None] * (HEAD_DIM // 2) + o_q, m_e, MASKED)
            b_lo = _dequant(b_q, b_s, 2, OUT_DTYPE, ASM)
            b_hi = _dequant(b_q, b_s, 3, OUT_DTYPE, ASM)
    return tl.reshape(b_lo, (BLOCK_N, HEAD_DIM // 2)), tl.reshape(b_hi, (BLOCK_N, HEAD_DIM // 2))


@triton.jit(do_not_specialize=["n_tokens"], do_not_specialize_on_alignment=["page_ids"])  # a slice of a table row
def _gather_kernel(
    pool,  # [n_pages, PAGE_BYTES] uint8
    page_ids,  # [>= cdiv(n_tokens, 256)] int32
    out,  # [n_tokens, N_KV_HEADS, HEAD_DIM], last dim contiguous
    n_tokens,
    stride_on,
    stride_oh,
    FMT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    N_KV_HEADS: tl.constexpr,
    ASM: tl.constexpr,
):
    # one grid axis, heads minor: neighbouring programs write one token tile's heads, so each
    # output row is written whole while it is in flight (head-major: 2.5-3 points of the copy
    # ceiling slower at 128K, results/kernels/variants/gather_sweep)
    i_t = tl.program_id(0) // N_KV_HEADS
    i_h = tl.program_id(0) % N_KV_HEADS
    TPP: tl.constexpr = 256 // BLOCK_T
    page = tl.load(page_ids + i_t // TPP).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    m_t = i_t * BLOCK_T + o_t < n_tokens
    b_lo, b_hi = load_tile(pool, page, i_h * 256 + (i_t % TPP) * BLOCK_T, m_t, FMT, HEAD_DIM,
                           PAGE_BYTES, SCALE_OFF, BLOCK_T, out.dtype.element_ty, ASM)
    NB: tl.constexpr = HEAD_DIM // 32
    o_e = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]
    p_o = out + (i_t * BLOCK_T).to(tl.int64) * stride_on  # int64: the output may pass 2^31 elements
    p_o += o_t[:, None, None] * stride_on + i_h * stride_oh + o_e
    m_o = m_t[:, None, None] & (o_e >= 0)
    tl.store(p_o, tl.reshape(b_lo, (BLOCK_T, NB, 16)), mask=m_o)
    tl.store(p_o + 16, tl.reshape(b_hi, (BLOCK_T, NB, 16)), mask=m_o)


def gather(pool: torch.Tensor, page_ids: torch.Tensor, n_tokens: int, fmt: PageFormat,
           dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize tokens [0, n_tokens) of the pages page_ids [>= cdiv(n_tokens, 256)] int32
    into out [n_tokens, n_kv_heads, head_dim] (allocated in dtype when not given)."""
    check_pool(pool, fmt)
    n_pages = -(-n_tokens // PAGE_TOKENS)
    if page_ids.dtype != torch.int32 or page_ids.dim() != 1 or page_ids.shape[0] < n_pages \
            or page_ids.stride(0) != 1:
        raise ValueError(f"page_ids must be contiguous int32 [>= {n_pages}] for {n_tokens} tokens, "
                         f"got {page_ids.dtype} {tuple(page_ids.shape)} stride {page_ids.stride()}")
    shape = (n_tokens, fmt.n_kv_heads, fmt.head_dim)
    if out is None:
        if dtype not in OUT_DTYPES:
            raise ValueError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")
        out = torch.empty(shape, dtype=dtype, device=pool.device)
    if tuple(out.shape) != shape or out.dtype not in OUT_DTYPES or out.stride(-1) != 1:
        raise ValueError(f"out must be {OUT_DTYPES} {list(shape)} with last dim contiguous, got "
                         f"{out.dtype} {tuple(out.shape)} stride {out.stride()}")
    if not (pool.device == page_ids.device == out.device):
        raise ValueError(f"pool, page_ids, out must share a device, got {pool.device}, "
                         f"{page_ids.device}, {out.device}")
    if n_tokens == 0:
        return out
    block_t, num_warps = LAUNCH
    grid = (triton.cdiv(n_tokens, block_t) * fmt.n_kv_heads,)
    _gather_kernel[grid](
        pool, page_ids, out, n_tokens, out.stride(0), out.stride(1),
        FMT=fmt.kv_type.code, HEAD_DIM=fmt.head_dim, PAGE_BYTES=fmt.page_bytes,
        SCALE_OFF=fmt.scale_offset, BLOCK_T=block_t, N_KV_HEADS=fmt.n_kv_heads, ASM=use_asm(pool.device),
        num_warps=num_warps,
    )
    return out
