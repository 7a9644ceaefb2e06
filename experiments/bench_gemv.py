"""Decode matmuls by Triton kernels (kernels/gemv.py, gemv_mma.py, q8_gemv.py) against bf16 cuBLAS, alone and in a layer chain.

    python -m experiments.bench_gemv --out results/kernels/gemv [--rows 1 5] [--sweep]

Per matrix of a Qwen2.5-Coder layer (fused Q/K/V with its bias, output, fused gate/up, down) at
each ``--rows`` count: cuBLAS (``F.linear``), the CUDA-core kernel (``gemv``, up to 8 rows), it
launched as a programmatic dependent (``gemv_pdl``: its first weight tile read while the call
before it ends) and the tensor-core kernel so launched (``mma_pdl``, up to 16 rows: a verify
batch), and for the same values in q8_0 blocks ``kernels/q8_linear.py`` (``q8_linear``, tensor cores,
as ``model.weights=q8_0`` runs without ``model.gemv``) and ``kernels/q8_gemv.py`` launched as a dependent
(``q8_pdl``, up to 8 rows), and it with x quantized to q8_0 blocks and an int8 dot (``q8i_pdl``,
``model.weights=q8_0_int8``), and it given x's q8_0 blocks made beforehand (``q8x_pdl``: as the model's norms
write them for the matmuls after them); on gate/up also its SwiGLU epilogue, int8 (``q8i_glu``) and given x's
blocks and writing h's for down (``q8x_glu``: the model's gate/up); each a CUDA graph of calls over weight sets that rotate past the L2
(``common.time_graph``); bytes (each arm's own), the fraction of the 1 GiB read ceiling measured in the
same run, the largest error against the fp64 product (of the dequantized weight for the q8_0 arms, and
of x's q8_0 round trip for ``q8i``). The
LM head is timed alone, not in the chain. ``--sweep``: the kernels' launch grids with PDL, the CUDA-core
ones at one row, the tensor-core one at five (the data behind each ``launch_for``).

Then the chain: every layer's add + RMSNorm, Q/K/V, output, add + RMSNorm, gate/up, SwiGLU, down
(no attention: the output projection reads Q's columns), n_layers distinct weight sets, one CUDA
graph: a decode step's matmuls and the kernels between them, in the arms ``cublas``, ``gemv``,
``gemv_pdl`` (the norms and SwiGLU also launched as programmatic dependents), ``gemv_pdl_glu``
(SwiGLU in gate/up's epilogue, as ``model.gemv`` runs one row), ``mma_pdl_glu`` (the same with
the tensor-core kernel for every matrix) and ``gemv_pdl_model`` (each matmul as ``model.gemv`` routes
it: ``weights.decode_matmul``, cuBLAS where it gives none); with the weights in q8_0, ``q8_linear_model``
(``model.weights=q8_0``), ``q8_pdl_model`` (with ``model.gemv``), ``q8i_pdl_glu`` (x in q8_0 blocks made by
each matmul's programs, an int8 dot) and ``q8i_pdl_model`` (``q8_0_int8`` as the model runs it: the norms and
gate/up's epilogue write the blocks once). Neither PDL nor the fold changes the
arithmetic: ``gemv_pdl`` and ``gemv_pdl_glu`` must equal ``gemv`` bit for bit (checked). Writes
``gemv.csv``, ``chain.csv`` (and ``sweep.csv``) with the GPU, commit and command; prints the tables.

    python -m experiments.bench_gemv --report results/kernels/gemv      # the tables from the CSVs (no GPU)
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
import triton

from experiments.bench_q8_linear import MODELS as Q8_MODELS
from experiments.common import CUDA, DEV, ceilings, git_state, n_sets, time_graph
from kernels import gemv as cuda_core, gemv_mma as mma, q8_gemv
from kernels.reference import q8_dense, q8_round, q8_rows
from kvstream.model import weights
from kernels.rms_norm import add_rms_norm
from kernels.swiglu import silu_mul

# name -> (layers, hidden, {matrix: (N, K)}): bench_q8_linear's shapes; the layer's matrices make the chain
MODELS = {name: (layers, mats["wo"][1], mats) for name, (layers, mats) in Q8_MODELS.items()}
MATRIX_ARMS = ("cublas", "gemv", "gemv_pdl", "mma_pdl", "q8_linear", "q8_pdl", "q8i_pdl", "q8x_pdl")
GLU_ARMS = ("q8i_glu", "q8x_glu")  # gate/up only: [W_gate; W_up] with SwiGLU in the epilogue
ARMS = ("cublas", "gemv", "gemv_pdl", "gemv_pdl_glu", "mma_pdl_glu", "gemv_pdl_model", "q8_linear_model",
        "q8_pdl_model", "q8i_pdl_glu", "q8i_pdl_model")
CUDA_CORE = ("gemv", "gemv_pdl", "gemv_pdl_glu", "q8_pdl", "q8i_pdl", "q8x_pdl", "q8i_pdl_glu") + GLU_ARMS
EPS = 1e-6
# --sweep: each kernel's launch grid at this many rows
SWEEPS = (("gemv_pdl", 1), ("mma_pdl", 5), ("q8_pdl", 1), ("q8i_pdl", 1), ("q8x_pdl", 1), ("q8x_glu", 1))
Q8_SWEEPS = ("q8_pdl", "q8i_pdl", "q8x_pdl")  # (the LM head's too)


def arms_for(arms, n: int) -> list[str]:
    """The arms that take n rows: the CUDA-core kernels up to 8, the tensor-core one up to 16."""
    return [a for a in arms if not (a in CUDA_CORE and n > cuda_core.MAX_ROWS)
            and not ((a.startswith("mma") or a == "gemv_pdl_model") and n > mma.MAX_ROWS)]


def q8(arm: str) -> bool:
    """Whether the arm reads the weights in q8_0 blocks."""
    return arm.startswith("q8")


def int8(arm: str) -> bool:
    """Whether the arm multiplies x in q8_0 blocks too (``q8i``, ``q8x``: ``model.weights=q8_0_int8``)."""
    return arm.startswith(("q8i", "q8x"))


def matmul(arm: str, launch=None):
    """The arm's x @ w^T (+ b); ``glu=True`` calls return SwiGLU of a gate/up product (the model's arms:
    with h's q8_0 blocks or None, ``weights.swiglu``); ``xq``: x's q8_0 blocks, for the arms that take them."""
    if arm.endswith("_model"):  # as the model runs its matmuls, with model.gemv (pdl) or without
        on = "pdl" in arm
        return lambda x, w, b=None, glu=False, xq=None: (weights.swiglu(x, w, silu_mul, on, xq) if glu
                                                         else weights.linear(x, w, b, on, xq))
    if arm == "cublas":
        return lambda x, w, b=None: F.linear(x, w, b)
    if arm == "q8_linear":
        return lambda x, w, b=None: weights.linear(x, w, b)
    if arm in GLU_ARMS:  # h alone: q8x_glu's blocks of h are written, not returned
        q8_out = arm == "q8x_glu"

        def glu_arm(x, w, b=None, xq=None):
            out = q8_gemv.q8_gemv(x, w.q, w.d, glu=True, int8=True, xq=xq, q8_out=q8_out, pdl=True, launch=launch)
            return out[0] if q8_out else out
        return glu_arm
    if arm.startswith("q8"):  # q8_pdl, q8i_pdl, q8x_pdl
        return lambda x, w, b=None, glu=False, xq=None: q8_gemv.q8_gemv(x, w.q, w.d, b, glu=glu, int8=int8(arm),
                                                                        xq=xq, pdl=True, launch=launch)
    kernel = mma.gemv_mma if arm.startswith("mma") else cuda_core.gemv
    return lambda x, w, b=None, glu=False: kernel(x, w, b, glu=glu, pdl="pdl" in arm, launch=launch)


def _weights(N, K, gen, count):
    return [(torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5).to(torch.bfloat16) for _ in range(count)]


def bench_matrix(N, K, n, gen, ceil, bias: bool, configs=(None,), arm="gemv_pdl", arms=MATRIX_ARMS) -> list[dict]:
    """Each of ``arms`` at the default launch; with ``configs``, ``arm`` at each launch of the grid."""
    ws = _weights(N, K, gen, n_sets(2 * N * K))
    run = arms_for(arms, n) if configs == (None,) else [arm]
    qs = [weights.Q8.of(w) for w in ws] if any(map(q8, run)) else None  # (the q8 arms pass int8 themselves)
    b = torch.randn(N, device=DEV, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(n, K, device=DEV, generator=gen).to(torch.bfloat16)
    io = 2 * n * (K + N)
    refs = {False: x.double() @ ws[0].double().T + (b.double() if bias else 0)}
    if qs:  # (the int8 arms: x through q8_0 too)
        refs[True] = x.double() @ q8_dense(qs[0].q, qs[0].d).double().T + (b.double() if bias else 0)
        refs["int8"] = q8_round(x).double() @ q8_dense(qs[0].q, qs[0].d).double().T + (b.double() if bias else 0)
        refs["glu"] = F.silu(refs["int8"][:, :N // 2]) * refs["int8"][:, N // 2:]
    xq = tuple(t.to(DEV) for t in q8_rows(x.cpu()))  # (the q8x arms: x's blocks as a norm writes them)
    rows = []
    for c in configs:
        # the launches: a sweep's config, or each kernel's rule (launch: the CUDA-core one's, mma_launch, q8_launch)
        row = dict(N=N, K=K, n=n, bias=bias, default=c is None, launch=str(tuple(
            c or cuda_core.launch_for(N, K))), mma_launch=None if c else str(tuple(mma.launch_for(N, K))),
            q8_launch=None if c else str(tuple(q8_gemv.launch_for(N, K))))
        for a in run:
            fn, wset = matmul(a, c), qs if q8(a) else ws
            if a.startswith("q8x"):
                fn = functools.partial(fn, xq=xq)
            try:
                us = time_graph([(lambda w=w: fn(x, w, b)) for w in wset])
            except triton.runtime.errors.OutOfResources as e:  # a sweep's launch past the SM's shared memory
                print(f"{N}x{K} n={n} {a} {c}: {e}", flush=True)
                continue
            ref = refs["glu" if a in GLU_ARMS else "int8" if int8(a) else q8(a)]
            err = ((fn(x, wset[0], b).double() - ref).abs().max() / ref.abs().max()).item()
            nbytes = wset[0].nbytes + io
            row |= {f"{a}_us": us, f"{a}_frac_read": nbytes / us / 1e3 / ceil["read_gbps"], f"{a}_rel_err": err}
        if any(k.endswith("_us") for k in row):  # (a sweep's launch that did not fit leaves no row)
            rows.append(row)
    return rows


def sweep_configs(arm: str):
    if arm == "q8_pdl":
        return [q8_gemv.Launch(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]
    if arm == "q8i_pdl":  # more rows a program: each quantizes x's K itself
        return [q8_gemv.Launch(bn, bk, w) for bn in (8, 16, 32) for bk in (512, 1024, 2048) for w in (4, 8)]
    if arm == "q8x_pdl":  # (and K shared by 2 or 4 programs: down's long K in few programs)
        return [q8_gemv.Launch(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (512, 1024, 2048) for w in (4, 8)] + \
            [q8_gemv.Launch(bn, bk, 4, sp) for bn in (4, 8) for bk in (1024, 2048) for sp in (2, 4)]
    if arm == "q8x_glu":  # 64 rows a program or more hold 32 whole columns of h; fewer share a block (counters)
        return [q8_gemv.Launch(bn, bk, w) for bn in (64, 128) for bk in (128, 256, 512, 1024) for w in (4, 8)] + \
            [q8_gemv.Launch(bn, bk, w) for bn in (8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8)]
    if arm.startswith("mma"):
        return [mma.Launch(bn, bk, w, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8)
                for st in (2, 4)] + [mma.Launch(bn, bk, 4, 3, sp) for bn in (16, 32, 64) for bk in (128, 256)
                                     for sp in (2, 4, 8)]
    return [cuda_core.Launch(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (1024, 2048) for w in (4, 8, 16)]


def chain(model: str, n: int, gen) -> list[dict]:
    layers, hidden, mats = MODELS[model]
    mats = {m: s for m, s in mats.items() if m != "lm_head"}
    W = [{m: _weights(N, K, gen, 1)[0] for m, (N, K) in mats.items()} | dict(
        bqkv=torch.randn(mats["qkv"][0], device=DEV, generator=gen).to(torch.bfloat16),
        n1=1 + 0.1 * torch.randn(hidden, device=DEV, generator=gen).to(torch.bfloat16),
        n2=1 + 0.1 * torch.randn(hidden, device=DEV, generator=gen).to(torch.bfloat16)) for _ in range(layers)]
    x0 = torch.randn(n, hidden, device=DEV, generator=gen).to(torch.bfloat16)
    arms = arms_for(ARMS, n)
    Wq = [L | {m: weights.Q8.of(L[m]) for m in mats} for L in W] if any(map(q8, arms)) else None
    Wi = [L | {m: replace(L[m], int8=True) for m in mats} for L in Wq] if any(map(int8, arms)) else None
    nbytes = {fmt: sum(L[m].nbytes for L in ws for m in mats) for fmt, ws in ((False, W), (True, Wq)) if ws}
    out = {}

    def run(arm):
        mm, pdl, glu = matmul(arm.removesuffix("_glu")), "pdl" in arm, arm.endswith("_glu")
        model = arm.endswith("_model")
        x, delta = x0, None
        for L in Wi if int8(arm) else Wq if q8(arm) else W:
            q8x = model and weights.int8_row(x, L["qkv"], pdl)  # the norms write h's q8_0 blocks, as the model's do
            x, h, *hq = add_rms_norm(x, L["n1"], EPS, delta, pdl=pdl and delta is not None, q8=q8x)
            qkv = mm(h, L["qkv"], L["bqkv"], **({"xq": hq[0]} if hq else {}))
            x, h, *hq = add_rms_norm(x, L["n2"], EPS, mm(qkv[:, :hidden], L["wo"]), pdl=pdl, q8=q8x)
            if model:  # gate/up as weights.swiglu runs it, down given h's blocks where it wrote them
                act, aq = mm(h, L["gate_up"], glu=True, **({"xq": hq[0]} if hq else {}))
                delta = mm(act, L["down"], xq=aq)
            else:
                act = mm(h, L["gate_up"], glu=True) if glu else silu_mul(mm(h, L["gate_up"]), pdl=pdl)
                delta = mm(act, L["down"])
        out[arm] = x + delta
        return out[arm]

    rows = []
    for arm in arms:
        us = time_graph([lambda arm=arm: run(arm)])
        rows.append(dict(model=model, n=n, arm=arm, layers=layers, chain_us=us, weight_bytes=nbytes[q8(arm)]))
    # the arms that must equal gemv's bytes (PDL, the SwiGLU fold); the others compare with nothing (None)
    same = {a: torch.equal(out["gemv"], out[a]) for a in ("gemv_pdl", "gemv_pdl_glu") if a in out}
    ref = out["cublas"].float()
    for r in rows:
        r |= dict(pdl_bit_identical=same.get(r["arm"]), rel_diff_vs_cublas=((out[r["arm"]].float() - ref).abs().max()
                                                                            / ref.abs().max()).item())
    if not all(same.values()):
        raise SystemExit(f"{model} n={n}: the PDL (or folded SwiGLU) chain's output differs from the plain "
                         "launches' (a missing wait, or the fold's rounding)")
    return rows


def tables(df: pd.DataFrame, chains: pd.DataFrame, sweep: pd.DataFrame | None) -> str:
    """The per-matrix table, the chains against cuBLAS and the bytes' floor, the sweep's fastest."""
    arms = [a for a in MATRIX_ARMS + GLU_ARMS if f"{a}_us" in df]  # (a run before the tensor-core kernel has no mma arm)
    launch = ["launch"] if "launch" in df else ["block_n", "block_k", "num_warps"]
    launch += [c for c in ("mma_launch", "q8_launch") if c in df]
    # (rel_err: the largest error over the largest output, against fp64: one bf16 rounding for every arm)
    cols = ["model", "matrix", "n"] + launch + [f"{a}_us" for a in arms] + [f"{a}_frac_read" for a in arms] + [
        f"{a}_rel_err" for a in arms if a != "cublas"]
    ch = chains.assign(floor_us=chains.weight_bytes / chains.read_gbps / 1e3)
    base = ch[ch.arm == "cublas"].set_index(["model", "n"]).chain_us
    ch = ch.assign(vs_cublas=ch.chain_us / base.loc[list(zip(ch.model, ch.n))].values,
                   frac_read=ch.floor_us / ch.chain_us)
    out = [df[cols].round(3).to_string(index=False), "",
           "the layer chain (n_layers x norm, Q/K/V, output, norm, gate/up, SwiGLU, down), us:",
           ch[["model", "n", "arm", "chain_us", "vs_cublas", "floor_us", "frac_read", "rel_diff_vs_cublas",
               "pdl_bit_identical"]].round(3).to_string(index=False)]
    if sweep is not None:  # (a run before the tensor-core kernel swept the CUDA-core one alone, at one row)
        sweep = sweep if "arm" in sweep else sweep.assign(arm="gemv_pdl")
        launch = ["launch"] if "launch" in sweep else ["block_n", "block_k", "num_warps"]
        for (arm, n), sw in sweep.groupby(["arm", "n"]):
            best = sw.loc[sw.groupby(["model", "matrix"])[f"{arm}_us"].idxmin()]
            chosen = df[df.n == n].set_index(["model", "matrix"])[f"{arm}_us"]
            best = best.assign(rule_us=chosen.reindex(list(zip(best.model, best.matrix))).values)
            out += ["", f"fastest {arm} launch per matrix in the sweep (n = {n}) and launch_for's in the main table:",
                    best[["model", "matrix"] + launch + [f"{arm}_us", f"{arm}_frac_read", "rule_us"]].round(3)
                    .to_string(index=False)]
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels/gemv")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--sweep", nargs="*", choices=[a for a, _ in SWEEPS],
                    help="also time launch grids with PDL (no name: both): the CUDA-core kernel's at 1 row, the "
                         "tensor-core one's at 5")
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
            print(pd.DataFrame(chains[-len(arms_for(ARMS, n)):]).round(3).to_string(index=False), flush=True)
        for name, (N, K) in MODELS[model][2].items():
            head = name == "lm_head"  # a single row of logits, by cuBLAS, gemv and the q8_0 kernels
            arms = (("cublas", "gemv_pdl", "q8_linear") + Q8_SWEEPS if head
                    else MATRIX_ARMS + (GLU_ARMS if name == "gate_up" else ()))
            for n in [1] if head else args.rows:
                rows += [dict(model=model, matrix=name, **r) for r in bench_matrix(N, K, n, gen, ceil, name == "qkv",
                                                                                    arms=arms)]
                print(rows[-1], flush=True)
            for arm, n in [(a, n) for a, n in SWEEPS if args.sweep is not None and (not args.sweep or a in args.sweep)
                           and (a in Q8_SWEEPS or not head) and (a != "q8x_glu" or name == "gate_up")]:
                swept += [dict(model=model, matrix=name, arm=arm, **r) for r in bench_matrix(
                    N, K, n, gen, ceil, name == "qkv", sweep_configs(arm), arm)]
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
