"""Figure of an MTP head's measurements: held-out agreement over training, acceptance by draft position.

    python -m experiments.plot_mtp results/mtp

Reads every ``curve*.csv`` (experiments/train_mtp.py's training curves: ``curve_<head>.csv`` for
several heads) and every ``acceptance_*.csv`` (experiments/mtp_acceptance.py) in the folder; writes
``mtp.png`` beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def plot(folder: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ["-", "--", ":", "-."]  # one per head (file), colours per step or prompt
    for i, path in enumerate(sorted(folder.glob("curve*.csv"))):
        curve, head = pd.read_csv(path), path.stem.partition("_")[2]
        steps = sorted(int(c.split("_")[1]) for c in curve.columns if c.startswith("agree_"))
        for s in steps:
            a.plot(curve["tokens_seen"] / 1e6, curve[f"agree_{s}"], marker=".", ls=styles[i % 4], color=f"C{s - 1}",
                   label=f"{head + ': ' if head else ''}draft step {s}")
    a.set(xlabel="training tokens (millions)", ylabel="held-out top-1 agreement with the target",
          title="training (teacher-forced, held-out files)")
    a.legend()
    for i, f in enumerate(sorted(folder.glob("acceptance_*.csv"))):
        t = pd.read_csv(f)
        cols = sorted((c for c in t.columns if c.startswith("accept_")), key=lambda c: int(c.split("_")[1]))
        pos = [int(c.split("_")[1]) for c in cols]
        for r, (_, row) in enumerate(t.iterrows()):
            b.plot(pos, [row[c] for c in cols], marker="o", alpha=0.8, ls=styles[i % 4], color=f"C{r}",
                   label=f"{row['prompt']} ({f.stem.split('_', 1)[1]}): {row['tokens_per_round']:.2f} tok/round")
    b.set(xlabel="draft position j", ylabel="share of rounds with drafts 1..j accepted", xticks=pos,
          title="greedy decoding, one run per prompt (no error bars)")
    b.legend(fontsize=7)
    fig.tight_layout()
    out = folder / "mtp.png"
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    print(plot(ap.parse_args(argv).folder))


if __name__ == "__main__":
    main()
