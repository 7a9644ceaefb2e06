"""x @ W^T with W held in GGML q8_0 blocks: weights read at 1.06 bytes per value instead of
bf16's 2 (at batch 1 a decode step is a pass over its weights), dequantized in registers.

``q8_linear(x, q, d, bias)``: x [n, K] (fp16 / bf16 / fp32), W [N, K] as ``q`` int8
[K/32, N, 32] (block-major: the 32 quants of block kb of every row, rows side by side, so a
program's tile of one block is one contiguous run) and ``d`` fp16 [K/32, N] (each block's
scale), bias [N] or None -> [n, N] in x's dtype.

Per block of 32: ``p = x_blk . q_blk`` on the tensor cores (the quants cast exactly to x's
dtype: |q| <= 128 fits bf16's 8 bits), then ``acc += p * d`` in fp32, as llama.cpp's q8_0
kernels scale per block after the integer-exact dot. The reference (``kernels.reference.
q8_linear``) dequantizes to fp32 first; only the fp32 summation order differs (and x's own
rounding to the dot's input type, none for fp16 / bf16). ``Launch.bm == 1`` runs the same
arithmetic on the CUDA cores, one row of x per program (a GEMV; not yet measured against the
MMA kernel, which ``launch`` picks). ``SPLIT`` > 1 divides the K blocks among programs whose
fp32 partials a second kernel adds in a fixed order (deterministic, no atomics): more programs in
flight for decode batches, whose K loops are latency-bound.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

QK = 32  # values per q8_0 block


class Launch(NamedTuple):
    bm: int  # rows of x per program (16: one tile holds a decode or verify batch; 1: the GEMV kernel)
    bn: int  # weight rows per program
    split: int  # programs along K (their partials summed by a second kernel)
    warps: int
    stages: int  # software-pipeline depth of the K loop
    blocks: int = 1  # q8_0 blocks per K-loop iteration: bytes in flight per program


def launch(n: int, N: int, K: int) -> Launch:
    """Tile sizes for one call, from its shape alone (graph-capturable, no autotuning), the
    fastest of ``experiments/bench_q8_linear.py --sweep`` on the H200 for the Qwen2.5-Coder
    shapes (results/kernels/q8_linear): a decode or verify batch (n <= 16) is one 16-row tile
    and its K loop is bound by load latency. Weights of >= 16384 rows (LM head, the 1.5B's
    gate/up) run 128-row tiles one block per iteration, 5 stages deep, K split 2-4 ways; the
    others 32-row tiles with 4 blocks in flight per iteration, K split until there are ~4
    programs per SM, at most 8 ways (8 beat 16 by 3-25% for every such matrix of both models in
    one sweep, acbc754). Prefill: 128 x 128 tiles."""
    if n > 16:
        return Launch(128, 128, 1, 8, 3, 2)
    if N >= 16384:
        return Launch(16, 128, 2 if N >= 65536 else 4, 4, 5, 1)
    split = 1
    while triton.cdiv(N, 32) * split < 528 and split < 8 and (K // QK) >= 4 * split:
        split *= 2
    return Launch(16, 32, split, 4, 3, 4)


@triton.jit
def _q8_linear_kernel(x, q, d, bias, out, ws, n, N, K, x_stride,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BLOCKS: tl.constexpr):
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    r32 = tl.arange(0, 32)
    mn, mm = rn < N, rm < n
    nb = K // 32
    per = tl.cdiv(nb, SPLIT)
    lo = pid_s * per
    hi = tl.minimum(lo + per, nb)
    # pointers at block lo, advanced a block per iteration (q's numel < 2^31: offsets fit int32)
    xp = x + rm[:, None].to(tl.int64) * x_stride + lo * 32 + r32[None, :]
    qp = q + lo * N * 32 + rn[None, :] * 32 + r32[:, None]  # [32, BN]: one block of rows rn
    dp = d + lo * N + rn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(lo, hi, BLOCKS):
        for s in tl.static_range(BLOCKS):  # independent loads: BLOCKS blocks in flight at once
            okn = mn & (tl.full((BN,), kb + s, tl.int32) < hi)  # the last iteration's blocks past hi: none
            okm = mm & (tl.full((BM,), kb + s, tl.int32) < hi)
            xt = tl.load(xp + s * 32, mask=okm[:, None], other=0.0)
            qt = tl.load(qp + s * N * 32, mask=okn[None, :], other=0)
            dt = tl.load(dp + s * N, mask=okn, other=0.0).to(tl.float32)
            if IEEE:
                p = tl.dot(xt, qt.to(xt.dtype), input_precision="ieee")
            else:
                p = tl.dot(xt, qt.to(xt.dtype))
            acc += p * dt[None, :]
        xp += BLOCKS * 32
        qp += BLOCKS * N * 32
        dp += BLOCKS * N
    o = rm[:, None].to(tl.int64) * N + rn[None, :]
    m2 = mm[:, None] & mn[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=mn, other=0.0).to(tl.float32)[None, :]
        tl.store(out + o, acc.to(out.dtype.element_ty), mask=m2)
    else:
        tl.store(ws + pid_s.to(tl.int64) * n * N + o, acc, mask=m2)


@triton.jit
def _q8_gemv_kernel(x, q, d, bias, out, ws, n, N, K, x_stride,
                    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr, BLOCKS: tl.constexpr):
    """One row of x per program, on the CUDA cores (``Launch.bm == 1``): no 16-row MMA tile to pad
    a decode row into, no shared-memory operands; per block the 32 products summed, then times the
    block's scale, as the MMA kernel does."""
    pid_n, row, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    sb, r32 = tl.arange(0, BLOCKS), tl.arange(0, 32)
    mn = rn < N
    nb = K // 32
    per = tl.cdiv(nb, SPLIT)
    lo = pid_s * per
    hi = tl.minimum(lo + per, nb)
    xp = x + row.to(tl.int64) * x_stride + lo * 32 + sb[:, None] * 32 + r32[None, :]  # [BLOCKS, 32]
    qp = q + lo * N * 32 + sb[:, None, None] * N * 32 + rn[None, :, None] * 32 + r32[None, None, :]  # [BLOCKS, BN, 32]
    dp = d + lo * N + sb[:, None] * N + rn[None, :]  # [BLOCKS, BN]
    acc = tl.zeros((BN,), dtype=tl.float32)
    for kb in range(lo, hi, BLOCKS):
        ok = (kb + sb) < hi
        xt = tl.load(xp, mask=ok[:, None], other=0.0).to(tl.float32)
        qt = tl.load(qp, mask=ok[:, None, None] & mn[None, :, None], other=0).to(tl.float32)
        dt = tl.load(dp, mask=ok[:, None] & mn[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(qt * xt[:, None, :], axis=2) * dt, axis=0)
        xp += BLOCKS * 32
        qp += BLOCKS * N * 32
        dp += BLOCKS * N
    o = row.to(tl.int64) * N + rn
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=mn, other=0.0).to(tl.float32)
        tl.store(out + o, acc.to(out.dtype.element_ty), mask=mn)
    else:
        tl.store(ws + pid_s.to(tl.int64) * n * N + o, acc, mask=mn)


@triton.jit
def _split_sum_kernel(ws, bias, out, total, SPLIT: tl.constexpr, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < total
    acc = tl.load(ws + o, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):  # in split order: the same sum on every run
        acc += tl.load(ws + s * total.to(tl.int64) + o, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + o % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=m)


def check_weight(q: torch.Tensor, d: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape[2] != QK or q.dtype != torch.int8 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous int8 [K/32, N, 32], got {tuple(q.shape)} {q.dtype}")
    if d.shape != q.shape[:2] or d.dtype != torch.float16 or not d.is_contiguous():
        raise ValueError(f"d must be contiguous fp16 {tuple(q.shape[:2])}, got {tuple(d.shape)} {d.dtype}")


def q8_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
              config: Launch | None = None) -> torch.Tensor:
    """x [n, K] (rows may be strided) @ W^T (+ bias) -> [n, N] in x's dtype; ``config``
    overrides ``launch`` (benchmarks)."""
    check_weight(q, d)
    nb, N, _ = q.shape
    K = nb * QK
    if q.numel() >= 2**31:
        raise ValueError(f"a q8_0 weight of {q.numel()} values: the kernel's offsets are int32 (< 2^31)")
    if x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"x must be [n, {K}] with contiguous rows, got {tuple(x.shape)} stride {x.stride()}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    n = x.shape[0]
    c = config or launch(n, N, K)
    out = torch.empty((n, N), dtype=x.dtype, device=x.device)
    ws = torch.empty((c.split, n, N), dtype=torch.float32, device=x.device) if c.split > 1 else out
    grid = (triton.cdiv(N, c.bn), triton.cdiv(n, c.bm), c.split)
    b = bias if bias is not None else out
    if c.bm == 1:
        _q8_gemv_kernel[grid](x, q, d, b, out, ws, n, N, K, x.stride(0), HAS_BIAS=bias is not None, SPLIT=c.split,
                              BN=c.bn, BLOCKS=c.blocks, num_warps=c.warps, num_stages=c.stages)
    else:
        _q8_linear_kernel[grid](x, q, d, b, out, ws, n, N, K, x.stride(0), HAS_BIAS=bias is not None, SPLIT=c.split,
                                IEEE=x.dtype == torch.float32, BM=c.bm, BN=c.bn, BLOCKS=c.blocks, num_warps=c.warps,
                                num_stages=c.stages)
    if c.split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(n * N, block),)](ws, b, out, n * N, c.split, N, HAS_BIAS=bias is not None,
                                                        BLOCK=block, num_warps=4)
    return out
