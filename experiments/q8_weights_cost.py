"""What ``model.weights=q8_0`` costs in quality: PPL and KLD of the q8_0-weight model against the
dense one (the file's values in ``hardware.dtype``), on a real model and the built-in text.

    python experiments/q8_weights_cost.py --model qwen2.5-coder-0.5b --ctx 512 --n-chunks 8

Two ``kvstream-ppl`` runs on the contiguous cache: dense weights (its log-probs saved exactly,
float32) and q8_0 weights compared against them. Writes ``<out>/quality.csv``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

from experiments.common import git_state, kld_summary, run_ppl


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--n-chunks", type=int, default=8)
    ap.add_argument("--hardware", default="cpu", help="conf/hardware: cpu (fp32) or h200 (bf16)")
    ap.add_argument("--out", default="results/kernels/q8_linear")
    args = ap.parse_args(argv)
    common = [f"model={args.model}", f"hardware={args.hardware}", f"ctx={args.ctx}", f"n_chunks={args.n_chunks}"]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base.lp"
        dense = run_ppl(common + [f"save_logits={base}", "logits_format=float32"])
        q8 = run_ppl(common + ["model.weights=q8_0", f"compare_logits={base}"])
    commit, dirty = git_state()
    row = dict(model=args.model, hardware=args.hardware, ctx=args.ctx, n_chunks=args.n_chunks, ppl_dense=dense["ppl"],
               ppl_q8_0=q8["ppl"], **kld_summary(q8["kld"]), commit=commit,
               dirty=dirty, command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([row]).to_csv(out / "quality.csv", index=False)
    print(pd.DataFrame([row]).drop(columns=["command"]).T.to_string(header=False))


if __name__ == "__main__":
    main()
