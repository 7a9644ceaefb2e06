"""q8_0 weight matmuls (kernels/q8_linear.py) against bf16 cuBLAS (F.linear) on the real models' shapes.

    python experiments/bench_q8_linear.py --out results/kernels/q8_linear [--sweep]

For each matrix of a Qwen2.5-Coder layer (fused Q/K/V, output, fused gate/up, down) and the LM
head, at n = 1 (decode), 5 (a verify batch of 4 drafts) and 1024 (a prefill chunk) rows: the
kernel's time with its default launch (``kernels.q8_linear.launch``) and bf16 F.linear's, both
as CUDA graphs of calls over weight sets that rotate past the L2 (``common.time_graph``); bytes
read and written, GB/s against the copy ceiling of the same size (``sized_copy_gbps``) and the
1 GiB read ceiling measured in the same run, bf16 time / q8_0 time, TFLOP/s for the prefill
rows, and the largest error against the fp32 reference. ``--sweep`` also times the launch grid
(row tile, K split, blocks per iteration; at n = 1 also the CUDA-core GEMV, ``bm`` 1; tiles and
warps for prefill) at n = 1 and 1024, the data behind ``launch``. Writes
``q8_linear.csv`` (and ``sweep.csv``) and prints the per-step totals: a decode step's matmuls
(n_layers x the layer's four, plus the LM head) in q8_0 and bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from experiments.common import CUDA, DEV, ceilings, git_state, n_sets, sized_copy_gbps, time_graph
from kernels import reference
from kernels.q8_linear import Launch, launch, q8_linear

MODELS = {  # name -> (layers, {matrix: (N, K)})
    "qwen2.5-coder-1.5b": (28, {"qkv": (2048, 1536), "wo": (1536, 1536), "gate_up": (17920, 1536),
                                "down": (1536, 8960), "lm_head": (151936, 1536)}),
    "qwen2.5-coder-0.5b": (24, {"qkv": (1152, 896), "wo": (896, 896), "gate_up": (9728, 896),
                                "down": (896, 4864), "lm_head": (151936, 896)}),
}


def _sets(N, K, gen):
    """Weight sets (q8_0 and bf16 of the same values) enough to rotate past the L2."""
    out = []
    for _ in range(n_sets(N * K * 2)):
        w = torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5
        out.append((*reference.q8_weight(w), w.to(torch.bfloat16)))
    return out


def bench(N, K, n, gen, ceil, configs=(None,)) -> list[dict]:
    sets = _sets(N, K, gen)
    x = torch.randn(n, K, device=DEV, generator=gen).to(torch.bfloat16)
    q8_bytes = N * K + N * K // 32 * 2 + 2 * n * (K + N)
    bf_bytes = 2 * N * K + 2 * n * (K + N)
    bf_us = time_graph([(lambda s=s: F.linear(x, s[2])) for s in sets])
    ref = reference.q8_linear(x.float(), sets[0][0], sets[0][1])
    rows = []
    for c in configs:
        out = q8_linear(x, sets[0][0], sets[0][1], config=c)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        us = time_graph([(lambda s=s: q8_linear(x, s[0], s[1], config=c)) for s in sets])
        chosen = c or launch(n, N, K)
        rows.append(dict(N=N, K=K, n=n, **chosen._asdict(), default=c is None, q8_us=us, bf16_us=bf_us, speedup=bf_us / us,
                         q8_gbps=q8_bytes / us / 1e3, frac_sized_copy=q8_bytes / us / 1e3 / sized_copy_gbps(q8_bytes),
                         frac_read=q8_bytes / us / 1e3 / ceil["read_gbps"], bf16_gbps=bf_bytes / bf_us / 1e3,
                         bf16_frac_read=bf_bytes / bf_us / 1e3 / ceil["read_gbps"],
                         q8_tflops=2 * n * N * K / us / 1e6, bf16_tflops=2 * n * N * K / bf_us / 1e6, rel_err=err))
    return rows


def sweep_configs(n):
    if n > 16:
        return [Launch(bm, bn, 1, warps, 3, blocks) for bm, bn in ((64, 64), (64, 128), (128, 128)) for blocks in (1, 2)
                for warps in (4, 8)]
    mma = [Launch(16, bn, split, 4, 3, blocks) for bn in (32, 128) for split in (1, 4, 8, 16) for blocks in (4, 8)]
    gemv = [Launch(1, bn, split, 4, 3, blocks) for bn in (32, 128) for split in (1, 4, 16) for blocks in (4, 8)]
    return mma + (gemv if n == 1 else [])


def split_report(sweep_csv: str, table_csv: str) -> str:
    """The 32-row, 4-block launches' time by K split at n = 1 (``sweep_csv``), and per model a
    decode step's matmuls (``table_csv``, n = 1) with each such matrix at the sweep's fastest split."""
    sw, tab = pd.read_csv(sweep_csv), pd.read_csv(table_csv)
    sw = sw[(sw.n == 1) & (sw.bm == 16) & (sw.bn == 32) & (sw.warps == 4) & (sw.stages == 3) & (sw.blocks == 4)]
    piv = sw.pivot_table(index=["model", "matrix"], columns="split", values="q8_us")
    out = [f"q8_0 us at n = 1 by K split (32-row tiles, 4 blocks an iteration), {sweep_csv}:", piv.round(2).to_string()]
    tab = tab[tab.n == 1]
    for model, g in tab.groupby("model"):
        now = (g.q8_us * g.per_step).sum()
        best = sum(r.per_step * (piv.loc[(model, r.matrix)].min() if r.bn == 32 and (model, r.matrix) in piv.index
                                 else r.q8_us) for r in g.itertuples())
        bf = (g.bf16_us * g.per_step).sum()
        out.append(f"{model}: a step's matmuls {now:.0f} us with the table's launches, {best:.0f} us with the "
                   f"sweep's best split for the 32-row ones; bf16 {bf:.0f} us ({bf / now:.3f}x, {bf / best:.3f}x)")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels/q8_linear")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 1024])
    ap.add_argument("--sweep", action="store_true", help="also time the launch grid at n = 1 and 1024")
    ap.add_argument("--report", nargs=2, metavar=("SWEEP", "TABLE"),
                    help="no GPU: a sweep's K splits of the 32-row launches, and a step's matmuls with the "
                         "table's launches against the sweep's best 32-row split (CSVs of one run)")
    args = ap.parse_args(argv)
    if args.report:
        print(split_report(*args.report))
        return
    if not CUDA:
        raise SystemExit("bench_q8_linear times CUDA kernels: run it on the GPU machine")
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings()
    rows, swept = [], []
    for model in args.models:
        layers, mats = MODELS[model]
        for name, (N, K) in mats.items():
            for n in args.rows:
                r = bench(N, K, n, gen, ceil)
                rows += [dict(model=model, matrix=name, per_step=1 if name == "lm_head" else layers, **x) for x in r]
                print(rows[-1], flush=True)
                if args.sweep and n in (1, 1024):
                    swept += [dict(model=model, matrix=name, **x) for x in bench(N, K, n, gen, ceil, sweep_configs(n))]
    commit, dirty = git_state()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit, dirty=dirty,
                command=" ".join(["python"] + sys.argv), **ceil)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows).assign(**meta)
    df.to_csv(out / "q8_linear.csv", index=False)
    cols = ["model", "matrix", "N", "K", "n", "bn", "split", "q8_us", "bf16_us", "speedup", "frac_sized_copy",
            "frac_read", "bf16_frac_read", "q8_tflops", "rel_err"]
    print(df[cols].round(3).to_string(index=False))
    for (model, n), g in df.groupby(["model", "n"]):
        q8, bf = (g["q8_us"] * g["per_step"]).sum(), (g["bf16_us"] * g["per_step"]).sum()
        print(f"{model} n={n}: a step's matmuls {q8:.0f} us in q8_0, {bf:.0f} us in bf16 ({bf / q8:.2f}x)")
    if swept:
        sw = pd.DataFrame(swept).assign(**meta)
        sw.to_csv(out / "sweep.csv", index=False)
        best = sw.loc[sw.groupby(["model", "matrix", "n"])["q8_us"].idxmin()]
        print("fastest launch per matrix and n:")
        print(best[["model", "matrix", "n", "bm", "bn", "split", "blocks", "warps", "q8_us", "frac_read", "q8_tflops"]].round(3).to_string(index=False))


if __name__ == "__main__":
    main()
