"""A verify batch's matmuls: y = x @ W^T (+ bias) for x [n <= 16, K] on the tensor cores, the weight's
first tile read before the previous kernel ends (``kernels/gemv.py``'s single rows, for 2-16 rows).

``gemv`` reduces each row over K on the CUDA cores, which costs as much as the bytes from ~3 rows
on (results/kernels/gemv: 2.0x cuBLAS's time at five rows). Here the weight's rows sit on the MMA's
M dimension and the batch, padded to 16, on N (acc [block_n, 16] += W_tile . x_tile^T), so a
verify batch costs the weight's bytes like one row. With ``pdl`` each program loads its first
weight tile, waits for the kernel before (``kernels/pdl.py``), then reads x; the K loop after that
tile is software-pipelined (``num_stages`` tiles in flight). Products of bf16 / fp16 values are
exact in the fp32 accumulator (fp32 inputs: ``ieee`` dots, no TF32), the bias is added in fp32 and
the sum rounded once; ``glu`` as in ``gemv`` (gate row j and up row F + j side by side, each sum
rounded, then ``silu_times``).

``Launch.split`` > 1 divides K among that many programs per row block (a long K with few rows of W:
down's 8960 x 1536 has 24 blocks of 64 rows): each writes its fp32 sums, and a second kernel, itself a
programmatic dependent, adds them in split order (deterministic), then the bias, the rounding, ``glu``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.gemv import check_operands, weight_rows
from kernels.pdl import kwargs as pdl_kwargs, wait_then_release
from kernels.swiglu import silu_times

MAX_ROWS = 16  # the MMA's N: a verify batch of 1 + 15 draft tokens
SUM_BLOCK = 512  # output columns per program of the split sum


class Launch(NamedTuple):
    block_n: int  # rows of W per program (the MMA's M; with glu, pairs of gate and up rows)
    block_k: int
    num_warps: int
    num_stages: int
    split: int = 1  # programs K is divided among (tile-aligned shares), summed by _split_sum_kernel


@triton.jit
def _gemv_mma_kernel(x, w, bias, out, part, N, K, K_PER, stride_x, stride_w, stride_o,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GLU: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    o_n, o_w = weight_rows(N, BLOCK_N, GLU)
    m_n = o_n < N
    k_lo = tl.program_id(1) * K_PER  # this program's share of K: [k_lo, k_hi), whole tiles
    k_hi = tl.minimum(K, k_lo + K_PER)
    o_k = k_lo + tl.arange(0, BLOCK_K)
    o_r = tl.arange(0, 16)
    p_w = w + o_w[:, None].to(tl.int64) * stride_w + o_k[None, :]
    p_x = x + o_r[:, None] * stride_x + o_k[None, :]
    m_r = (o_r < ROWS)[:, None]
    # the first tile before the wait: W is never written by the kernel this one may overlap
    b_w = tl.load(p_w, mask=m_n[:, None] & (o_k[None, :] < k_hi), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b_x = tl.load(p_x, mask=m_r & (o_k[None, :] < k_hi), other=0.0)
    acc = tl.dot(b_w, tl.trans(b_x), input_precision=PRECISION)
    for k0 in range(BLOCK_K, k_hi - k_lo, BLOCK_K):  # pipelined by the compiler: its loads all follow the wait
        m_k = (k0 + o_k[None, :]) < k_hi
        b_w = tl.load(p_w + k0, mask=m_n[:, None] & m_k, other=0.0)
        b_x = tl.load(p_x + k0, mask=m_r & m_k, other=0.0)
        acc = tl.dot(b_w, tl.trans(b_x), acc, input_precision=PRECISION)
    if SPLIT > 1:  # fp32 sums of this share by row of W: _split_sum_kernel finishes them
        n_w = N
        if GLU:
            n_w = N * 2
        p_p = part + (tl.program_id(1) * ROWS + o_r[None, :]) * n_w + o_w[:, None]
        tl.store(p_p, acc, mask=m_n[:, None] & (o_r < ROWS)[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[:, None]
        if GLU:  # [(column, gate | up), rows] -> silu(gate) * up
            pairs = tl.permute(tl.reshape(acc.to(out.dtype.element_ty), (BLOCK_N // 2, 2, 16)), (0, 2, 1))
            g, u = tl.split(pairs)
            o_c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(out + o_r[None, :] * stride_o + o_c[:, None], silu_times(g, u),
                     mask=(o_c < N)[:, None] & (o_r < ROWS)[None, :])
        else:
            tl.store(out + o_r[None, :] * stride_o + o_n[:, None], acc.to(out.dtype.element_ty),
                     mask=m_n[:, None] & (o_r < ROWS)[None, :])


@triton.jit
def _split_sum_kernel(part, bias, out, N, stride_o, ROWS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_BIAS: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr):
    """part [SPLIT, ROWS, rows of W] fp32 -> out row ``program_id(1)``: the splits summed in order."""
    wait_then_release(PDL)
    r = tl.program_id(1)
    o_c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # output columns
    m = o_c < N
    n_w = N
    if GLU:
        n_w = N * 2
    acc = tl.zeros([BLOCK], tl.float32)
    up = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        row = part + (s * ROWS + r) * n_w
        acc += tl.load(row + o_c, mask=m, other=0.0)
        if GLU:
            up += tl.load(row + N + o_c, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m, other=0.0).to(tl.float32)
    dt = out.dtype.element_ty
    if GLU:
        tl.store(out + r * stride_o + o_c, silu_times(acc.to(dt), up.to(dt)), mask=m)
    else:
        tl.store(out + r * stride_o + o_c, acc.to(dt), mask=m)


def launch_for(n: int, k: int, itemsize: int = 2) -> Launch:
    """W [n, k]'s launch: 64 rows of W a program, 256-wide K tiles, 4 stages; for a matrix of many rows
    (gate/up's 17920) 128-wide tiles and 2 stages. Within 2.3% of the fastest launch of an H200 sweep at
    five rows for each 1.5B matrix (results/kernels/gemv_mma/sweep.csv). 4-byte values take half as wide
    tiles: the stages' shared memory stays the 16-bit launch's (fp32's full width needs 240 KB, past the
    SM's 227)."""
    wide = n >= 8192
    block_k = (128 if wide else 256) * 2 // itemsize
    return Launch(64, min(block_k, max(16, triton.next_power_of_2(k))), 4, 2 if wide else 4)


def gemv_mma(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, glu: bool = False,
             pdl: bool = False, launch: Launch | None = None) -> torch.Tensor:
    """x [n <= 16, K] @ w[N, K]^T (+ bias [N]) -> [n, N] in x's dtype; ``glu``: w is [W_gate; W_up]
    [2F, K] (no bias) -> silu(x W_gate^T) * (x W_up^T) [n, F]. ``pdl``: launch as a programmatic
    dependent of the kernel before (CUDA sm_90+). ``launch``: override ``launch_for`` (sweeps)."""
    n, k, n_out = check_operands(x, w, bias, glu, MAX_ROWS, "gemv_mma")
    cfg = launch or launch_for(n_out, k, x.element_size())
    if cfg.block_n < 16 or cfg.block_k < 16:
        raise ValueError(f"the MMA needs block_n and block_k >= 16, got {cfg.block_n}, {cfg.block_k}")
    if cfg.split < 1:
        raise ValueError(f"split must be >= 1, got {cfg.split}")
    n_cols = n_out // 2 if glu else n_out
    out = torch.empty((n, n_cols), dtype=x.dtype, device=x.device)
    k_per = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split) * cfg.block_k  # whole tiles a share
    split = triton.cdiv(k, k_per)  # no empty share
    part = torch.empty((split, n, n_out), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else w
    _gemv_mma_kernel[(triton.cdiv(n_out, cfg.block_n), split)](
        x, w, b, out, part, n_cols, k, k_per, x.stride(0), w.stride(0), out.stride(0),
        ROWS=n, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, GLU=glu, SPLIT=split,
        PRECISION="ieee" if x.dtype == torch.float32 else None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_kwargs(pdl, x.device))
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n_cols, SUM_BLOCK), n)](
            part, b, out, n_cols, out.stride(0), ROWS=n, SPLIT=split, BLOCK=SUM_BLOCK, HAS_BIAS=bias is not None,
            GLU=glu, num_warps=4, **pdl_kwargs(pdl, x.device))
    return out
