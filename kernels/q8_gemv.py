"""Decode matmuls with q8_0 weights on the CUDA cores: y = x @ W^T (+ bias) for a few rows x [n <= 8, K]
and W in GGML q8_0 blocks (``kernels/q8_linear.py``'s block-major layout), the weight's first tile
read before the previous kernel ends.

A decode step at batch 1 is a pass over its weights: q8_0 holds them in 1.06 bytes a value against
bf16's 2. ``kernels/q8_linear.py`` multiplies on the tensor cores in 16-row tiles with K split over
programs and a second kernel to add the partials; at one row it ran at 0.98x bf16 cuBLAS for a 1.5B
step's matmuls (kernels/NOTES.md). This kernel is ``kernels/gemv.py``'s structure for q8_0 blocks:
one program per ``block_n`` rows of W streams them in tiles of ``block_k / 32`` blocks (the next tile
in flight while one is used), no tensor-core tiles, one launch, and launched as a programmatic dependent
(``pdl=True``, ``kernels/pdl.py``) it loads its first tile before it waits for the kernel before.

Per block: the 32 products of the quants and x (exact in fp32 for 16-bit x), summed in fp32, times the block's fp16
scale, added in fp32; plus the bias in fp32, rounded once to x's dtype. The reference
(``kernels.reference.q8_linear``) dequantizes W to fp32 first: only the fp32 sum order differs
(tests/kernels/test_q8_gemv.py). ``glu=True``: W = [W_gate; W_up] [2F, K], SwiGLU in the epilogue
as ``kernels/gemv.py`` applies it.

The quants become fp32 without a conversion instruction: the byte u = q + 128 set into the low bits
of 2^23's fp32 pattern is 2^23 + u exactly, and one subtraction gives q (``I2F`` issues at a quarter
of the FMA rate, which a pass at the memory's rate of one byte a value cannot afford).

``int8=True`` (``model.weights=q8_0_int8``): each program also quantizes its x blocks to q8_0 as gguf's
codec does (scale amax / 127 by correctly rounded division, quants rounded half away from zero, the scale
kept in fp16) and takes each word's dot product with ``dp4a``: a block's sum exact in int32, times both
scales in fp32. Against the exact product of x's q8_0 round trip and W only the fp32 sum order differs;
against exact activations it is one more rounding (~1/254 of a block's largest |x|), as llama.cpp multiplies
q8_0 weights. Fewer instructions per weight byte (``experiments/kernel_sass.py --q8-gemv``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.gather import use_asm
from kernels.gemv import DTYPES, MAX_ROWS, weight_rows
from kernels.pdl import kwargs as pdl_kwargs
from kernels.q8_linear import QK, check_weight
from kernels.swiglu import silu_times


class Launch(NamedTuple):
    block_n: int  # rows of W per program (with glu, pairs of gate and up rows)
    block_k: int  # K per tile (a multiple of 32: block_k / 32 q8_0 blocks)
    num_warps: int
    split: int = 1  # programs sharing each row block's K (the last to finish adds their sums in order)


# a register of four quants -> their four fp32 values: u = q + 128 (one xor for four), each u set by a
# PRMT into the low byte of 0x4B000000 (the fp32 2^23 + u exactly), then 2^23 + 128 (0f4B000080) subtracted
_ASM_QUANTS = tl.constexpr("""{ .reg .b32 t, m;
xor.b32 t, $4, 0x80808080; mov.b32 m, 0x4B000000;
prmt.b32 $0, t, m, 0x7540; prmt.b32 $1, t, m, 0x7541; prmt.b32 $2, t, m, 0x7542; prmt.b32 $3, t, m, 0x7543;
sub.rn.f32 $0, $0, 0f4B000080; sub.rn.f32 $1, $1, 0f4B000080; sub.rn.f32 $2, $2, 0f4B000080;
sub.rn.f32 $3, $3, 0f4B000080; }""")


@triton.jit
def _quants(b_q, ASM: tl.constexpr):
    """int32 words of four quants (little-endian) -> the quants' exact fp32 values, four tensors of the
    words' shape: quant i of each word in the i-th (PTX on CUDA, the same arithmetic in Triton for the
    interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(_ASM_QUANTS, "=r,=r,=r,=r,r", [b_q], is_pure=True, pack=1,
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32))
    u = b_q.to(tl.uint32, bitcast=True) ^ 0x80808080
    return (((u & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0,
            (((u >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0,
            (((u >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0,
            ((u >> 24) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0)


_ASM_DP4A = tl.constexpr("dp4a.s32.s32 $0, $1, $2, $3;")


@triton.jit
def _dot4(a, b, ASM: tl.constexpr):
    """Elementwise dot products of the four signed bytes of int32 words a and b, exact in int32."""
    if ASM:
        return tl.inline_asm_elementwise(_ASM_DP4A, "=r,r,r,r", [a, b, tl.zeros_like(a)], dtype=tl.int32,
                                         is_pure=True, pack=1)
    return (((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
            + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))


@triton.jit
def q8_scale(amax):
    """A q8_0 block's scale from its largest |x| as gguf's codec computes it: (d = amax / 127 by correctly
    rounded division, rounded to fp16 as stored, in fp32; 1 / d of the unrounded d, 0 for a zero block)."""
    dd = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv = tl.where(dd == 0, 0.0, tl.math.div_rn(tl.full(dd.shape, 1.0, tl.float32), dd))
    return dd.to(tl.float16).to(tl.float32), inv


@triton.jit
def q8_quant(v):
    """v = x / d rounded half away from zero (gguf's ``np_roundf``), as int32 in [-127, 127]."""
    a = tl.abs(v)
    fl = tl.floor(a)
    r = fl + tl.floor(2.0 * (a - fl))
    return tl.where(v < 0, -r, r).to(tl.int32)


@triton.jit
def q8_blocks(v, NB: tl.constexpr, ROWS: tl.constexpr):
    """fp32 values [ROWS, NB * 32] in q8_0 blocks of 32 -> (quants int32 [ROWS, NB * 32], scales fp32 [ROWS, NB]):
    what a producer kernel writes for ``q8_gemv``'s ``xq`` (``kernels/rms_norm.py``, gate/up's epilogue)."""
    b = tl.reshape(v, (ROWS, NB, 32))
    dd, inv = q8_scale(tl.max(tl.abs(b), 2))
    return tl.reshape(q8_quant(b * inv[:, :, None]), (ROWS, NB * 32)), dd


@triton.jit
def _quantize_x(b_x, BB: tl.constexpr):
    """x [BB, 8, 4] (fp32, block b's value 4j + i at [b, j, i]) -> its q8_0 blocks as gguf quantizes them
    (``q8_scale``, ``q8_quant``): int32 words [BB, 8] of four quants and the fp16-rounded scales [BB] in fp32."""
    dd, inv = q8_scale(tl.max(tl.max(tl.abs(b_x), 2), 1))
    b_q = q8_quant(b_x * inv[:, None, None]) & 0xFF
    q02, q13 = tl.split(tl.reshape(b_q, (BB, 8, 2, 2)))
    q0, q2 = tl.split(q02)
    q1, q3 = tl.split(q13)
    return q0 | (q1 << 8) | (q2 << 16) | (q3 << 24), dd


@triton.jit
def _q8_gemv_kernel(x, q, d, bias, out, xq, xd, oq, od, counts, sums, N, n_w, n_blocks, stride_x, stride_o,
                    ROWS: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, GLU: tl.constexpr, INT8: tl.constexpr, XQ: tl.constexpr,
                    Q8_OUT: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    BB: tl.constexpr = BLOCK_K // 32  # q8_0 blocks per tile
    o_n, o_w = weight_rows(N, BLOCK_N, GLU)
    m_n = o_n < N
    o_b, o_8 = tl.arange(0, BB), tl.arange(0, 8)
    # this program's blocks of K: [k_lo, k_hi), a whole number of tiles
    if SPLIT == 1:  # (all of K: constants, so the loop's masks and pointers are the unsplit kernel's)
        k_lo = 0
        k_hi = n_blocks
    else:
        per = ((n_blocks + SPLIT - 1) // SPLIT + BB - 1) // BB * BB
        k_lo = tl.program_id(1) * per
        k_hi = tl.minimum(k_lo + per, n_blocks)
    # tile [BLOCK_N, BB, 8] of int32 words: block b of each of the program's rows is 8 words (32 quants);
    # rows outermost, so a thread holds the same blocks of several rows and reuses its values of x
    p_q = q + ((k_lo + o_b[None, :, None]) * n_w + o_w[:, None, None]) * 8 + o_8[None, None, :]
    p_d = d + (k_lo + o_b[None, :]) * n_w + o_w[:, None]
    m_q = m_n[:, None] & ((k_lo + o_b) < k_hi)[None, :]
    # the first tile before the wait: W is never written by the kernel this one may overlap
    b_q = tl.load(p_q, mask=m_q[:, :, None], other=0)
    b_d = tl.load(p_d, mask=m_q, other=0.0)
    if PDL:  # launched as a programmatic dependent: now wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start loading its weights
    o_r = tl.arange(0, ROWS_P)
    acc = tl.zeros([ROWS_P, BLOCK_N, BB], tl.float32)  # per block of the tile: summed over blocks at the end
    # x's values as the words hold the quants: [BB, 8, 4] -> value 4j + i of each block in the i-th
    p_x = x + (o_b[:, None, None] * 32 + o_8[None, :, None] * 4 + tl.arange(0, 4)[None, None, :])
    for b0 in range(k_lo, k_hi, BB):
        # the next tile in flight while this one is used (masked off past the program's K)
        p_q += BB * n_w * 8
        p_d += BB * n_w
        m_next = m_n[:, None] & ((b0 + BB + o_b) < k_hi)[None, :]
        b_q_next = tl.load(p_q, mask=m_next[:, :, None], other=0)
        b_d_next = tl.load(p_d, mask=m_next, other=0.0)
        f_d = b_d.to(tl.float32)
        m_x = ((b0 + o_b) < k_hi)[:, None, None]
        if not INT8:
            f0, f1, f2, f3 = _quants(b_q, ASM)
        for r in tl.static_range(ROWS):
            if XQ:  # x's q8_0 blocks as a producer kernel wrote them: quants [n, K], scales [n, K / 32]
                m_b = (b0 + o_b) < k_hi
                w_x = tl.load(xq + r * n_blocks * 8 + (b0 + o_b[:, None]) * 8 + o_8[None, :], mask=m_b[:, None],
                              other=0)
                d_x = tl.load(xd + r * n_blocks + b0 + o_b, mask=m_b, other=0.0).to(tl.float32)
            else:
                b_x = tl.load(p_x + r * stride_x + b0 * 32, mask=m_x, other=0.0).to(tl.float32)
            if INT8:  # x's blocks in q8_0 too: the block's dot product exact in int32, times both scales
                if not XQ:
                    w_x, d_x = _quantize_x(b_x, BB)
                dot = _dot4(b_q, tl.broadcast_to(w_x[None, :, :], b_q.shape), ASM)
                part = tl.sum(dot, 2).to(tl.float32) * (f_d * d_x[None, :])
            else:
                x02, x13 = tl.split(tl.reshape(b_x, (BB, 8, 2, 2)))  # (values 4j + {0, 2}, 4j + {1, 3})
                x0, x2 = tl.split(x02)
                x1, x3 = tl.split(x13)
                dot = f0 * x0[None, :, :] + f1 * x1[None, :, :] + f2 * x2[None, :, :] + f3 * x3[None, :, :]
                part = tl.sum(dot, 2) * f_d
            acc = tl.where(o_r[:, None, None] == r, acc + part[None, :, :], acc)
        b_q, b_d = b_q_next, b_d_next
    acc = tl.sum(acc, 2)
    last = True
    if SPLIT > 1:  # (not with GLU) this share's sums to the workspace; the row block's last share adds them all
        m_s = (o_r[:, None] < ROWS) & m_n[None, :]
        p_s = sums + (o_r[:, None] * SPLIT) * N + o_n[None, :]  # [row, share, N]
        tl.store(p_s + tl.program_id(1) * N, acc, mask=m_s)
        tl.debug_barrier()  # every thread's sums before the count (the atomic releases them)
        last = tl.atomic_add(counts + tl.program_id(0), 1) == SPLIT - 1
        if last:  # acq_rel: the other shares' sums are visible; added in share order, so deterministic
            acc = tl.load(p_s, mask=m_s, other=0.0, volatile=True)
            for i in tl.static_range(1, SPLIT):
                acc += tl.load(p_s + i * N, mask=m_s, other=0.0, volatile=True)
            tl.atomic_xchg(counts + tl.program_id(0), 0)  # ready for the next launch (a graph's replay too)
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if GLU:  # [rows, (column, gate | up)] -> silu(gate) * up, rounded as the unfused kernels round
        g, u = tl.split(tl.reshape(acc.to(out.dtype.element_ty), (ROWS_P, BLOCK_N // 2, 2)))
        o_c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        h = silu_times(g, u)
        m_o = (o_r[:, None] < ROWS) & (o_c < N)[None, :]
        tl.store(out + o_r[:, None] * stride_o + o_c[None, :], h, mask=m_o)
        if Q8_OUT and BLOCK_N >= 64:  # the program's columns are whole q8_0 blocks of h: down's xq (N % 32 == 0)
            NB: tl.constexpr = BLOCK_N // 64
            h_q, h_d = q8_blocks(h.to(tl.float32), NB, ROWS_P)
            tl.store(oq + o_r[:, None] * N + o_c[None, :], h_q.to(tl.int8), mask=m_o)
            o_d = tl.program_id(0) * NB + tl.arange(0, NB)
            tl.store(od + o_r[:, None] * (N // 32) + o_d[None, :], h_d.to(tl.float16),
                     mask=(o_r[:, None] < ROWS) & (o_d < N // 32)[None, :])
        elif Q8_OUT:  # a block's 32 columns span P programs: the last of them to store its h quantizes the block
            P: tl.constexpr = 64 // BLOCK_N
            blk = tl.program_id(0) // P
            tl.debug_barrier()  # every thread's stores of h before the count (the atomic releases them)
            if tl.atomic_add(counts + blk, 1) == P - 1:  # acq_rel: the others' h is visible, read from L2
                o_h = blk * 32 + tl.arange(0, 32)
                m_b = (o_r[:, None] < ROWS) & (o_h >= 0)[None, :]
                h_b = tl.load(out + o_r[:, None] * stride_o + o_h[None, :], mask=m_b, other=0.0, volatile=True)
                h_q, h_d = q8_blocks(h_b.to(tl.float32), 1, ROWS_P)
                tl.store(oq + o_r[:, None] * N + o_h[None, :], h_q.to(tl.int8), mask=m_b)
                tl.store(od + o_r[:, None] * (N // 32) + blk + tl.arange(0, 1)[None, :], h_d.to(tl.float16),
                         mask=o_r[:, None] < ROWS)
                tl.atomic_xchg(counts + blk, 0)  # ready for the next launch (a graph's replay too)
    elif last:
        tl.store(out + o_r[:, None] * stride_o + o_n[None, :], acc.to(out.dtype.element_ty),
                 mask=(o_r[:, None] < ROWS) & m_n[None, :])


def launch_for(n: int, k: int, int8: bool = False, xq: bool = False, q8_out: bool = False) -> Launch:
    """W [n, k]'s launch, the fastest of a sweep on the H200 at one row with PDL for the 1.5B's matrices
    (results/kernels/q8_gemv): a long K (down's 8960) 4 rows a program, 2048-wide tiles on 8 warps (10.2
    against 12.3 us for 1024 on 4); many rows (gate/up, the LM head) 16 rows a program, 512-wide tiles on
    4 warps (11.4 / 79.4 against 18.0 / 127.9 us for 8 rows, 1024-wide tiles); the others (Q/K/V, output)
    8 rows, 2048-wide tiles, 4 warps. Each thread then reuses its values of x for several rows.
    ``int8`` (each program quantizes all of x's K itself: more rows a program share that work): down 8
    rows, 2048-wide tiles, 8 warps (9.6 against 19.3 us for 16 rows, 512-wide, 4 warps); the LM head 32
    rows, 512-wide, 4 warps (63.3); gate/up 16 rows, 512-wide (10.9); Q/K/V and output 16 rows,
    2048-wide, 4 warps (2.8 / 2.6 against 4.0 / 3.6 us). ``xq`` (x's blocks given): down 4 rows, 2048-wide
    tiles, 4 warps (6.7 us); the LM head 16 rows, 512-wide (61.2); gate/up 8 rows, 512-wide (9.2); Q/K/V and
    output as int8 (2.3 / 1.8). ``q8_out`` (gate/up with SwiGLU, 32 whole columns a program): 64 rows,
    256-wide tiles, 4 warps (10.9 us; 12.1 for 512-wide, 14.7 on 8 warps; 138 registers a thread on sm_90,
    56 at 8 rows). Launches of 8-32 rows whose programs share a block (``scratch``), as plain gate/up
    given x's blocks runs (9.2 us at 8 rows), are in ``bench_gemv --sweep q8x_glu``, not yet timed."""
    tile = lambda w: min(max(triton.next_power_of_2(k), QK), w)
    if q8_out:
        return Launch(64, tile(256), 4)
    if xq:
        if k >= 4096:
            return Launch(4, tile(2048), 4)
        return Launch(8 if 8192 <= n < 65536 else 16, tile(512 if n >= 8192 else 2048), 4)
    if int8:
        if k >= 4096:
            return Launch(8, tile(2048), 8)
        return Launch(32 if n >= 65536 else 16, tile(512 if n >= 8192 else 2048), 4)
    if k >= 4096:
        return Launch(4, tile(2048), 8)
    if n >= 8192:
        return Launch(16, tile(512), 4)
    return Launch(8, tile(2048), 4)


_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(kind: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros made once per (kind, shape, dtype, device) and kept: ``counts``, how many programs have stored
    each of h's blocks (``q8_out`` with fewer than 64 rows a program) or each row block's shares of K
    (``split``), which each launch leaves at zero; ``sums``, the shares' fp32 sums. One launch at a time, in
    stream order (launches of one shape on two streams at once would share them: not supported). Made outside a
    CUDA graph's capture (the call's eager run before it)."""
    key = (kind, shape, dtype, str(device))
    if key not in _SCRATCH:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"q8_gemv makes its {kind} workspace on its first call with this launch: call it once "
                               "before capturing it in a CUDA graph")
        # allocated by a thread of its own: a memory pool that routes this thread's allocations (a cache's slab,
        # whose segments a later pass reuses) does not route another thread's (torch >= 2.8), so the workspace
        # outlives it; on this thread's stream, where it is zeroed and then read
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        made = []

        def make():
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    made.append(torch.empty(shape, dtype=dtype, device=device))
            except Exception as e:  # noqa: BLE001 - raised again in the caller's thread
                made.append(e)

        t = threading.Thread(target=make)
        t.start()
        t.join()
        if isinstance(made[0], Exception):
            raise made[0]
        _SCRATCH[key] = made[0].zero_()
    return _SCRATCH[key]


def check_rows_q8(xq, n: int, k: int, device: torch.device) -> None:
    """A row's q8_0 blocks as ``q8_gemv`` takes them (``xq``) and producers write them: quants int8 [n, K]
    and scales fp16 [n, K / 32], contiguous (``kernels.reference.q8_rows``'s layout)."""
    q, d = xq
    if (q.dtype != torch.int8 or d.dtype != torch.float16 or q.shape != (n, k) or d.shape != (n, k // QK)
            or not (q.is_contiguous() and d.is_contiguous()) or q.device != device or d.device != device):
        raise ValueError(f"xq must be contiguous int8 [{n}, {k}] quants and fp16 [{n}, {k // QK}] scales on "
                         f"{device}, got {q.dtype} {tuple(q.shape)} and {d.dtype} {tuple(d.shape)} on {q.device}")


def q8_gemv(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None, *,
            glu: bool = False, int8: bool = False, xq: tuple[torch.Tensor, torch.Tensor] | None = None,
            q8_out: bool = False, pdl: bool = False, launch: Launch | None = None):
    """x [n <= 8, K] @ W^T (+ bias [N]) -> [n, N] in x's dtype, W [N, K] as q8_0 blocks ``q`` int8
    [K/32, N, 32] and ``d`` fp16 [K/32, N]; ``glu``: W is [W_gate; W_up] [2F, K] (no bias) ->
    silu(x W_gate^T) * (x W_up^T) [n, F]. ``int8``: x quantized to q8_0 blocks and multiplied in int8
    (module docstring); ``xq``: those blocks of x already made (``check_rows_q8``; int8 implied), x then only
    gives the shape and dtype. ``q8_out`` (with glu): also return the output's q8_0 blocks, ``(out, (quants,
    scales))``, for the next matmul's ``xq`` (a launch of 64 weight rows a program or a multiple holds whole
    blocks of 32 columns; one of fewer rows, a divisor of 64, has the last program to store a block's columns
    quantize it: ``scratch``). A launch's ``split`` shares each row block's K between programs, the last to
    finish adding the shares' fp32 sums in share order (deterministic; another sum order than one program's).
    ``pdl``: launch as a programmatic dependent of the kernel before it (CUDA sm_90+, else an ordinary
    launch). ``launch``: override ``launch_for`` (sweeps)."""
    check_weight(q, d)
    n_blocks, n_w, _ = q.shape
    k = n_blocks * QK
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in DTYPES or x.device != q.device:
        raise ValueError(f"x must be [n, K] in {DTYPES} with contiguous rows on {q.device}, got {x.dtype} "
                         f"{tuple(x.shape)} stride {x.stride()} on {x.device}")
    if x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [1..{MAX_ROWS}, {k}] for this weight, got {tuple(x.shape)}")
    if glu and (bias is not None or n_w % 2):
        raise ValueError(f"glu takes an even number of weight rows [W_gate; W_up] and no bias, got {n_w} rows, "
                         f"bias {bias is not None}")
    if bias is not None and (bias.shape != (n_w,) or not bias.is_contiguous() or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"bias must be contiguous [{n_w}] in {x.dtype} on {x.device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
    if xq is not None:
        check_rows_q8(xq, x.shape[0], k, x.device)
    if q8_out and (not glu or (n_w // 2) % QK):
        raise ValueError(f"q8_out needs glu and a multiple of {QK} output columns, got glu={glu}, {n_w // 2} columns")
    cfg = launch or launch_for(n_w, k, int8, xq is not None, q8_out)
    if cfg.block_k % QK or (glu and cfg.block_n % 2) or (q8_out and cfg.block_n % (2 * QK) and (2 * QK) % cfg.block_n) \
            or cfg.split < 1 or (cfg.split > 1 and glu):
        raise ValueError(f"block_k must be a multiple of {QK}, with glu block_n even, with q8_out a multiple or a "
                         f"divisor of {2 * QK}, split >= 1 and 1 with glu: got {cfg}")
    n = x.shape[0]
    n_cols = n_w // 2 if glu else n_w
    out = torch.empty((n, n_cols), dtype=x.dtype, device=x.device)
    oq, od = ((torch.empty((n, n_cols), dtype=torch.int8, device=x.device),
               torch.empty((n, n_cols // QK), dtype=torch.float16, device=x.device)) if q8_out else (out, out))
    xq_q, xq_d = (xq[0].view(torch.int32), xq[1]) if xq is not None else (q, d)
    programs = triton.cdiv(n_w, cfg.block_n)
    counts, sums = d, d
    if q8_out and cfg.block_n < 2 * QK:
        counts = scratch("counts", (n_cols // QK,), torch.int32, x.device)
    if cfg.split > 1:
        counts = scratch("counts", (programs,), torch.int32, x.device)
        sums = scratch("sums", (triton.next_power_of_2(n), cfg.split, n_cols), torch.float32, x.device)
    _q8_gemv_kernel[(programs, cfg.split)](
        x, q.view(torch.int32), d, bias if bias is not None else d, out, xq_q, xq_d, oq, od, counts, sums, n_cols,
        n_w, n_blocks, x.stride(0), out.stride(0), ROWS=n, ROWS_P=triton.next_power_of_2(n), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, GLU=glu, INT8=int8 or xq is not None, XQ=xq is not None,
        Q8_OUT=q8_out, SPLIT=cfg.split, ASM=use_asm(x.device), num_warps=cfg.num_warps, **pdl_kwargs(pdl, x.device))
    return (out, (oq, od)) if q8_out else out
