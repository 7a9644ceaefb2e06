"""Draft-threshold curves: decode tok/s vs context per arm, with the onset and the keep/eject crossover.

    python -m experiments.plot_draft_thresholds results/<study> [--with results/<other>] [--keep keep] [--eject onset]

Reads the study's ``runs.csv`` (and ``steps.csv`` for the predicted crossover) and writes
``draft_thresholds.png`` beside them: one line per arm (mean over its n reps, n in the legend; error
bars: the 95% t-interval of the mean where n > 1), the x axis ticked at the measured contexts, a dashed
line at the streaming onset (``crossover.eject_threshold``), a dotted one at the measured crossover,
a dash-dotted one at the cost model's prediction for the study's decode length and a grey one at
its prediction for long decodes (see experiments/crossover.py), and the cost model's tok/s of the
keep and eject arms over the measured range as thin lines in their arms' colours (how well the
model fitted to the steps follows the decodes the arms measured). ``--with`` draws other studies' runs
(and fits on their steps) beside the study's, as one study: a blind test beside the study whose
prediction it tests. Where the study holds a ``blind_test.json`` (experiments/blind_test.py), its
prediction is drawn too, in red, said blind only where git found it in the tree the test ran.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402
from scipy import stats  # noqa: E402

from experiments.common import title  # noqa: E402
from experiments.cost_model import CostModel  # noqa: E402
from experiments.crossover import PAGE, analyze, arm_order, decode_table, eject_threshold, predict, read_study  # noqa: E402


def plot(study_dir, keep: str = "keep", eject: str = "onset", others=()) -> Path:
    study = Path(study_dir)
    runs, steps = read_study(study)
    for other in others:
        r, s = read_study(Path(other))
        runs = pd.concat([r, runs], ignore_index=True)
        steps = None if steps is None or s is None else pd.concat([s, steps], ignore_index=True)
    table = decode_table(runs)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors, bars = {}, []
    order = arm_order(runs)
    for i, arm in enumerate(order):
        t = table[table["arm"] == arm]
        x = t["context"] * 1.015 ** (i - (len(order) - 1) / 2)  # arms side by side, so that no interval hides another
        n = t["n"].min() if t["n"].nunique() == 1 else f"{t['n'].min()}-{t['n'].max()}"
        line, = ax.plot(x, t["mean"], marker="o", ms=4, label=f"{arm} (n={n})")
        colors[arm] = line.get_color()
        several = t[t["n"] > 1]  # one rep: a point, no interval
        if len(several):
            half = stats.t.ppf(0.975, several["n"] - 1) * several["std"] / np.sqrt(several["n"])
            ax.errorbar(x[several.index], several["mean"], yerr=half, fmt="none", ecolor=colors[arm], capsize=3,
                        alpha=0.6)
            bars += list(several["mean"] + half) + list(several["mean"] - half)
    onset = eject_threshold(runs, "onset")
    if onset > 0:
        ax.axvline(onset, color="grey", ls="--", label=f"onset {onset:.0f} tokens")
    try:
        result = analyze(runs, steps, keep, eject, n_boot=1000, seed=0)
    except ValueError as e:  # no keep/eject pair: the curves alone are still worth a figure
        print(f"no crossover lines: {e}")
        result = dict(measured={}, predicted={})
    if result.get("cost_model") and keep in colors and eject in colors:
        ctx = np.geomspace(runs["context"].min(), runs["context"].max(), 80)
        curves, _ = predict(runs, CostModel(**result["cost_model"]), eject, ctx)
        for arm, column in ((keep, "keep_tok_s"), (eject, "eject_tok_s")):
            ax.plot(curves["context"], curves[column], lw=0.8, alpha=0.7, color=colors[arm], label=f"{arm}, cost model")
    lines = (("measured", ":", "black", "measured"), ("predicted", "-.", "black", "predicted"),
             ("predicted_steady", "-.", "grey", "predicted, long decodes"))
    for side, ls, color, name in lines:
        x = (result.get(side) or {}).get("context_tokens")
        if x is not None and x <= 1.5 * runs["context"].max():  # one far out would squash the curves
            ax.axvline(x, color=color, ls=ls, label=f"{name} crossover {x:.0f} tokens ({x / PAGE:.1f} pages)")
    blind = json.loads((study / "blind_test.json").read_text())["predicted"] if (study / "blind_test.json").is_file() \
        else {}
    if blind.get("context_tokens") is not None:
        x, how = blind["context_tokens"], "before this study ran" if blind.get("blind") else "not checked blind"
        ax.axvline(x, color="tab:red", ls="-.", label=f"prediction {x:.0f} tokens ({how}; blind_test.json)")
    ax.set_xscale("log", base=2)
    contexts = sorted(runs["context"].unique())
    top = ax.secondary_xaxis("top", functions=(lambda x: x / PAGE, lambda p: p * PAGE))
    top.set_xlabel("pages per layer")
    for axis, scale, fmt in ((ax.xaxis, 1, ".0f"), (top.xaxis, PAGE, ".4g")):  # ticks at the measured contexts
        axis.set_major_locator(FixedLocator([c / scale for c in contexts]))  # (not powers of two), in full
        axis.set_major_formatter(FuncFormatter(lambda v, _, fmt=fmt: f"{v:{fmt}}"))
        axis.set_minor_locator(NullLocator())
    high = 1.15 * runs["decode_tok_s"].max()  # a few reps give wide intervals: the axes follow the measurements
    ax.set_ylim(0, high)
    clipped = " (clipped to the axes)" if any(not 0 <= b <= high for b in bars) else ""
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(textwrap.fill(title(runs), 110, break_long_words=False, replace_whitespace=False), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, title_fontsize=8,
              title=f"error bars: 95% t-interval of the mean over n reps{clipped}" if bars else "one rep per point")
    fig.tight_layout()
    out = study / "draft_thresholds.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="results/<study> holding runs.csv (and steps.csv)")
    ap.add_argument("--with", dest="others", type=Path, action="append", default=[],
                    help="another study to draw beside it (repeatable)")
    ap.add_argument("--keep", default="keep")
    ap.add_argument("--eject", default="onset")
    args = ap.parse_args(argv)
    print(f"wrote {plot(args.study, args.keep, args.eject, args.others)}")


if __name__ == "__main__":
    main()
