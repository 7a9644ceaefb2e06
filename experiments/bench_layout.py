"""Page layout: is gathering from plain GGML rows faster than from the split layout?

kernels/formats.py stores pages in a split, head-major layout (every quant row 16-byte aligned)
because a GGML block is 34 (q8_0) / 18 (q4_0) bytes, so its quants are only ever 2-byte aligned
and load in 2-byte pieces. This measures what that choice is worth. ``_gather_ggml_kernel``
gathers from pages holding the bytes ``page_to_ggml`` makes (256 token rows, each head after
head, each head ``head_dim / 32`` blocks of [fp16 scale | quants]) into [n_tokens, n_kv_heads,
head_dim] fp16, with gather's dequantization (``kernels.gather._dequant``, the PTX path on CUDA)
and launch shape (BLOCK_T tokens of one page per program, heads minor), so the two differ only
in where the bytes come from. Its output equals ``kernels.gather.gather`` bit for bit (checked
here per case: column ``equal``; tests/kernels/test_bench_layout.py on CPU).

For q8_0 and q4_0 (f16 pages are the same in both layouts) and each context: one pool of
random split pages and the same pages as GGML rows; ``kernels.gather.gather`` (split) timed
first and last (drift), the GGML kernel's launch variants (``GGML_LAUNCHES``) between, each a
CUDA graph of several input sets (common.time_graph, working set past the L2). Shapes of
Qwen2.5-Coder-1.5B (2 KV heads x 128), as in bench_kernels. The copy ceiling is measured in the
same run.

Writes to --out: layout.csv (per row: type, context, layout, launch, us_graph, bytes = pages
read + fp16 written, GB/s, fraction of the 1 GiB copy ceiling and of a copy of the call's size
(common.sized_copy_gbps), ratio to split (the mean of its two timings), split drift, the
PTX load counts of the kernel it ran, ``equal``, provenance) and asm.csv (per compiled kernel:
registers, spills and every ``ld.global`` form of its PTX). Prints a short table.

What the loads compile to (sm_90, Triton 3.6 and 3.9, compiled offline; asm.csv records the
run's): the GGML quants only ever 2-byte aligned, Triton emits ``ld.global.b16`` for them (per
thread at (8, 1, 1): q8_0 16 + 1 for the scale, q4_0 8 + 1); split gather loads its quant rows
with ``ld.global.v4.b32`` (q8_0 2, q4_0 1) + one ``ld.global.b16`` of scales. Both store
``st.global.v4``.

    python experiments/bench_layout.py                              # CUDA (H200), a few minutes
    python experiments/bench_layout.py --contexts 131072 --out /tmp/layout
    python experiments/bench_layout.py --quick --out /tmp/layout    # CPU smoke (interpreter)
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import sys

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/kernels/variants/layout", help="output folder")
    p.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 32K 64K 128K; --quick: 40)")
    p.add_argument("--quick", action="store_true", help="tiny context; on CPU under TRITON_INTERPRET=1")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.quick and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is jitted
if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from experiments.common import (DEV, QWEN15, ceilings, compiled, kernel_provenance, n_sets, random_pool,  # noqa: E402
                                sized_copy_gbps, time_graph)
from kernels import gather as g  # noqa: E402
from kernels.formats import PAGE_TOKENS, PageFormat, page_to_ggml  # noqa: E402
from kernels.gather import _dequant, gather, use_asm  # noqa: E402

# (BLOCK_T tokens per program, num_warps, KV heads per program: 1 = heads minor as gather, 0 =
# all, i.e. a program reads whole GGML rows). The first is gather's LAUNCH.
GGML_LAUNCHES = [(*g.LAUNCH, 1), (16, 2, 1), (4, 1, 1), (8, 1, 0), (16, 2, 0), (32, 4, 0)]


@triton.jit(do_not_specialize=["n_tokens"], do_not_specialize_on_alignment=["page_ids"])
def _gather_ggml_kernel(
    pool,  # [n_pages, PAGE_BYTES] uint8: each page 256 GGML rows (page_to_ggml's bytes)
    page_ids,  # [>= cdiv(n_tokens, 256)] int32
    out,  # [n_tokens, N_KV_HEADS, HEAD_DIM] fp16, last dim contiguous
    n_tokens,
    stride_on,
    stride_oh,
    FMT: tl.constexpr,  # 1 q8_0, 2 q4_0
    HEAD_DIM: tl.constexpr,
    N_KV_HEADS: tl.constexpr,
    HPP: tl.constexpr,  # KV heads per program (HPP * HEAD_DIM / 32 a power of two)
    BLOCK_BYTES: tl.constexpr,  # 34 or 18
    BLOCK_T: tl.constexpr,
    ASM: tl.constexpr,
):
    NB: tl.constexpr = HEAD_DIM // 32
    KB: tl.constexpr = HPP * NB  # GGML blocks per (token, program): consecutive in the row
    ROW_BYTES: tl.constexpr = N_KV_HEADS * NB * BLOCK_BYTES
    PAGE_BYTES: tl.constexpr = 256 * ROW_BYTES
    N_HG: tl.constexpr = N_KV_HEADS // HPP
    i_t = tl.program_id(0) // N_HG  # heads minor, as gather
    i_g = tl.program_id(0) % N_HG
    TPP: tl.constexpr = 256 // BLOCK_T
    page = tl.load(page_ids + i_t // TPP).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    m_t = i_t * BLOCK_T + o_t < n_tokens
    o_k = tl.arange(0, KB)
    tok = (i_t % TPP) * BLOCK_T + o_t  # token inside the page
    # block k of the program starts at byte tok * ROW_BYTES + (i_g * KB + k) * BLOCK_BYTES of
    # the page: its fp16 scale there (2-byte aligned: every size is even), its quants 2 on
    o_blk = tok[:, None] * ROW_BYTES + (i_g * KB + o_k)[None, :] * BLOCK_BYTES  # [BLOCK_T, KB]
    m_b = m_t[:, None] & (o_k[None, :] >= 0)
    p_page = pool + page * PAGE_BYTES
    o_s = tok[:, None] * (ROW_BYTES // 2) + (i_g * KB + o_k)[None, :] * (BLOCK_BYTES // 2)
    b_s = tl.load(p_page.to(tl.pointer_type(tl.float16)) + o_s, mask=m_b, other=0.0)
    b_s = b_s[:, :, None]  # [BLOCK_T, KB, 1]
    o_j = tl.arange(0, 16)[None, None, :]
    p_q = p_page + o_blk[:, :, None] + 2 + o_j  # [BLOCK_T, KB, 16]: bytes 0..15 of the quants
    m_q = m_b[:, :, None] & (o_j >= 0)
    if FMT == 1:  # q8_0: element j at quant byte j
        b_lo = _dequant(tl.load(p_q, mask=m_q, other=0), b_s, 1, out.dtype.element_ty, ASM)
        b_hi = _dequant(tl.load(p_q + 16, mask=m_q, other=0), b_s, 1, out.dtype.element_ty, ASM)
    else:  # q4_0: quant byte j = element j (low nibble) | element j + 16 (high)
        b_q = tl.load(p_q, mask=m_q, other=0)
        b_lo = _dequant(b_q, b_s, 2, out.dtype.element_ty, ASM)
        b_hi = _dequant(b_q, b_s, 3, out.dtype.element_ty, ASM)
    o_h = i_g * HPP + o_k // NB
    o_e = (o_h * stride_oh + (o_k % NB) * 32)[None, :, None] + o_j  # [1, KB, 16]
    p_o = out + (i_t * BLOCK_T).to(tl.int64) * stride_on  # int64: the output may pass 2^31 elements
    p_o += o_t[:, None, None] * stride_on + o_e
    tl.store(p_o, b_lo, mask=m_q)
    tl.store(p_o + 16, b_hi, mask=m_q)


def gather_ggml(pool: torch.Tensor, page_ids: torch.Tensor, n_tokens: int, fmt: PageFormat,
                out: torch.Tensor | None = None, launch=GGML_LAUNCHES[0]) -> torch.Tensor:
    """``gather`` (fp16 out) from pages of GGML rows: pool uint8 [n_pages, page_bytes] (or
    [n_pages, 256, row_bytes]), page_ids contiguous int32 [>= cdiv(n_tokens, 256)]."""
    t = fmt.kv_type
    if t.code not in (1, 2):
        raise ValueError(f"q8_0 / q4_0 only (f16 pages are the same in both layouts), got {t.name}")
    pool = pool.reshape(pool.shape[0], fmt.page_bytes)
    if pool.dtype != torch.uint8 or pool.stride(-1) != 1 or pool.stride(0) != fmt.page_bytes:
        raise ValueError(f"pool must be contiguous uint8 pages, got {pool.dtype} stride {pool.stride()}")
    n_pages = -(-n_tokens // PAGE_TOKENS)
    if page_ids.dtype != torch.int32 or page_ids.dim() != 1 or page_ids.shape[0] < n_pages \
            or page_ids.stride(0) != 1:
        raise ValueError(f"page_ids must be contiguous int32 [>= {n_pages}]")
    shape = (n_tokens, fmt.n_kv_heads, fmt.head_dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.float16, device=pool.device)
    if tuple(out.shape) != shape or out.dtype != torch.float16 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp16 {list(shape)} with last dim contiguous")
    block_t, num_warps, hpp = launch
    hpp = hpp or fmt.n_kv_heads
    kb = hpp * fmt.blocks_per_head
    if fmt.n_kv_heads % hpp or kb & (kb - 1) or PAGE_TOKENS % block_t:
        raise ValueError(f"launch {launch} does not fit {fmt}")
    if n_tokens:
        grid = (triton.cdiv(n_tokens, block_t) * (fmt.n_kv_heads // hpp),)
        _gather_ggml_kernel[grid](
            pool, page_ids, out, n_tokens, out.stride(0), out.stride(1), FMT=t.code,
            HEAD_DIM=fmt.head_dim, N_KV_HEADS=fmt.n_kv_heads, HPP=hpp, BLOCK_BYTES=t.block_bytes,
            BLOCK_T=block_t, ASM=use_asm(pool.device), num_warps=num_warps)
    return out


# ---- PTX ------------------------------------------------------------------------------------

HINTS = ("nc", "ca", "cg", "cs", "lu", "cv")  # cache operators of ld (the L1::/L2:: ones contain "::")


def ptx_loads(ptx: str) -> dict:
    """Global loads of a PTX by form, cache hints dropped: {'ld.global.v4.b32': 4, ...}, plus
    ld_v4 / ld_v2 (vector loads) and ld_b8 / ld_b16 / ld_b32 / ld_b64 (scalar, by width)."""
    forms = collections.Counter()
    for m in re.findall(r"\bld\.global(?:\.[\w:]+)+", ptx):
        forms[".".join(p for p in m.split(".") if "::" not in p and p not in HINTS)] += 1
    row = dict(ld_v4=0, ld_v2=0, ld_b8=0, ld_b16=0, ld_b32=0, ld_b64=0)
    for f, n in forms.items():
        parts = f.split(".")
        if "v4" in parts or "v2" in parts:
            row["ld_v4" if "v4" in parts else "ld_v2"] += n
        else:
            bits = re.findall(r"^[busf](8|16|32|64)$", parts[-1])
            if bits:
                row[f"ld_b{bits[0]}"] += n
    row["ld_forms"] = ";".join(f"{f}:{n}" for f, n in sorted(forms.items()))
    return row


def asm_row(k) -> dict:
    ptx = k.asm.get("ptx", "") if hasattr(k, "asm") else ""
    return dict(n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                **ptx_loads(ptx))


# ---- benchmark ------------------------------------------------------------------------------

def bench_type(t: str, L: int, gen, ceil: dict, rows: list, asm: dict) -> None:
    """Split gather (first and last) and the GGML kernel's launches, same pages, one context."""
    fmt = PageFormat(t, QWEN15.n_kv_heads, QWEN15.head_dim)
    pages = -(-L // PAGE_TOKENS)
    out_bytes = L * fmt.n_kv_heads * fmt.head_dim * 2
    nbytes = L * fmt.row_bytes + out_bytes
    sets = n_sets(nbytes)
    sized = sized_copy_gbps(nbytes)  # a copy of this call's size, timed as the kernels are
    split = random_pool(fmt, sets * pages, gen)
    ggml = page_to_ggml(split, fmt).reshape(split.shape)  # the same pages as GGML rows
    perm = torch.randperm(sets * pages, device=DEV, generator=gen).int()
    tables = [perm[i * pages:(i + 1) * pages].contiguous() for i in range(sets)]
    outs = [torch.empty(L, fmt.n_kv_heads, fmt.head_dim, dtype=torch.float16, device=DEV)
            for _ in range(sets)]
    want = gather(split, tables[0], L, fmt)
    cases = [("split", g.LAUNCH + (1,))] + [("ggml", la) for la in GGML_LAUNCHES] + [("split", g.LAUNCH + (1,))]
    start = len(rows)
    for i, (layout, launch) in enumerate(cases):
        fn, pool, kern = ((gather, split, g._gather_kernel) if layout == "split"
                          else (functools.partial(gather_ggml, launch=launch), ggml, _gather_ggml_kernel))
        before = {id(k) for k in compiled(kern)}
        outs[0].fill_(float("nan"))
        us = time_graph([(lambda j=j: fn(pool, tables[j], L, fmt, out=outs[j])) for j in range(sets)])
        key = (layout, t, launch)
        for k in compiled(kern):  # the kernel(s) this case compiled (none on CPU)
            if id(k) not in before:
                asm.setdefault(key, []).append(dict(kernel=getattr(kern, "__name__", layout), type=t, layout=layout,
                                                    launch=str(launch), **asm_row(k)))
        ld = {c: sum(a[c] for a in asm[key]) if key in asm else None
              for c in ("ld_v4", "ld_v2", "ld_b8", "ld_b16", "ld_b32", "ld_b64")}
        gbps = nbytes / us / 1e3
        rows.append(dict(type=t, context=L, layout=layout, order=i, block_t=launch[0],
                         num_warps=launch[1], heads_per_prog=launch[2] or fmt.n_kv_heads, sets=sets,
                         us_graph=us, bytes=nbytes, gbps=gbps, frac_copy=gbps / ceil["copy_gbps"],
                         frac_sized_copy=gbps / sized,
                         equal=bool(torch.equal(outs[0].view(torch.int16), want.view(torch.int16))),
                         **ld))
        print(f"{t} {L} {layout} {launch}: {us:.1f} us, {100 * gbps / ceil['copy_gbps']:.0f}% of copy"
              + ("" if rows[-1]["equal"] else "  OUTPUT DIFFERS FROM SPLIT GATHER"), flush=True)
    s0, s1 = rows[start]["us_graph"], rows[-1]["us_graph"]
    for r in rows[start:]:
        r.update(ratio_split=r["us_graph"] / ((s0 + s1) / 2), split_drift=s1 / s0 - 1)


def main(args) -> None:
    import pandas as pd
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    contexts = args.contexts or ([40] if args.quick else [32768, 65536, 131072])
    ceil = ceilings()
    prov = kernel_provenance()  # commit, dirty, gpu, versions, command
    rows, asm = [], {}
    for L in contexts:
        for t in ("q8_0", "q4_0"):
            bench_type(t, L, gen, ceil, rows, asm)
    df = pd.DataFrame(rows).assign(copy_gbps=ceil["copy_gbps"], **prov)
    df.to_csv(os.path.join(args.out, "layout.csv"), index=False)
    pd.DataFrame([a for v in asm.values() for a in v]).assign(**prov).to_csv(
        os.path.join(args.out, "asm.csv"), index=False)
    print(f"\ncopy ceiling {ceil['copy_gbps']:.0f} GB/s; {len(df)} rows -> {args.out}/layout.csv")
    print(f"{'type':5} {'ctx':>6} {'layout':6} {'launch':11} {'us':>8} {'GB/s':>6} {'%copy':>6} {'%sized':>6} "
          f"{'xsplit':>6} {'v4/v2/b8/b16':>14} equal")
    for r in rows:
        ld = "/".join("-" if r[c] is None else str(r[c]) for c in ("ld_v4", "ld_v2", "ld_b8", "ld_b16"))
        launch = str((r["block_t"], r["num_warps"], r["heads_per_prog"]))
        print(f"{r['type']:5} {r['context']:>6} {r['layout']:6} {launch:11} {r['us_graph']:>8.1f} {r['gbps']:>6.0f} "
              f"{100 * r['frac_copy']:>5.0f}% {100 * r['frac_sized_copy']:>5.0f}% {r['ratio_split']:>6.2f} "
              f"{ld:>14} {r['equal']}")
    best = df[df.layout == "ggml"].groupby(["type", "context"]).ratio_split.min()
    print("best GGML-row launch / split time: " + ", ".join(f"{t} {L}: {v:.2f}" for (t, L), v in best.items()))
    if not df.equal.all():
        raise SystemExit("some GGML-row outputs differ from split gather (column equal)")


if __name__ == "__main__":
    main(ARGS)
