"""Speculator-chain study figure: decode tok/s, acceptance per speculator and draft time share
vs context, one line per ``spec.type``.

    python -m experiments.plot_spec results/<study>

Reads the study's ``runs.csv`` (rows of ``experiments.draft_threshold``, e.g.
``experiment=spec_h200``: one per spec type x context x rep) and writes ``spec_table.csv``
(per spec type, context and speculator: mean decode tok/s over reps, drafted and accepted
tokens summed over reps, acceptance, draft time share) and ``spec.png`` beside it.
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


def spec_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (spec type, context, speculator); speculator '-' for a run without any."""
    require(runs, COLUMNS, "runs.csv")
    rows = []
    for r in runs.itertuples():
        stats = json.loads(r.speculators) if isinstance(r.speculators, str) and r.speculators else {}
        base = dict(spec=r.spec_type, context=r.context, decode_tok_s=r.decode_tok_s,
                    draft_time_share=r.draft_time_share)
        for name, s in stats.items() or [("-", {})]:
            rows.append({**base, "speculator": name, "drafts": s.get("drafts", 0),
                         "drafted": s.get("drafted_tokens", 0), "accepted": s.get("accepted_tokens", 0)})
    t = pd.DataFrame(rows).groupby(["spec", "context", "speculator"], sort=True).agg(
        decode_tok_s=("decode_tok_s", "mean"), draft_time_share=("draft_time_share", "mean"),
        reps=("decode_tok_s", "count"), drafts=("drafts", "sum"), drafted=("drafted", "sum"),
        accepted=("accepted", "sum")).reset_index()
    t["acceptance"] = t["accepted"] / t["drafted"].where(t["drafted"] > 0)
    return t


def plot(study_dir) -> Path:
    study = Path(study_dir)
    runs, _ = read_study(study)
    table = spec_table(runs)
    table.to_csv(study / "spec_table.csv", index=False)
    per_spec = table.drop_duplicates(["spec", "context"])
    color = {spec: f"C{i}" for i, spec in enumerate(per_spec["spec"].unique())}  # one colour per spec type
    dash = {name: ls for name, ls in zip(table["speculator"].unique(), ("-", "--", ":", "-."))}  # per speculator
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    for spec, t in per_spec.groupby("spec", sort=False):
        axes[0].plot(t["context"], t["decode_tok_s"], marker="o", color=color[spec], label=spec)
        axes[2].plot(t["context"], t["draft_time_share"], marker="o", color=color[spec], label=spec)
    for (spec, name), t in table[table["speculator"] != "-"].groupby(["spec", "speculator"], sort=False):
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
