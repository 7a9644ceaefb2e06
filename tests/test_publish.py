"""experiments/publish.py: sweep parts gathered into a published study (rows appended, steps gzipped and
rounded to 1 us, refused when a cell would count twice or the columns differ), read back by the analyses."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments import publish
from experiments.crossover import read_study

COLUMNS = ["run_id", "study", "arm", "policy", "keep_pages", "spec_type", "context", "rep", "decode_tok_s"]


def part(root, name, run_ids, columns=COLUMNS):
    """A sweep folder as experiments/draft_threshold.py writes it: runs.csv, steps/<run_id>.csv, multirun.yaml."""
    d = root / name
    (d / "steps").mkdir(parents=True)
    rows = pd.DataFrame([{c: (r if c == "run_id" else 1) for c in columns} for r in run_ids])
    rows.to_csv(d / "runs.csv", index=False)
    for i, r in enumerate(run_ids):
        pd.DataFrame({"run_id": [r, r], "step": [0, 1], "step_s": [0.0071234567, 0.0070000004 + i],
                      "plan_change": ["", "capture"]}).to_csv(d / "steps" / f"{r}.csv", index=False)
    (d / "multirun.yaml").write_text(f"part: {name}\n")
    return d


def test_parts_are_appended_with_their_steps_rounded_and_gzipped(tmp_path):
    a, b = part(tmp_path, "a", ["0a", "1a"]), part(tmp_path, "b", ["2b"])
    to = tmp_path / "results" / "s"
    assert publish.publish([a], to) == 2 and publish.publish([b], to) == 1
    runs, steps = read_study(to)
    assert runs["run_id"].tolist() == ["0a", "1a", "2b"]
    assert sorted(p.name for p in (to / "steps").iterdir()) == ["0a.csv.gz", "1a.csv.gz", "2b.csv.gz"]
    assert steps["step_s"].tolist() == [0.007123, 0.007, 0.007123, 1.007, 0.007123, 0.007]  # 1 us
    assert steps["plan_change"].fillna("").tolist() == ["", "capture"] * 3
    assert (to / "multirun.yaml").read_text() == "part: a\n"  # the first part's


def test_the_same_rows_give_the_same_bytes(tmp_path):
    """gzip without a timestamp: publishing a study again changes no file git sees."""
    a = part(tmp_path, "a", ["0a"])
    publish.publish([a], tmp_path / "x")
    publish.publish([a], tmp_path / "y")
    assert (tmp_path / "x/steps/0a.csv.gz").read_bytes() == (tmp_path / "y/steps/0a.csv.gz").read_bytes()


def test_a_cell_published_twice_is_refused_and_nothing_is_written(tmp_path):
    a = part(tmp_path, "a", ["0a", "1a"])
    to = tmp_path / "s"
    publish.publish([a], to)
    before = (to / "runs.csv").read_bytes()
    with pytest.raises(ValueError, match=r"run ids published twice \(2: \['0a', '1a'\]\)"):
        publish.publish([a], to)
    assert (to / "runs.csv").read_bytes() == before


def test_other_columns_or_missing_steps_are_refused(tmp_path):
    a = part(tmp_path, "a", ["0a"])
    b = part(tmp_path, "b", ["1b"], columns=COLUMNS + ["extra"])
    with pytest.raises(ValueError, match=r"b: runs.csv's columns differ .*\['extra'\]"):
        publish.publish([a, b], tmp_path / "s")
    assert not (tmp_path / "s").exists()
    (a / "steps" / "0a.csv").unlink()
    with pytest.raises(ValueError, match=r"1 of 1 rows have no steps"):
        publish.publish([a], tmp_path / "s")


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"^publish: no runs.csv in .*nowhere"):
        publish.main([str(tmp_path / "nowhere"), "--to", str(tmp_path / "s")])
    publish.main([str(part(tmp_path, "a", ["0a"])), "--to", str(tmp_path / "s")])  # rows too few to analyse
    out = capsys.readouterr().out
    assert "published 1 rows into" in out and "analysis of" in out and "incomplete" in out
