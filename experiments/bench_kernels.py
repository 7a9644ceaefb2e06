"""Benchmark the KV kernels: paged decode attention, gather, store.

Shapes of Qwen2.5-Coder-1.5B, one layer: 12 query heads, 2 KV heads, head_dim 128.
Contexts 1K..128K, n_q 1 and 6, every K/V type pair. Random data (never zeros).

Each case is timed two ways (decode attention three):
- ``graph``: the calls of several input sets (pages / tensors of their own, so that the
  working set is >= ~512 MB, well past the 60 MB L2) captured in one CUDA graph; replay
  time / sets, median of the replays. GPU time without host launch gaps: bandwidth numbers
  use it.
- ``eager``: ``triton.testing.do_bench`` median of one call (L2 flushed before each call),
  host launch overhead included: what an uncaptured step pays.
- ``graph_pdl`` (decode attention, sm_90+): as ``graph``, the attention and merge kernels launched
  as programmatic dependents, as a decode step with ``model.gemv`` launches them (each one's launch
  overlaps the kernel before it; ``frac_sized_copy_pdl``).
Baselines in the same run: torch SDPA (flash backend, enable_gqa) on contiguous fp16 K/V of
the same length, and gather (our kernel, to fp16) + the same SDPA. Ceilings measured in the
same run: device-to-device copy (bytes read + written) and a read-only sum, over 1 GiB; and
per case a copy moving the same bytes as the call (``sized_copy_gbps``, ``frac_sized_copy``):
what any kernel of that size reaches, launch and tail included.

Writes to --out: decode_attention.csv, gather.csv, store.csv, ceilings.csv, asm.csv (per
compiled kernel: registers, spills, shared memory, load widths and MMA kinds from the PTX),
bench_kernels.png and command.txt (the command, with provenance). Prints a short table.

    python experiments/bench_kernels.py --out results/kernels          # CUDA, ~5 min
    python experiments/bench_kernels.py --quick --out /tmp/bench       # CPU smoke (interpreter)
    python experiments/bench_kernels.py --sweep --out /tmp/sweep       # launch-table sweep
    python experiments/bench_kernels.py --compare BEFORE_DIR AFTER_DIR  # two runs side by side (no GPU)
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

N_HEADS, N_KV_HEADS, HEAD_DIM = 12, 2, 128
PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")]
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/kernels", help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny run; on CPU under TRITON_INTERPRET=1")
    p.add_argument("--sweep", action="store_true",
                   help="time decode's launch variants (SWEEP) at --contexts (default 32K, 64K, 128K)")
    p.add_argument("--contexts", type=int, nargs="*", help="override the context lengths")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="instead: decode attention of two runs' folders side by side (no GPU)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.quick and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is jitted

from experiments.common import (CUDA, DEV, ceilings, compiled, kernel_provenance, n_sets,  # noqa: E402
                                random_pool, sized_copy_gbps, time_eager, time_graph)
from kernels import decode_attention as da  # noqa: E402
from kernels.decode_attention import decode_attention  # noqa: E402
from kernels.formats import PAGE_TOKENS, PageFormat  # noqa: E402
from kernels.gather import gather  # noqa: E402
from kernels.pdl import supported as pdl_supported  # noqa: E402
from kernels.store import store  # noqa: E402


# ---- cases -----------------------------------------------------------------------------

def kv_bytes(L: int, kf: PageFormat, vf: PageFormat) -> int:
    return L * (kf.row_bytes + vf.row_bytes)


def bench_decode(pair, L, n_qs, gen, ceil, sdpa_us, rows, baselines=True):
    kf, vf = PageFormat(pair[0], N_KV_HEADS, HEAD_DIM), PageFormat(pair[1], N_KV_HEADS, HEAD_DIM)
    pages = -(-L // PAGE_TOKENS)
    sets = n_sets(kv_bytes(L, kf, vf))
    kp, vp = random_pool(kf, sets * pages, gen), random_pool(vf, sets * pages, gen)
    perm = torch.randperm(sets * pages, device=DEV, generator=gen).int()
    tables = [perm[i * pages:(i + 1) * pages].contiguous() for i in range(sets)]
    lens = [torch.full((1,), L, dtype=torch.int64, device=DEV) for _ in range(sets)]
    for n_q in n_qs:
        qs = [torch.randn(n_q, N_HEADS, HEAD_DIM, device=DEV, generator=gen).half() for _ in range(sets)]
        outs = [torch.empty_like(q) for q in qs]
        call = lambda i, pdl=False: (lambda: decode_attention(qs[i], kp, vp, tables[i], lens[i], kf, vf,  # noqa: E731
                                                              out=outs[i], pdl=pdl))
        t_graph = time_graph([call(i) for i in range(sets)])
        t_eager = time_eager(call(0))
        # as a decode step launches it (model.gemv): attention and merge as programmatic dependents, each
        # launched while the kernel before it runs (kernels/pdl.py; CUDA only)
        t_pdl = time_graph([call(i, True) for i in range(sets)]) if pdl_supported(DEV) else float("nan")
        splits = da.splits_for(n_q, N_HEADS, N_KV_HEADS, L, DEV)
        extra = 2 * n_q * N_HEADS * HEAD_DIM * 2 + 4 * pages
        if splits > 1:
            extra += 2 * splits * n_q * N_HEADS * (HEAD_DIM + 2) * 4  # partials written + read
        nbytes = kv_bytes(L, kf, vf) + extra
        # gather + SDPA baseline
        kg = torch.empty(L, N_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEV)
        vg = torch.empty_like(kg)

        def gather_sdpa(i):
            def f():
                gather(kp, tables[i], L, kf, out=kg)
                gather(vp, tables[i], L, vf, out=vg)
                return sdpa(qs[i], kg, vg)
            return f
        t_gs = float("nan")
        if CUDA and baselines:
            t_gs = time_graph([gather_sdpa(i) for i in range(min(sets, 16))])
        gbps = nbytes / t_graph / 1e3
        base = sdpa_us.get((L, n_q), float("nan"))
        rows.append(dict(
            k_type=pair[0], v_type=pair[1], context=L, n_q=n_q, n_splits=splits, sets=sets,
            us_graph=t_graph, us_eager=t_eager, us_graph_pdl=t_pdl, kv_bytes=kv_bytes(L, kf, vf), bytes=nbytes,
            gbps=gbps, frac_copy=gbps / ceil["copy_gbps"], frac_read=gbps / ceil["read_gbps"],
            sized_copy_gbps=sized_copy_gbps(kv_bytes(L, kf, vf)),
            frac_sized_copy=kv_bytes(L, kf, vf) / t_graph / 1e3 / sized_copy_gbps(kv_bytes(L, kf, vf)),
            frac_sized_copy_pdl=kv_bytes(L, kf, vf) / t_pdl / 1e3 / sized_copy_gbps(kv_bytes(L, kf, vf)),
            floor_us=nbytes / ceil["read_gbps"] / 1e3, sdpa_us=base, gather_sdpa_us=t_gs,
            speedup_vs_sdpa=base / t_graph))


def sdpa(q, k, v):
    """SDPA on [n_q, 12, D] q and [L, 2, D] k/v (timing baseline: no mask for n_q > 1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.FLASH_ATTENTION if CUDA else SDPBackend.MATH
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            enable_gqa=True)


def bench_sdpa(L, n_qs, gen) -> dict:
    res = {}
    per_set = 2 * L * N_KV_HEADS * HEAD_DIM * 2
    sets = n_sets(per_set)
    ks = [torch.randn(L, N_KV_HEADS, HEAD_DIM, device=DEV, generator=gen).half() for _ in range(sets)]
    vs = [torch.randn(L, N_KV_HEADS, HEAD_DIM, device=DEV, generator=gen).half() for _ in range(sets)]
    for n_q in n_qs:
        qs = [torch.randn(n_q, N_HEADS, HEAD_DIM, device=DEV, generator=gen).half() for _ in range(sets)]
        res[(L, n_q)] = time_graph([(lambda i=i: sdpa(qs[i], ks[i], vs[i])) for i in range(sets)])
    return res


def bench_gather(t, L, gen, ceil, rows):
    fmt = PageFormat(t, N_KV_HEADS, HEAD_DIM)
    pages = -(-L // PAGE_TOKENS)
    out_bytes = L * N_KV_HEADS * HEAD_DIM * 2
    sets = n_sets(L * fmt.row_bytes + out_bytes)
    pool = random_pool(fmt, sets * pages, gen)
    perm = torch.randperm(sets * pages, device=DEV, generator=gen).int()
    tables = [perm[i * pages:(i + 1) * pages].contiguous() for i in range(sets)]
    outs = [torch.empty(L, N_KV_HEADS, HEAD_DIM, dtype=torch.float16, device=DEV) for _ in range(sets)]
    us = time_graph([(lambda i=i: gather(pool, tables[i], L, fmt, out=outs[i])) for i in range(sets)])
    nbytes = L * fmt.row_bytes + out_bytes
    gbps = nbytes / us / 1e3
    rows.append(dict(type=t, context=L, sets=sets, us_graph=us, bytes=nbytes, gbps=gbps,
                     frac_copy=gbps / ceil["copy_gbps"], sized_copy_gbps=sized_copy_gbps(nbytes),
                     frac_sized_copy=gbps / sized_copy_gbps(nbytes)))


def bench_store(t, n, gen, rows):
    fmt = PageFormat(t, N_KV_HEADS, HEAD_DIM)
    pool = random_pool(fmt, 4, gen)
    x = torch.randn(n, N_KV_HEADS, HEAD_DIM, device=DEV, generator=gen).half()
    slots = torch.arange(700, 700 + n, device=DEV)
    rows.append(dict(type=t, n_rows=n, us_graph=time_graph([lambda: store(pool, x, slots, fmt)]),
                     us_eager=time_eager(lambda: store(pool, x, slots, fmt))))


# ---- launch-table sweep -------------------------------------------------------------------

# (n_q, variants) per LAUNCH row; each list starts and ends with the current launch (drift check).
# Registers from experiments/kernel_sass.py (triton 3.6, sm_90, q8_0/q4_0, whole tiles unmasked): n_q 1
# 168 (current; 36.7 warp-instructions a key), 255 with one warp (31.6 a key with 64-key tiles, 26.0 with
# 128, 2 spill instructions; 8 programs fit an SM); n_q 6 254 (current), 189 with 64-key tiles; one or two
# warps spill at n_q 6. maxnreg caps them (spills shown there).
SWEEP = [
    (1, [da.Launch(64, 2, 2, 4), da.Launch(64, 1, 2, 8), da.Launch(64, 1, 2, 6), da.Launch(128, 1, 2, 8),
         da.Launch(128, 1, 2, 4), da.Launch(64, 2, 2, 6, 168), da.Launch(32, 2, 2, 8), da.Launch(64, 4, 2, 4),
         da.Launch(64, 2, 2, 4)]),
    (4, [da.Launch(64, 2, 2, 4), da.Launch(64, 4, 2, 4), da.Launch(64, 4, 2, 4, 128),
         da.Launch(32, 2, 2, 8, 128), da.Launch(32, 4, 2, 8), da.Launch(64, 8, 2, 2),
         da.Launch(64, 2, 2, 4)]),
    (6, [da.Launch(128, 4, 2, 2), da.Launch(64, 4, 2, 3, 168), da.Launch(64, 4, 2, 2),
         da.Launch(64, 4, 2, 4, 128), da.Launch(64, 8, 2, 2), da.Launch(128, 4, 2, 2)]),
]


def sweep(gen, ceil, rows, contexts, pairs=(("q8_0", "q4_0"),)):
    """Time the SWEEP launch variants (edit it to explore) at each context, one process."""
    saved = dict(da.LAUNCH)
    for pair, (n_q, variants), L in itertools.product(pairs, SWEEP, contexts):
        block_m = da.block_rows(n_q, N_HEADS // N_KV_HEADS)
        for i, launch in enumerate(variants):
            da.LAUNCH[block_m] = launch
            before = len(rows)
            try:
                bench_decode(pair, L, [n_q], gen, ceil, {}, rows, baselines=False)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                rows.append(dict(k_type=pair[0], v_type=pair[1], context=L, n_q=n_q,
                                 error=f"{type(e).__name__}: {str(e)[:80]}"))
            finally:
                da.LAUNCH.clear()
                da.LAUNCH.update(saved)
            for r in rows[before:]:
                r.update(launch._asdict(), variant=i)
            print({k: rows[-1].get(k) for k in ("k_type", "v_type", "context", "n_q", *launch._fields,
                                                "us_graph", "frac_copy", "error")}, flush=True)


# ---- reporting ---------------------------------------------------------------------------

def asm_stats(prov: dict) -> list[dict]:
    """Per compiled kernel: registers, spills, shared memory, and what its PTX loads/multiplies
    with, and ``prov`` (the run's provenance)."""
    from kernels import gather as g, store as st
    out = []
    for name, fn in [("decode", da._decode_attention_kernel), ("merge", da._merge_kernel),
                     ("gather", g._gather_kernel), ("store", st._store_kernel)]:
        for k in compiled(fn):
            ptx = k.asm.get("ptx", "") if hasattr(k, "asm") else ""
            c = lambda s: ptx.count(s)  # noqa: E731
            out.append(dict(kernel=name, n_regs=getattr(k, "n_regs", None),
                            n_spills=getattr(k, "n_spills", None),
                            shared=getattr(k.metadata, "shared", None),
                            num_warps=getattr(k.metadata, "num_warps", None),
                            ld_v4=c("ld.global.v4") + c("ld.global.L1::evict_last.v4"),
                            ld_v2=c("ld.global.v2"), ld_scalar=c("ld.global.b") + c("ld.global.u"),
                            cp_async=c("cp.async"), wgmma=c("wgmma.mma_async"), mma_sync=c("mma.sync"),
                            constants=str({kk: v for kk, v in getattr(k, "constants", {}).items()
                                           if isinstance(v, (int, bool))})[:300], **prov))
    return out


def plot(dec, gat, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    for (kt, vt), g in dec.groupby(["k_type", "v_type"]):
        for n_q, ls in [(1, "-"), (6, "--")]:
            s = g[g.n_q == n_q].sort_values("context")
            ax[0, 0].plot(s.context, s.us_graph, ls, marker="o", label=f"{kt}/{vt} n_q={n_q}")
            ax[0, 1].plot(s.context, s.frac_copy, ls, marker="o", label=f"{kt}/{vt} n_q={n_q}")
        s1 = g[g.n_q == 1].sort_values("context").set_index("context")
        s6 = g[g.n_q == 6].sort_values("context").set_index("context")
        if len(s1) and len(s6):
            ax[1, 0].plot(s1.index, s6.us_graph / s1.us_graph, marker="o", label=f"{kt}/{vt}")
    base = dec[(dec.k_type == dec.k_type.iloc[0]) & (dec.v_type == dec.v_type.iloc[0])]
    for n_q, ls in [(1, "-"), (6, "--")]:
        s = base[base.n_q == n_q].sort_values("context")
        ax[0, 0].plot(s.context, s.sdpa_us, ls, color="k", label=f"SDPA flash fp16 n_q={n_q}")
    for (kt, vt), g in dec[dec.n_q == 1].groupby(["k_type", "v_type"]):  # copy ceiling at the call's size
        s = g.sort_values("context")
        ax[0, 1].plot(s.context, s.sized_copy_gbps * s.frac_copy / s.gbps, ":", color="gray",
                      label="a copy of the same bytes (f16 top, q4_0/q4_0 bottom)" if kt == vt == "f16" else None)
    for t, g in gat.groupby("type"):
        s = g.sort_values("context")
        line, = ax[1, 1].plot(s.context, s.frac_copy, marker="o", label=f"gather {t} -> fp16")
        ax[1, 1].plot(s.context, s.sized_copy_gbps * s.frac_copy / s.gbps, ":", color=line.get_color(),
                      label=f"a copy of the same bytes ({t})")
    titles = ["decode attention time (us, CUDA graph)", "decode: fraction of copy ceiling",
              "n_q=6 time / n_q=1 time", "gather: fraction of copy ceiling"]
    for a, title in zip(ax.flat, titles):
        a.set_xscale("log", base=2)
        a.set_title(title)
        a.set_xlabel("context (tokens)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    ax[0, 0].set_yscale("log")
    fig.suptitle("Qwen2.5-Coder-1.5B shapes: 12 q heads, 2 KV heads, head_dim 128, one layer")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(dec, gat, ceil):
    print(f"\nceilings: copy {ceil['copy_gbps']:.0f} GB/s, read {ceil['read_gbps']:.0f} GB/s")
    print(f"{'pair':11} {'ctx':>6} {'n_q':>3} {'us':>8} {'eager':>8} {'%copy':>6} {'%sized':>6} {'xSDPA':>6} "
          f"{'6/1':>5} {'us pdl':>7} {'%sized':>6}")
    for _, r in dec[dec.context >= min(32768, dec.context.max())].iterrows():
        one = dec[(dec.k_type == r.k_type) & (dec.v_type == r.v_type) & (dec.context == r.context)
                  & (dec.n_q == 1)]
        ratio = r.us_graph / one.us_graph.iloc[0] if len(one) else float("nan")
        print(f"{r.k_type + '/' + r.v_type:11} {r.context:>6} {r.n_q:>3} {r.us_graph:>8.1f} "
              f"{r.us_eager:>8.1f} {100 * r.frac_copy:>5.0f}% {100 * r.frac_sized_copy:>5.0f}% "
              f"{r.speedup_vs_sdpa:>6.2f} {ratio:>5.2f} {r.us_graph_pdl:>7.1f} {100 * r.frac_sized_copy_pdl:>5.0f}%")
    for _, r in gat[gat.context == gat.context.max()].iterrows():
        print(f"gather {r['type']:5} ctx {r.context}: {r.us_graph:.1f} us, {100 * r.frac_copy:.0f}% of copy, "
              f"{100 * r.frac_sized_copy:.0f}% of a copy of its size")
    q = dec[(dec.k_type != "f16") & (dec.context >= 32768)]
    if len(q):
        print(f"goal >=85% of copy ceiling (q8_0/q4_0, >=32K): min {100 * q.frac_copy.min():.0f}%")
    q64 = dec[(dec.k_type != "f16") & (dec.context == 65536) & (dec.n_q == 1)]
    if len(q64):
        lo, hi = q64.speedup_vs_sdpa.min(), q64.speedup_vs_sdpa.max()
        print(f"goal >=2.0x fp16 SDPA at 64K: {lo:.2f}x .. {hi:.2f}x")


def compare(before: str, after: str) -> "pd.DataFrame":
    """Decode attention's graph time (and, where both runs took it, the PDL-launched one) per (pair, context,
    n_q) in two runs' ``decode_attention.csv``, with the ratio after / before and the size-matched ceiling's
    fraction; the runs' own rows, so one machine's run against another's says little."""
    import pandas as pd

    key = ["k_type", "v_type", "context", "n_q"]
    a, b = (pd.read_csv(os.path.join(d, "decode_attention.csv")) for d in (before, after))
    m = a.merge(b, on=key, suffixes=("_before", "_after"))
    out = m[key].assign(us_before=m.us_graph_before, us_after=m.us_graph_after,
                        ratio=m.us_graph_after / m.us_graph_before,
                        sized_before=m.frac_sized_copy_before, sized_after=m.frac_sized_copy_after)
    if "us_graph_pdl_after" in m:
        out["us_pdl_after"], out["sized_pdl_after"] = m.us_graph_pdl_after, m.frac_sized_copy_pdl_after
    return out.round(3)


def main(args) -> None:
    import pandas as pd
    if args.compare:
        print(compare(*args.compare).to_string(index=False))
        return
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    contexts = args.contexts or ([300] if args.quick else CONTEXTS)
    n_qs = [1, 2] if args.quick else [1, 6]
    ceil = ceilings()
    prov = kernel_provenance()
    if args.sweep:
        rows = []
        sweep(gen, ceil, rows, args.contexts or [32768, 65536, 131072])
        pd.DataFrame(rows).assign(**prov).to_csv(os.path.join(args.out, "sweep.csv"), index=False)
        pd.DataFrame(asm_stats(prov)).to_csv(os.path.join(args.out, "asm.csv"), index=False)
        return
    dec_rows, gat_rows, st_rows = [], [], []
    for L in contexts:
        base = bench_sdpa(L, n_qs, gen)
        for pair in PAIRS:
            bench_decode(pair, L, n_qs, gen, ceil, base, dec_rows)
            print(f"decode {pair} {L}: " + ", ".join(f"n_q={r['n_q']} {r['us_graph']:.1f} us "
                                                      f"{100 * r['frac_copy']:.0f}%"
                                                      for r in dec_rows[-2:]), flush=True)
        for t in ("f16", "q8_0", "q4_0"):
            bench_gather(t, L, gen, ceil, gat_rows)
    for t, n in itertools.product(("f16", "q8_0", "q4_0"), (1, 6)):
        bench_store(t, n, gen, st_rows)
    dec = pd.DataFrame(dec_rows).assign(**prov)
    gat = pd.DataFrame(gat_rows).assign(**prov)
    dec.to_csv(os.path.join(args.out, "decode_attention.csv"), index=False)
    gat.to_csv(os.path.join(args.out, "gather.csv"), index=False)
    pd.DataFrame(st_rows).assign(**prov).to_csv(os.path.join(args.out, "store.csv"), index=False)
    pd.DataFrame([{**ceil, **prov}]).to_csv(os.path.join(args.out, "ceilings.csv"), index=False)
    pd.DataFrame(asm_stats(prov)).to_csv(os.path.join(args.out, "asm.csv"), index=False)
    with open(os.path.join(args.out, "command.txt"), "w") as f:
        f.write("\n".join(f"{k}: {v}" for k, v in prov.items()) + "\n")
    plot(dec, gat, os.path.join(args.out, "bench_kernels.png"))
    summary(dec, gat, ceil)


if __name__ == "__main__":
    main(ARGS)
