"""What if the arena were another size? The keep/eject crossover a study's cost model predicts there.

    python -m experiments.what_if results/<study> --arena-mib 1350 1420 [--out results/<study>]

From one draft-threshold study (``runs.csv`` and ``steps.csv`` of experiments/draft_threshold.py),
no new runs: the step-cost model fitted to its steps (experiments/cost_model.py) does not depend
on the arena; the capacities do. An arena larger by B bytes holds B / P more resident pages per
layer, P being one page of every layer (a streaming step's host -> device bytes per streamed page,
from steps.csv); without the draft its bytes (``draft_mib``) hold that many more again. This holds
for a fixed ring (``cache.ring_pages`` set: an automatic ring re-sizes with the arena) and compute
slabs that do not change with the arena (they depend on the context, as the study measured them).
Only decode layouts are checked (runs.csv records their capacities): a smaller arena may not
hold the prefill phase beside the draft (its slab + ring + one chunk's pages); the run then
stops at once with the numbers, and a smaller ``prefill_chunk`` (decode unchanged) lets it run.
``--out``: each arena's prediction also as ``what_if_<mib>.json`` in that folder: committed before the
arena's study runs, it is what ``experiments/blind_test.py --prediction`` checks the study against.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.cost_model import PAGE, fit_cost_model
from experiments.crossover import _jsonable, capacity_curve, describe, predict, read_study
from kvstream.cache.arena import MIB


def page_bytes(steps: pd.DataFrame) -> float:
    """Bytes of one page of every layer: the median streaming step's host -> device bytes per
    streamed page (a step that also uploads newly resident pages is rare, the median ignores it)."""
    s = steps[steps["streamed_pages"] > 0]
    if s.empty:
        raise ValueError("no step of the study streamed pages: steps.csv cannot say what a page of every layer weighs")
    return float((s["h2d_bytes"] / s["streamed_pages"]).median())


def _one(runs: pd.DataFrame, column: str) -> float:
    values = runs[column].dropna().unique()
    if len(values) != 1:
        raise ValueError(f"runs.csv has {len(values)} values of {column} ({list(values)[:4]}); a what-if needs "
                         f"one study at one arena with one draft")
    return float(values[0])


def _fixed_ring(runs: pd.DataFrame) -> int:
    rings = {json.loads(c)["cache"]["ring_pages"] for c in runs["config"].dropna()}
    if len(rings) != 1 or not str(next(iter(rings))).isdigit():
        raise ValueError(f"cache.ring_pages was {sorted(map(str, rings))} in this study; a what-if arena needs "
                         f"one fixed ring (an automatic ring re-sizes with the arena)")
    return int(next(iter(rings)))


def capacities(runs: pd.DataFrame, steps: pd.DataFrame, arena_mib: float):
    """(with, without) the draft: resident pages per layer as functions of context, in an arena of
    ``arena_mib`` instead of the study's."""
    _fixed_ring(runs)
    pb = page_bytes(steps)
    shift = (arena_mib * MIB - _one(runs, "arena_bytes")) / pb
    draft = _one(runs, "draft_mib") * MIB / pb
    base = capacity_curve(runs, "capacity_with_draft")
    low = float(np.min(base(runs["context"].unique()))) + shift
    if low < 1:
        raise ValueError(f"an arena of {arena_mib:g} MiB holds {low:.1f} pages per layer beside the draft at the "
                         f"study's largest decode slab ({pb / MIB:.2f} MiB a page of every layer): too small")
    return (lambda c: base(c) + shift), (lambda c: base(c) + shift + draft)


def what_if(runs: pd.DataFrame, steps: pd.DataFrame, arena_mib: float, eject: str = "onset") -> dict:
    """The predicted crossover (decodes of the study's length, and long ones) in an arena of ``arena_mib``."""
    model = fit_cost_model(steps, runs)
    caps = capacities(runs, steps, arena_mib)
    grid = np.arange(PAGE, 4 * int(runs["context"].max()) + PAGE, PAGE)
    contexts = sorted(runs["context"].unique())
    return dict(arena_mib=arena_mib, onset_tokens=float(caps[0](min(contexts)) * PAGE),
                capacity_with_draft={int(c): round(float(caps[0](c)), 1) for c in contexts},
                predicted=predict(runs, model, eject, grid, caps=caps)[1],
                predicted_steady=predict(runs, model, eject, grid, steady=True, caps=caps)[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path, help="results/<study> holding runs.csv and steps.csv")
    ap.add_argument("--arena-mib", type=float, nargs="+", required=True)
    ap.add_argument("--eject", default="onset")
    ap.add_argument("--out", type=Path, help="a folder to write each arena's what_if_<mib>.json in")
    args = ap.parse_args(argv)
    runs, steps = read_study(args.study)
    if steps is None:
        raise SystemExit(f"no steps.csv in {args.study}: nothing to fit the cost model to")
    print(f"{args.study}: arena {_one(runs, 'arena_bytes') / MIB:g} MiB measured")
    for mib in args.arena_mib:
        r = what_if(runs, steps, mib, args.eject)
        print(f"arena {mib:g} MiB: pages per layer beside the draft {r['capacity_with_draft']}")
        print(f"  predicted crossover, {int(runs['new_tokens'].median())}-token decodes: {describe(r['predicted'])}")
        print(f"  predicted crossover, long decodes: {describe(r['predicted_steady'])}")
        if args.out:
            out = args.out / f"what_if_{mib:g}.json"
            out.write_text(json.dumps(_jsonable(dict(study=str(args.study), eject=args.eject) | r), indent=2) + "\n")
            print(f"  wrote {out}")
    if min(args.arena_mib) < _one(runs, "arena_bytes") / MIB:
        print("note: the prefill phase is not checked (runs.csv records decode capacities only); if a smaller arena "
              "cannot prefill beside the draft, give the run a smaller prefill_chunk (decode is unchanged)")


if __name__ == "__main__":
    main()
