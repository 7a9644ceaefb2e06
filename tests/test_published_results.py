"""Every published crossover.json is what the current analysis computes from its folder's CSVs: a
change to the cost model or the crossover analysis re-derives them (``python -m experiments.crossover
results/<study>``) and the READMEs' numbers in the same commit, or this fails. (A blind prediction
stays in the tree of the commit its test ran: experiments/blind_test.py reads it there.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.crossover import _jsonable, analyze, read_study

RESULTS = Path(__file__).parents[1] / "results"
STUDIES = sorted(p.parent for p in RESULTS.glob("*/crossover.json"))


def close(a, b, path=""):
    """Paths where a and b differ: floats beyond 1e-9 relative (summation order of pandas' means),
    anything else exactly."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in close(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in close(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if a == pytest.approx(b, rel=1e-9, abs=1e-15) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_there_are_published_studies():
    assert len(STUDIES) >= 10


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_a_published_crossover_is_the_current_analysis_of_its_csvs(study):
    runs, steps = read_study(study)
    published = json.loads((study / "crossover.json").read_text())
    now = json.loads(json.dumps(_jsonable(analyze(runs, steps))))  # as the file holds it: tuples as lists
    diffs = close(published, now)
    assert not diffs, f"{study.name}: re-derive it (python -m experiments.crossover {study}): {diffs[:5]}"
