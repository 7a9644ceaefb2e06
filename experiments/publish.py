"""Gather draft-threshold sweep folders (``runs/<study>-<stamp>/``) into a published ``results/<study>/``.

    python -m experiments.publish runs/<study>-<stamp> [runs/<study>-<stamp2> ...] --to results/<study>

A sweep run in parts (one process per rep, a cut run and its rest, several leases) writes one
folder per part. This appends each part's ``runs.csv`` rows to the published one (the same
columns; a run id already there is refused: a cell published twice would count as two reps),
writes each row's steps as ``steps/<run_id>.csv.gz`` (seconds rounded to 1 us, far below the
0.01-1 ms terms the cost model fits; gzipped, since per-step records are ~90% of a study's bytes
and the published folders travel with the working tree to the GPU machine), keeps the first part's ``multirun.yaml``
(the parts differ in their overrides only), then re-runs the study's analysis
(``experiments.crossover``). Nothing is written unless every part reads cleanly.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pandas as pd

from experiments import crossover
from experiments.crossover import step_files

SECONDS_DECIMALS = 6  # steps' ``*_s`` columns: 1 us


def write_steps(steps: pd.DataFrame, path: Path) -> None:
    """One cell's steps, seconds rounded to 1 us; gzipped without a timestamp, so the same rows
    give the same bytes."""
    s = steps.copy()
    for c in s.columns:
        if c.endswith("_s") and pd.api.types.is_float_dtype(s[c]):
            s[c] = s[c].round(SECONDS_DECIMALS)
    s.to_csv(path, index=False, compression={"method": "gzip", "mtime": 0})


def read_part(part: Path) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """A sweep folder's rows and, per run id, its steps (every row must have them)."""
    part = Path(part)
    if not (part / "runs.csv").is_file():
        raise FileNotFoundError(f"no runs.csv in {part}: pass a folder experiments/draft_threshold.py wrote")
    rows = pd.read_csv(part / "runs.csv", dtype={"run_id": str}, keep_default_na=False)
    files = {f.name.split(".")[0]: f for f in step_files(part)}
    missing = sorted(set(rows["run_id"]) - set(files))
    if missing:
        raise ValueError(f"{part}: {len(missing)} of {len(rows)} rows have no steps/<run_id>.csv ({missing[:3]})")
    return rows, {r: pd.read_csv(files[r], dtype={"run_id": str}) for r in rows["run_id"]}


def publish(parts: list[Path], to: Path) -> int:
    """Append ``parts`` to the published study ``to``; returns the rows added."""
    to = Path(to)
    old = pd.read_csv(to / "runs.csv", dtype={"run_id": str}, keep_default_na=False) \
        if (to / "runs.csv").is_file() else None
    read = [read_part(p) for p in parts]
    new = pd.concat([rows for rows, _ in read], ignore_index=True)
    columns = list(read[0][0].columns) if old is None else list(old.columns)
    for p, (rows, _) in zip(parts, read):
        if list(rows.columns) != columns:
            diff = sorted(set(rows.columns) ^ set(columns))
            ref = to / "runs.csv" if old is not None else parts[0]
            raise ValueError(f"{p}: runs.csv's columns differ from {ref}'s ({diff})")
    seen = pd.concat([old["run_id"], new["run_id"]]) if old is not None else new["run_id"]
    dup = sorted(set(seen[seen.duplicated()]))
    if dup:
        raise ValueError(f"run ids published twice ({len(dup)}: {dup[:3]}): a cell would count as two reps")
    (to / "steps").mkdir(parents=True, exist_ok=True)
    for _, steps in read:
        for run_id, s in steps.items():
            write_steps(s, to / "steps" / f"{run_id}.csv.gz")
    (new if old is None else pd.concat([old, new], ignore_index=True)).to_csv(to / "runs.csv", index=False)
    if not (to / "multirun.yaml").exists() and (Path(parts[0]) / "multirun.yaml").is_file():
        shutil.copyfile(Path(parts[0]) / "multirun.yaml", to / "multirun.yaml")
    return len(new)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", type=Path, help="sweep folders runs/<study>-<stamp>")
    ap.add_argument("--to", type=Path, required=True, help="the published folder results/<study>")
    args = ap.parse_args(argv)
    try:
        n = publish(args.parts, args.to)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"publish: {e}") from None
    print(f"published {n} rows into {args.to}")
    try:
        crossover.write(args.to)
    except (FileNotFoundError, ValueError) as e:  # e.g. only some arms published so far
        print(f"analysis of {args.to} incomplete: {e}")


if __name__ == "__main__":
    main()
