"""Decode matmuls on the CUDA cores (kernels/gemv.py) against bf16 cuBLAS, alone and in a layer chain.

    python -m experiments.bench_gemv --out results/kernels/gemv [--sweep]

Per matrix of a Qwen2.5-Coder layer (fused Q/K/V with its bias, output, fused gate/up, down) at
n = 1 and 5 rows: cuBLAS (``F.linear``), the kernel, and the kernel launched as a programmatic
dependent (``pdl``: its first weight tile read while the call before it ends), each a CUDA graph
of calls over weight sets that rotate past the L2 (``common.time_graph``); bytes, the fraction of
the 1 GiB read ceiling measured in the same run, the largest error against the fp64 product.
``--sweep``: the kernel's launch grid at n = 1 with PDL (the data behind ``gemv.launch_for``).

Then the chain: every layer's add + RMSNorm, Q/K/V, output, add + RMSNorm, gate/up, SwiGLU, down
(no attention: the output projection reads Q's columns), n_layers distinct weight sets, one CUDA
graph: a decode step's matmuls and the kernels between them, in three arms: ``cublas``, ``gemv``,
``gemv_pdl`` (the norms and SwiGLU also launched as programmatic dependents). PDL changes no
arithmetic: the arm's output must equal ``gemv``'s bit for bit (checked). Writes ``gemv.csv``,
``chain.csv`` (and ``sweep.csv``) with the GPU, commit and command; prints the tables.

    python -m experiments.bench_gemv --report results/kernels/gemv      # the tables from the CSVs (no GPU)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from experiments.bench_q8_linear import MODELS as Q8_MODELS
from experiments.common import CUDA, DEV, ceilings, git_state, n_sets, time_graph
from kernels.gemv import Launch, gemv, launch_for
from kernels.rms_norm import add_rms_norm
from kernels.swiglu import silu_mul

# name -> (layers, hidden, {matrix: (N, K)}): bench_q8_linear's shapes, the layer matrices (the LM head stays cuBLAS)
MODELS = {name: (layers, mats["wo"][1], {m: s for m, s in mats.items() if m != "lm_head"})
          for name, (layers, mats) in Q8_MODELS.items()}
ARMS = ("cublas", "gemv", "gemv_pdl")
EPS = 1e-6


def matmul(arm: str):
    if arm == "cublas":
        return lambda x, w, b=None: F.linear(x, w, b)
    return lambda x, w, b=None: gemv(x, w, b, pdl=arm == "gemv_pdl")


def _weights(N, K, gen, count):
    return [(torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5).to(torch.bfloat16) for _ in range(count)]


def bench_matrix(N, K, n, gen, ceil, bias: bool, configs=(None,)) -> list[dict]:
    ws = _weights(N, K, gen, n_sets(2 * N * K))
    b = torch.randn(N, device=DEV, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(n, K, device=DEV, generator=gen).to(torch.bfloat16)
    nbytes = 2 * N * K + 2 * n * (K + N)
    ref = x.double() @ ws[0].double().T + (b.double() if bias else 0)
    rows = []
    for c in configs:
        row = dict(N=N, K=K, n=n, bias=bias, **(c or launch_for(N, K))._asdict(), default=c is None)
        arms = ARMS if c is None else ("gemv_pdl",)
        for arm in arms:
            if arm == "cublas":
                fn = lambda w: F.linear(x, w, b)
            else:
                fn = lambda w, pdl=arm == "gemv_pdl": gemv(x, w, b, pdl=pdl, launch=c)
            us = time_graph([(lambda w=w: fn(w)) for w in ws])
            err = ((fn(ws[0]).double() - ref).abs().max() / ref.abs().max()).item()
            row |= {f"{arm}_us": us, f"{arm}_frac_read": nbytes / us / 1e3 / ceil["read_gbps"], f"{arm}_rel_err": err}
        rows.append(row)
    return rows


def sweep_configs():
    return [Launch(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (1024, 2048) for w in (4, 8, 16)]


def chain(model: str, n: int, gen) -> list[dict]:
    layers, hidden, mats = MODELS[model]
    W = [{m: _weights(N, K, gen, 1)[0] for m, (N, K) in mats.items()} | dict(
        bqkv=torch.randn(mats["qkv"][0], device=DEV, generator=gen).to(torch.bfloat16),
        n1=1 + 0.1 * torch.randn(hidden, device=DEV, generator=gen).to(torch.bfloat16),
        n2=1 + 0.1 * torch.randn(hidden, device=DEV, generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    x0 = torch.randn(n, hidden, device=DEV, generator=gen).to(torch.bfloat16)
    nbytes = sum(2 * w[m].numel() for w in W for m in mats)
    out = {}

    def run(arm):
        mm, pdl = matmul(arm), arm == "gemv_pdl"
        x, delta = x0, None
        for L in W:
            x, h = add_rms_norm(x, L["n1"], EPS, delta, pdl=pdl) if delta is not None else add_rms_norm(x, L["n1"], EPS)
            qkv = mm(h, L["qkv"], L["bqkv"])
            x, h = add_rms_norm(x, L["n2"], EPS, mm(qkv[:, :hidden], L["wo"]), pdl=pdl)
            delta = mm(silu_mul(mm(h, L["gate_up"]), pdl=pdl), L["down"])
        out[arm] = x + delta
        return out[arm]

    rows = []
    for arm in ARMS:
        us = time_graph([lambda arm=arm: run(arm)])
        rows.append(dict(model=model, n=n, arm=arm, layers=layers, chain_us=us, weight_bytes=nbytes))
    same = torch.equal(out["gemv"], out["gemv_pdl"])
    dev = ((out["gemv"].float() - out["cublas"].float()).abs().max() / out["cublas"].float().abs().max()).item()
    for r in rows:
        r |= dict(pdl_bit_identical=same, rel_diff_vs_cublas=dev)
    if not same:
        raise SystemExit(f"{model} n={n}: the PDL chain's output differs from the plain launches' (a missing wait)")
    return rows


def tables(df: pd.DataFrame, chains: pd.DataFrame, sweep: pd.DataFrame | None) -> str:
    """The per-matrix table, the chains against cuBLAS and the bytes' floor, the sweep's fastest."""
    cols = ["model", "matrix", "n", "block_n", "block_k", "num_warps"] + [f"{a}_us" for a in ARMS] + [
        f"{a}_frac_read" for a in ARMS] + ["gemv_rel_err"]
    ch = chains.assign(floor_us=chains.weight_bytes / chains.read_gbps / 1e3)
    base = ch[ch.arm == "cublas"].set_index(["model", "n"]).chain_us
    ch = ch.assign(vs_cublas=ch.chain_us / base.loc[list(zip(ch.model, ch.n))].values,
                   frac_read=ch.floor_us / ch.chain_us)
    out = [df[cols].round(3).to_string(index=False), "",
           "the layer chain (n_layers x norm, Q/K/V, output, norm, gate/up, SwiGLU, down), us:",
           ch[["model", "n", "arm", "chain_us", "vs_cublas", "floor_us", "frac_read", "rel_diff_vs_cublas",
               "pdl_bit_identical"]].round(3).to_string(index=False)]
    if sweep is not None:
        best = sweep.loc[sweep.groupby(["model", "matrix"])["gemv_pdl_us"].idxmin()]
        chosen = df[df.n == 1].set_index(["model", "matrix"]).gemv_pdl_us
        best = best.assign(rule_us=chosen.loc[list(zip(best.model, best.matrix))].values)
        out += ["", "fastest launch per matrix in the sweep (n = 1, PDL) and launch_for's in the main table:",
                best[["model", "matrix", "block_n", "block_k", "num_warps", "gemv_pdl_us", "gemv_pdl_frac_read",
                      "rule_us"]].round(3).to_string(index=False)]
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels/gemv")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--sweep", action="store_true", help="also time the launch grid at n = 1 (PDL)")
    ap.add_argument("--report", metavar="DIR", help="print the tables of a run's CSVs and exit (no GPU)")
    args = ap.parse_args(argv)
    if args.report:
        d = Path(args.report)
        sweep = pd.read_csv(d / "sweep.csv") if (d / "sweep.csv").exists() else None
        print(tables(pd.read_csv(d / "gemv.csv"), pd.read_csv(d / "chain.csv"), sweep))
        return
    if not CUDA:
        raise SystemExit("bench_gemv times CUDA kernels: run it on the GPU machine")
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings()
    commit, dirty = git_state()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=commit, dirty=dirty,
                command=" ".join(["python -m experiments.bench_gemv"] + sys.argv[1:]), **ceil)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, swept, chains = [], [], []
    for model in args.models:
        for n in args.rows:
            chains += chain(model, n, gen)
            print(pd.DataFrame(chains[-3:]).round(3).to_string(index=False), flush=True)
        for name, (N, K) in MODELS[model][2].items():
            for n in args.rows:
                rows += [dict(model=model, matrix=name, **r) for r in bench_matrix(N, K, n, gen, ceil, name == "qkv")]
                print(rows[-1], flush=True)
            if args.sweep:
                swept += [dict(model=model, matrix=name, **r)
                          for r in bench_matrix(N, K, 1, gen, ceil, name == "qkv", sweep_configs())]
    chains = pd.DataFrame(chains).assign(**meta)
    chains.to_csv(out / "chain.csv", index=False)
    df = pd.DataFrame(rows).assign(**meta)
    df.to_csv(out / "gemv.csv", index=False)
    sweep = pd.DataFrame(swept).assign(**meta) if swept else None
    if sweep is not None:
        sweep.to_csv(out / "sweep.csv", index=False)
    print(tables(df, chains, sweep))


if __name__ == "__main__":
    main()
