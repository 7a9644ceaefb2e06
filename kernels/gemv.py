"""Dense decode matmuls: y = x @ W^T (+ bias) for a few rows x [n <= 8, K] and a bf16/fp16/fp32
W [N, K], on the CUDA cores, the weight's first tile read before the previous kernel ends.

A decode step's matmuls are reads of their weights, and the 1.5B's small ones are latency-bound:
cuBLAS takes 5-6 us for Q/K/V (6.3 MB, 1.5 us of bytes) and output (4.7 MB, 1.1 us), so a step's
matmuls run at 59% of the read ceiling (kernels/NOTES.md). A weight does not depend on the
previous kernel, so with programmatic dependent launch (``pdl=True``: the launch may begin
while the kernel before it runs, ``gdc_wait`` then waits for that kernel's writes) each program
loads its first weight tile, waits, then reads x (``kernels/pdl.py``).

One program per ``block_n`` output columns: it streams its rows of W in [block_n, block_k]
tiles (16-byte loads along K), multiplies each tile by every row of x in fp32 and reduces over
K in fp32; the sum, plus the bias in fp32, is rounded once to x's dtype. Only the fp32
summation order differs from ``x.float() @ W.float().T`` (tests/kernels/test_gemv.py).

``glu=True`` takes the fused gate/up weight W = [W_gate; W_up] [2F, K] and returns SwiGLU's
silu(x W_gate^T) * (x W_up^T) [n, F]: each program holds gate row j and up row F + j side by side,
rounds both sums to x's dtype and applies ``kernels.swiglu.silu_times``, so the result equals the
matmul then ``silu_mul`` bit for bit, one launch and one [n, 2F] round trip fewer.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.pdl import kwargs as pdl_kwargs
from kernels.swiglu import silu_times

# rows a call takes. Each row is its own reduction over K: at 5 rows the kernel took 1.6-2.6x cuBLAS's
# time on the 1.5B's Q/K/V, gate/up and down (results/kernels/gemv), so the model sends it single rows
MAX_ROWS = 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Launch(NamedTuple):
    block_n: int  # rows of W per program (output columns; with glu, pairs of gate and up rows)
    block_k: int  # K per tile
    num_warps: int


@triton.jit
def weight_rows(N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """(output column, row of W) of each of the program's BLOCK_N rows of W: its own columns, or with GLU
    BLOCK_N / 2 output columns j, each as its gate row j and up row N + j side by side (N is then F)."""
    o_i = tl.arange(0, BLOCK_N)
    if GLU:
        o_n = tl.program_id(0) * (BLOCK_N // 2) + o_i // 2
        o_w = o_n + (o_i % 2) * N
    else:
        o_n = tl.program_id(0) * BLOCK_N + o_i
        o_w = o_n
    return o_n, o_w


@triton.jit
def _gemv_kernel(x, w, bias, out, N, K, stride_x, stride_w, stride_o,
                 ROWS: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr):
    o_n, o_w = weight_rows(N, BLOCK_N, GLU)
    m_n = o_n < N
    o_k = tl.arange(0, BLOCK_K)
    p_w = w + o_w[:, None].to(tl.int64) * stride_w + o_k[None, :]
    # the first tile before the wait: W is never written by the kernel this one may overlap
    b_w = tl.load(p_w, mask=m_n[:, None] & (o_k[None, :] < K), other=0.0)
    if PDL:  # launched as a programmatic dependent: now wait for the kernel before
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start loading its weights
    o_r = tl.arange(0, ROWS_P)
    acc = tl.zeros([ROWS_P, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_kk = k0 + o_k
        # the next tile in flight while this one is used (masked off past K)
        b_w_next = tl.load(p_w + k0 + BLOCK_K, mask=m_n[:, None] & (o_kk[None, :] + BLOCK_K < K), other=0.0)
        f_w = b_w.to(tl.float32)
        for r in tl.static_range(ROWS):
            b_x = tl.load(x + r * stride_x + o_kk, mask=o_kk < K, other=0.0).to(tl.float32)
            part = tl.sum(f_w * b_x[None, :], 1)
            acc = tl.where(o_r[:, None] == r, acc + part[None, :], acc)
        b_w = b_w_next
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if GLU:  # [rows, (column, gate | up)] -> silu(gate) * up, rounded as the unfused kernels round
        g, u = tl.split(tl.reshape(acc.to(out.dtype.element_ty), (ROWS_P, BLOCK_N // 2, 2)))
        o_c = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        p_o = out + o_r[:, None] * stride_o + o_c[None, :]
        tl.store(p_o, silu_times(g, u), mask=(o_r[:, None] < ROWS) & (o_c < N)[None, :])
    else:
        p_o = out + o_r[:, None] * stride_o + o_n[None, :]
        tl.store(p_o, acc.to(out.dtype.element_ty), mask=(o_r[:, None] < ROWS) & m_n[None, :])


def launch_for(n: int, k: int) -> Launch:
    """W [n, k]'s launch. The rule gives the fastest launch of the 1.5B's four matrices in a sweep on
    the H200 at one row with PDL (results/kernels/gemv/sweep.csv): 4 columns a program (2 for a long
    K, as down's 8960: more programs in flight), 2048-wide K tiles on 8 warps, but 1024 on 4 warps
    for a matrix of many rows (gate/up's 17920: 4480 programs; 18.3 against 16.0 us with 2048)."""
    block_k = min(triton.next_power_of_2(k), 1024 if n >= 8192 else 2048)
    return Launch(2 if k >= 4096 else 4, block_k, 8 if block_k == 2048 else 4)


def check_operands(x, w, bias, glu: bool, max_rows: int, name: str) -> tuple[int, int, int]:
    """(n, K, N) of a decode matmul's x [n, K], w [N, K], bias [N] (this module's and ``gemv_mma``'s),
    or one ValueError naming what is off."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [n, K] in {DTYPES} with contiguous rows, got {x.dtype} "
                         f"{tuple(x.shape)} stride {x.stride()}")
    n, k = x.shape
    if not 1 <= n <= max_rows:
        raise ValueError(f"{name} takes 1 to {max_rows} rows, got {n}")
    if w.dim() != 2 or w.shape[1] != k or w.stride(-1) != 1 or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must be [N, {k}] in x's {x.dtype} on {x.device} with contiguous rows, got "
                         f"{w.dtype} {tuple(w.shape)} on {w.device} stride {w.stride()}")
    n_out = w.shape[0]
    if glu and (bias is not None or n_out % 2):
        raise ValueError(f"glu takes an even number of weight rows [W_gate; W_up] and no bias, got "
                         f"{n_out} rows, bias {bias is not None}")
    if bias is not None and (bias.shape != (n_out,) or not bias.is_contiguous() or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise ValueError(f"bias must be contiguous [{n_out}] in {x.dtype} on {x.device}, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")
    return n, k, n_out


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, glu: bool = False,
         pdl: bool = False, launch: Launch | None = None) -> torch.Tensor:
    """x [n <= 8, K] @ w[N, K]^T (+ bias [N]) -> [n, N] in x's dtype; ``glu``: w is [W_gate; W_up]
    [2F, K] (no bias) -> silu(x W_gate^T) * (x W_up^T) [n, F] (module docstring). ``pdl``: launch as a
    programmatic dependent of the kernel before it (CUDA sm_90+, else an ordinary launch): W's first
    tile is read before that kernel's writes are waited for. ``launch``: override ``launch_for``'s
    choice (sweeps); its ``block_n`` counts rows of W (with ``glu`` an even number: half gate, half up)."""
    n, k, n_out = check_operands(x, w, bias, glu, MAX_ROWS, "gemv")
    cfg = launch or launch_for(n_out, k)
    if glu and cfg.block_n % 2:
        raise ValueError(f"glu needs an even block_n (gate and up rows in pairs), got {cfg.block_n}")
    n_cols = n_out // 2 if glu else n_out  # output columns (N in the kernel)
    out = torch.empty((n, n_cols), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        x, w, bias if bias is not None else w, out, n_cols, k, x.stride(0), w.stride(0), out.stride(0),
        ROWS=n, ROWS_P=triton.next_power_of_2(n), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        HAS_BIAS=bias is not None, GLU=glu, num_warps=cfg.num_warps, **pdl_kwargs(pdl, x.device))
    return out
