"""A/B: int8-QK decode attention for q8_0 K (kernels/decode_attention_i8k.py) vs the current kernel.

One process, one GPU: q8_0/q4_0 and q8_0/q8_0 pages at 32K / 64K / 128K tokens, n_q 1 and 6,
Qwen2.5-Coder-1.5B's layer (12 q heads, 2 KV heads, head_dim 128). Variants: ``current``
(decode_attention.decode_attention), ``i8k`` (q scale per row and 32-block, the NOTES lead) and
``i8k_row`` (one q scale per row: fewer fp32 ops per logit, coarser query). Timing, data and ceiling
are bench_kernels.py's: every call of several input sets (random pages, never zeros, >= 512 MB in
all) captured in one CUDA graph (``time_graph``), the copy ceiling measured in this run. Each
variant's max abs error is measured against the fp32 reference (kernels.reference) on set 0.

Writes i8k.csv to --out and prints a table (us, % of the copy ceiling, variant / current time,
max abs error and its ratio to the current kernel's). ~1-2 min on an H200, compiles included.

    python experiments/bench_i8k.py --out results/kernels/variants/i8k
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    sys.exit("bench_i8k.py needs a CUDA GPU (it times CUDA graphs); none is visible here")

from experiments import bench_kernels as bk  # noqa: E402
from kernels import decode_attention as da  # noqa: E402
from kernels import decode_attention_i8k as i8k  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.formats import PAGE_TOKENS, PageFormat  # noqa: E402

PAIRS = [("q8_0", "q4_0"), ("q8_0", "q8_0")]
CONTEXTS = [32768, 65536, 131072]
N_QS = [1, 6]
VARIANTS = {
    "current": da.decode_attention,
    "i8k": i8k.decode_attention,
    "i8k_row": lambda *a, **kw: i8k.decode_attention(*a, qrow=True, **kw),
}


def bench_case(pair, L, gen, ceil, rows):
    H, KVH, D = bk.N_HEADS, bk.N_KV_HEADS, bk.HEAD_DIM
    kf, vf = PageFormat(pair[0], KVH, D), PageFormat(pair[1], KVH, D)
    pages = -(-L // PAGE_TOKENS)
    sets = bk.n_sets(bk.kv_bytes(L, kf, vf))
    kp, vp = bk.random_pool(kf, sets * pages, gen), bk.random_pool(vf, sets * pages, gen)
    perm = torch.randperm(sets * pages, device=bk.DEV, generator=gen).int()
    tables = [perm[i * pages:(i + 1) * pages].contiguous() for i in range(sets)]
    lens = [torch.full((1,), L, dtype=torch.int64, device=bk.DEV) for _ in range(sets)]
    for n_q in N_QS:
        qs = [torch.randn(n_q, H, D, device=bk.DEV, generator=gen).half() for _ in range(sets)]
        outs = [torch.empty_like(q) for q in qs]
        want = reference.decode_attention(qs[0], kp, vp, tables[0], L, kf, vf)  # fp32 [n_q, H, D]
        splits = da.splits_for(n_q, H, KVH, L, bk.DEV)
        nbytes = bk.kv_bytes(L, kf, vf) + 2 * n_q * H * D * 2 + 4 * pages \
            + (2 * splits * n_q * H * (D + 2) * 4 if splits > 1 else 0)  # as bench_decode counts
        base = None
        for name, fn in VARIANTS.items():
            def call(i, fn=fn):
                return lambda: fn(qs[i], kp, vp, tables[i], lens[i], kf, vf, out=outs[i])
            us = bk.time_graph([call(i) for i in range(sets)])
            call(0)()
            err = (outs[0].float() - want).abs().max().item()
            row = dict(variant=name, k_type=pair[0], v_type=pair[1], context=L, n_q=n_q, n_splits=splits,
                       sets=sets, us_graph=us, bytes=nbytes, gbps=nbytes / us / 1e3,
                       frac_copy=nbytes / us / 1e3 / ceil["copy_gbps"], max_abs_err=err,
                       out_max_abs=want.abs().max().item())
            base = base or row
            row.update(time_vs_current=us / base["us_graph"],
                       err_vs_current=err / base["max_abs_err"] if base["max_abs_err"] else float("nan"))
            rows.append(row)
            print(f"{pair[0]}/{pair[1]} {L:>6} n_q={n_q} {name:8} {us:7.1f} us {100 * row['frac_copy']:4.0f}% "
                  f"x{row['time_vs_current']:.3f}  err {err:.2e} (x{row['err_vs_current']:.1f})", flush=True)
        del want
    del kp, vp
    torch.cuda.empty_cache()


def main(argv=None):
    import pandas as pd
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (i8k.csv)")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference's einsums stay fp32
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    gen = torch.Generator(device=bk.DEV).manual_seed(0)
    ceil = bk.ceilings()
    prov = bk.provenance()
    print(f"copy ceiling {ceil['copy_gbps']:.0f} GB/s, read {ceil['read_gbps']:.0f} GB/s; {prov['gpu']}, "
          f"torch {prov['torch']}, triton {prov['triton']}, commit {prov['commit']} dirty={prov['dirty']}")
    rows = []
    for pair in PAIRS:
        for L in CONTEXTS:
            bench_case(pair, L, gen, ceil, rows)
    df = pd.DataFrame(rows).assign(copy_gbps=ceil["copy_gbps"], read_gbps=ceil["read_gbps"], **prov)
    df.to_csv(os.path.join(args.out, "i8k.csv"), index=False)
    print(f"\n{'pair':10} {'ctx':>6} {'n_q':>3} | " + " | ".join(f"{v:^26}" for v in VARIANTS))
    print(f"{'':10} {'':>6} {'':>3} | " + " | ".join(f"{'us':>6} {'%copy':>5} {'x cur':>5} {'err':>7}" for _ in VARIANTS))
    for (kt, vt, L, n_q), g in df.groupby(["k_type", "v_type", "context", "n_q"], sort=False):
        cells = [f"{r.us_graph:6.1f} {100 * r.frac_copy:4.0f}% {r.time_vs_current:5.2f} {r.max_abs_err:7.1e}"
                 for _, r in g.set_index("variant").loc[list(VARIANTS)].iterrows()]
        print(f"{kt + '/' + vt:10} {L:>6} {n_q:>3} | " + " | ".join(cells))
    print(f"\nwrote {os.path.join(args.out, 'i8k.csv')} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
