"""Speculator-chain study figure: decode tok/s, acceptance per speculator and draft time share
vs context, one line per ``spec.type``.

    python -m experiments.plot_spec results/<study>

Reads the study's ``runs.csv`` (rows of ``experiments.draft_threshold``, e.g.
``experiment=spec_h200``: one per spec type x context x rep; ``experiment=mtp_h200_k``: x draft
length too) and writes ``spec_table.csv`` (per spec type, draft length ``spec.n_max``, context and
speculator: mean decode tok/s over reps, its ratio to plain decoding's (spec ``none``) mean at the
same context, drafted and accepted tokens summed over reps, acceptance, draft time share) and
``spec.png`` beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import pandas as pd

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from experiments.common import title  # noqa: E402
from experiments.cost_model import require  # noqa: E402
from experiments.crossover import read_study  # noqa: E402

COLUMNS = ["spec_type", "context", "decode_tok_s", "draft_time_share", "speculators"]


def spec_table(runs: pd.DataFrame, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (spec type, draft length, context, speculator); speculator '-' for a run
    without any. ``vs_none``: the row's tok/s over plain decoding's at its context (every draft
    length's plain runs together: their configs differ only in a knob they do not read). With
    ``steps``: ``round_ms``, the median wall time of the speculator's rounds (a plain run's: of
    its steps), and ``tokens_per_round``, the tokens those rounds kept."""
    require(runs, COLUMNS + ["config"], "runs.csv")
    rows = []
    for r in runs.itertuples():
        stats = json.loads(r.speculators) if isinstance(r.speculators, str) and r.speculators else {}
        n_max = json.loads(r.config)["spec"]["n_max"] if r.spec_type != "none" else 0
        base = dict(spec=r.spec_type, n_max=n_max, context=r.context, decode_tok_s=r.decode_tok_s,
                    draft_time_share=r.draft_time_share)
        for name, s in stats.items() or [("-", {})]:
            rows.append({**base, "speculator": name, "drafts": s.get("drafts", 0),
                         "drafted": s.get("drafted_tokens", 0), "accepted": s.get("accepted_tokens", 0)})
    t = pd.DataFrame(rows).groupby(["spec", "n_max", "context", "speculator"], sort=True).agg(
        decode_tok_s=("decode_tok_s", "mean"), draft_time_share=("draft_time_share", "mean"),
        reps=("decode_tok_s", "count"), drafts=("drafts", "sum"), drafted=("drafted", "sum"),
        accepted=("accepted", "sum")).reset_index()
    t["acceptance"] = t["accepted"] / t["drafted"].where(t["drafted"] > 0)
    if steps is not None:
        cells = runs[["run_id", "spec_type", "context"]].rename(columns={"spec_type": "spec"})
        cells["n_max"] = [json.loads(c)["spec"]["n_max"] if k != "none" else 0
                          for c, k in zip(runs["config"], runs["spec_type"])]
        st = steps.drop(columns="context").merge(cells, on="run_id")  # (the cell's prompt length, not the step's)
        st["speculator"] = st["speculator"].fillna("-").replace("", "-")
        st = st[(st["speculator"] == "-") | (st["drafted"] > 0)]
        per = st.groupby(["spec", "n_max", "context", "speculator"]).agg(
            round_ms=("step_s", lambda x: 1e3 * x.median()), tokens_per_round=("new_tokens", "mean")).reset_index()
        t = t.merge(per, on=["spec", "n_max", "context", "speculator"], how="left")
    plain = t[t["spec"] == "none"].groupby("context")["decode_tok_s"].mean()
    t["vs_none"] = t["decode_tok_s"] / t["context"].map(plain)
    return t


def plot(study_dir) -> Path:
    study = Path(study_dir)
    runs, steps = read_study(study)
    table = spec_table(runs, steps)
    table.to_csv(study / "spec_table.csv", index=False)
    table = table.copy()
    table["line"] = table["spec"] + table["n_max"].map(lambda n: f", n_max {n}" if n else "")
    if table[table["spec"] != "none"]["n_max"].nunique() <= 1:  # one draft length: name the spec alone
        table["line"] = table["spec"]
    per_spec = table.drop_duplicates(["line", "context"])
    color = {spec: f"C{i}" for i, spec in enumerate(per_spec["line"].unique())}  # one colour per line
    dash = {name: ls for name, ls in zip(table["speculator"].unique(), ("-", "--", ":", "-."))}  # per speculator
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for spec, t in per_spec.groupby("line", sort=False):
        axes[0].plot(t["context"], t["decode_tok_s"], marker="o", color=color[spec], label=spec)
        axes[2].plot(t["context"], t["draft_time_share"], marker="o", color=color[spec], label=spec)
    for (spec, name), t in table[table["speculator"] != "-"].groupby(["line", "speculator"], sort=False):
        axes[1].plot(t["context"], t["acceptance"], marker="o", color=color[spec], ls=dash[name],
                     label=f"{name} in {spec}")
    for ax, ylabel in zip(axes, ("decode tokens/s", "accepted / drafted tokens", "draft time / decode time")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[1].set_ylim(0, 1.05)
    fig.suptitle(title(runs).replace("decode tok/s vs context", "speculation vs context"), fontsize=10)
    fig.tight_layout()
    out = study / "spec.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", help="a results/<study> folder with runs.csv")
    print(f"figure: {plot(ap.parse_args(argv).study)}")


if __name__ == "__main__":
    main()
