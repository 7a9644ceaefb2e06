"""Where an arm's target step goes as the context grows: streamed pages, copy rounds and the
host-to-device rate the step reaches, from a draft-threshold study's per-step records.

    python -m experiments.step_profile results/<study> [results/<study> ...] [--arm keep] [--every 8]

Reads each study's ``runs.csv`` and steps (``crossover.read_study``) and prints, per pages per layer
(every ``--every``-th), the medians over the arm's steady steps (no plan change, the widest verify
batch: a drafting round's target part, or a plain step where the arm drafts nothing) of the target's
seconds, the streamed pages per layer, the copy rounds and the bytes copied to the device, with
the rate those bytes reach (``h2d_GBps``: bytes / target seconds; a copy-bound step's rate is the
link's) and the target's microseconds per streamed page. Writes ``step_profile.csv`` in the last
study's folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments.cost_model import require
from experiments.crossover import read_study

COLUMNS = ("run_id", "target_s", "streamed_pages", "rounds", "h2d_bytes", "pages_per_layer", "verify_width",
           "plan_change")


def profile(studies, arm: str = "keep", every: int = 1) -> pd.DataFrame:
    """One row per pages_per_layer of ``arm``'s steady steps over ``studies``."""
    parts = []
    for study in studies:
        runs, steps = read_study(Path(study))
        if steps is None:
            raise ValueError(f"{study} has no steps (steps.csv or steps/)")
        require(steps, COLUMNS, f"{study}'s steps")
        ids = set(runs.loc[runs["arm"] == arm, "run_id"])
        if not ids:
            raise ValueError(f"{study} has no runs of arm {arm!r}; it has {sorted(runs['arm'].unique())}")
        s = steps[steps["run_id"].isin(ids) & steps["plan_change"].isna()]
        parts.append(s[s["verify_width"] == s["verify_width"].max()])
    s = pd.concat(parts, ignore_index=True)
    t = s.groupby("pages_per_layer").agg(steps=("target_s", "size"), target_ms=("target_s", "median"),
                                         streamed=("streamed_pages", "median"), rounds=("rounds", "median"),
                                         h2d_mb=("h2d_bytes", "median")).reset_index()
    t["target_ms"] *= 1e3
    t["h2d_mb"] /= 1e6
    t["h2d_GBps"] = t["h2d_mb"] / t["target_ms"]
    t["us_per_streamed_page"] = (1e3 * t["target_ms"] / t["streamed"]).where(t["streamed"] > 0)
    return t[t["pages_per_layer"] % every == 0].reset_index(drop=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", type=Path, nargs="+", help="results/<study> folders (runs.csv and steps)")
    ap.add_argument("--arm", default="keep")
    ap.add_argument("--every", type=int, default=1, help="print every n-th pages_per_layer")
    args = ap.parse_args(argv)
    try:
        table = profile(args.studies, args.arm, args.every)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"step_profile: {e}") from None
    out = args.studies[-1] / "step_profile.csv"
    table.to_csv(out, index=False, float_format="%.6g")
    print(f"{args.arm}'s steady target steps ({', '.join(map(str, args.studies))})")
    print(table.to_string(index=False, float_format="%.3f"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
