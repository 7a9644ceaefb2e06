"""A crossover prediction checked against a study run after it (experiments/blind_test.py), the
step profile of an arm (experiments/step_profile.py) and the plot of two studies as one; synthetic
studies with known answers (tests/test_crossover.py's), CPU, no model."""

from __future__ import annotations

import json
import shutil
import subprocess

import pandas as pd
import pytest

from experiments import blind_test, step_profile
from experiments.crossover import PAGE, PREDICTION_GOAL
from experiments.crossover import main as crossover_main
from experiments.plot_draft_thresholds import plot
from tests.test_crossover import make_runs, make_steps, write_study

SPLIT = 20 * PAGE  # the synthetic crossover (20 pages): the predicting study ends below it, the test starts above


def studies(tmp_path, test_config=None):
    """The predicting study (contexts up to 18 pages, its crossover.json written) and the test study
    (26 and 32 pages), as two folders; each row's config records its context and rep, and the test's
    rows ``test_config`` besides."""
    runs = make_runs(arms=("keep", "onset"))
    runs["config"] = [json.dumps(dict(context=int(c), rep=int(r), prefill_chunk=512, arena={"mib": 512}))
                      for c, r in zip(runs["context"], runs["rep"])]
    a = write_study(tmp_path / "a", runs[runs["context"] < SPLIT], make_steps())
    test = runs[runs["context"] > SPLIT].copy()
    if test_config:
        test["config"] = [json.dumps(json.loads(c) | test_config) for c in test["config"]]
    b = write_study(tmp_path / "b", test)
    crossover_main([str(a)])
    return a, b


@pytest.fixture
def ab(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    return studies(tmp_path, {"prefill_chunk": 256})


def test_the_measurement_spans_both_studies_and_the_prediction_is_the_earlier_ones(ab):
    a, b = ab
    predicted = json.loads((a / "crossover.json").read_text())["predicted"]["context_tokens"]
    # a alone sees keep win everywhere: only both studies bracket the crossover
    assert json.loads((a / "crossover.json").read_text())["measured"]["winner"] == "keep"
    r = blind_test.blind_test(a, b)
    # keep - onset = 40 - 2 * pages at 18 and 26 pages: 4 and -12, linear between them: 20 pages exactly
    assert r["measured"]["context_tokens"] == pytest.approx(SPLIT)
    assert r["measured"]["bracket_tokens"] == [18 * PAGE, 26 * PAGE]
    assert r["predicted"]["context_tokens"] == predicted
    assert r["relative_error"] == pytest.approx(abs(predicted - SPLIT) / SPLIT)
    assert r["within_goal"] == (r["relative_error"] <= PREDICTION_GOAL)
    lo, mid, hi = r["measured"]["ci_tokens"]
    assert lo <= SPLIT <= hi
    assert r["relative_error_at_ci"] == pytest.approx([abs(predicted - x) / x for x in (lo, mid, hi)])


def test_the_arms_at_the_tests_contexts_as_predicted_and_measured(ab):
    a, b = ab
    arms = pd.DataFrame(blind_test.blind_test(a, b)["arms_at_test_contexts"])
    assert arms["context"].tolist() == [26 * PAGE, 32 * PAGE]
    # the measured means are the test's (keep = 100 - 2 * pages, onset 60 above the onset; reps' offsets cancel)
    assert arms["keep_measured"].tolist() == pytest.approx([48.0, 36.0], abs=1e-9)
    assert arms["eject_measured"].tolist() == pytest.approx([60.0, 60.0], abs=1e-9)
    ratio = arms["keep_predicted"] / arms["keep_measured"]
    assert arms["keep_predicted_over_measured"].tolist() == pytest.approx(ratio.tolist())
    assert arms[["keep_predicted", "eject_predicted"]].gt(0).all().all()


def test_config_differences_leave_out_what_varies_per_cell(ab):
    a, b = ab
    assert blind_test.blind_test(a, b)["config_differences"] == {"prefill_chunk": [["512"], ["256"]]}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_prediction_is_the_one_the_tests_commit_held(tmp_path, monkeypatch):
    """In a throwaway git repository: a commit before the prediction, the one that holds it, a later
    one where it changed, and one git does not know. The test's rows ran the holding commit; the
    folder's crossover.json is since refitted: the blind prediction is still the held one, the refit
    is reported beside."""
    monkeypatch.chdir(tmp_path)
    git = lambda *args: subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@t"), git("config", "user.name", "t")
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a, b = (p.relative_to(tmp_path) for p in studies(tmp_path))
    git("add", "b"), git("commit", "-qm", "the test's setup, before any prediction")
    before = git("rev-parse", "HEAD")
    git("add", "a"), git("commit", "-qm", "prediction")
    held = git("rev-parse", "HEAD")
    out = json.loads((a / "crossover.json").read_text())
    p = out["predicted"]["context_tokens"]
    out["predicted"]["context_tokens"] = p + 1000
    (a / "crossover.json").write_text(json.dumps(out))
    git("commit", "-qam", "a refit")
    changed, unknown = git("rev-parse", "HEAD"), "0" * 40
    file = a / "crossover.json"
    assert blind_test.prediction_in_tree(file, before) == "not in its tree"
    assert blind_test.prediction_in_tree(file, held) == p
    assert blind_test.prediction_in_tree(tmp_path / file, held) == p  # an absolute path names the same file
    assert blind_test.prediction_in_tree(file, changed) == p + 1000
    assert blind_test.prediction_in_tree(file, unknown).startswith("unknown")
    assert blind_test.blind_prediction(file, [held, held])[0] == p
    for commits in ([held, changed], [held, unknown], [before]):  # not one prediction every commit held
        assert blind_test.blind_prediction(file, commits)[0] is None
    runs = pd.read_csv(b / "runs.csv")
    runs.assign(git_commit=held).to_csv(b / "runs.csv", index=False)
    r = blind_test.blind_test(a, b)
    assert r["predicted"]["context_tokens"] == p and r["predicted"]["blind"]
    assert r["current_prediction"]["context_tokens"] == p + 1000
    assert r["current_prediction"]["relative_error"] == pytest.approx(abs(p + 1000 - SPLIT) / SPLIT)
    runs.assign(git_commit=unknown).to_csv(b / "runs.csv", index=False)
    r = blind_test.blind_test(a, b)  # nothing to check it against: the folder's own, not blind
    assert r["predicted"]["context_tokens"] == p + 1000 and not r["predicted"]["blind"]


def test_cli_writes_its_json_and_bad_input_is_one_line(ab, capsys, tmp_path):
    a, b = ab
    blind_test.main([str(a), str(b)])
    assert json.loads((b / "blind_test.json").read_text())["measured"]["context_tokens"] == pytest.approx(SPLIT)
    assert "relative error" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"^blind_test: .* has no steps"):
        blind_test.main([str(b), str(a)])  # b has no steps to fit a model on
    (a / "crossover.json").unlink()
    with pytest.raises(SystemExit, match=r"^blind_test: .*crossover\.json"):
        blind_test.main([str(a), str(b)])
    with pytest.raises(SystemExit, match=r"^blind_test: no runs\.csv in"):
        blind_test.main([str(a), str(tmp_path / "missing")])


def test_plot_draws_two_studies_as_one_with_the_blind_prediction(ab):
    a, b = ab
    blind_test.main([str(a), str(b)])
    png = plot(b, others=[a])
    assert png == b / "draft_thresholds.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_profile_gives_the_rate_of_the_steady_steps(tmp_path):
    """keep's steps copy 3 MB per streamed page in 0.1 ms a page (30 GB/s); transition steps, plan
    changes and narrower steps are left out, as is another arm's."""
    runs = pd.DataFrame(dict(run_id=["k", "o"], policy=["never", "onset"], keep_pages=[None, None],
                             spec_type=["draft", "draft"], arm=["keep", "onset"], context=[PAGE, PAGE],
                             rep=[0, 0], decode_tok_s=[1.0, 1.0]))
    rows = []
    for p, streamed in ((40, 10), (41, 11), (80, 50)):
        for run_id, width, plan, t in (("k", 5, None, 1e-4), ("k", 5, "update", 1.0), ("k", 1, None, 1.0),
                                       ("o", 5, None, 1.0)):
            rows.append(dict(run_id=run_id, target_s=t * streamed, streamed_pages=streamed, rounds=1 + streamed // 32,
                             h2d_bytes=3e6 * streamed, pages_per_layer=p, verify_width=width, plan_change=plan))
    write_study(tmp_path, runs, pd.DataFrame(rows))
    t = step_profile.profile([tmp_path])
    assert t["pages_per_layer"].tolist() == [40, 41, 80] and t["steps"].tolist() == [1, 1, 1]
    assert t["h2d_GBps"].tolist() == pytest.approx([30.0] * 3)
    assert t["us_per_streamed_page"].tolist() == pytest.approx([100.0] * 3)
    assert t["rounds"].tolist() == [1, 1, 2]
    assert step_profile.profile([tmp_path], every=40)["pages_per_layer"].tolist() == [40, 80]
    with pytest.raises(SystemExit, match="^step_profile: .* has no runs of arm 'auto'"):
        step_profile.main([str(tmp_path), "--arm", "auto"])


def test_a_what_if_prediction_is_measured_on_the_tests_own_runs(tmp_path):
    """A prediction for another arena (what_if --out) is checked against the test's runs alone: the
    predicting study ran another arena, so its cells do not locate that crossover; the model's arms at
    the test's contexts take what_if's capacities there."""
    from experiments import what_if
    from tests.test_what_if import ARENA, MIB, study as what_if_study

    runs, steps = what_if_study()
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = write_study(tmp_path / "a", runs, steps)
    what_if.main([str(a), "--arena-mib", str(ARENA / MIB + 15), "--out", str(a)])
    file = a / f"what_if_{ARENA / MIB + 15:g}.json"
    assert json.loads(file.read_text())["arena_mib"] == ARENA / MIB + 15
    # the test's keep falls faster (3 tok/s a page): keep - onset = 40 - 3 * pages, 4 at 12 pages and -14 at 18
    b = write_study(tmp_path / "b", make_runs(arms=("keep", "onset"), keep_slope=3.0))
    r = blind_test.blind_test(a, b, prediction=file)
    assert r["measured"]["context_tokens"] == pytest.approx((12 + 4 / 18 * 6) * PAGE)
    assert r["predicted"]["context_tokens"] == json.loads(file.read_text())["predicted"]["context_tokens"]
    assert not r["predicted"]["blind"]  # the rows' commit ("abc") is not one git knows here
    there = pd.DataFrame(r["arms_at_test_contexts"]).set_index("context")
    here = blind_test.arms_at_test(runs, steps, pd.read_csv(b / "runs.csv"), "keep", "onset").set_index("context")
    small = there.index <= 8 * PAGE  # nothing streams there in either arena: the same keep
    assert there.loc[small, "keep_predicted"].tolist() == pytest.approx(here.loc[small, "keep_predicted"].tolist())
    # 12 pages: 2 stream beside the draft in the study's arena, none in one 5 pages larger
    assert there.loc[12 * PAGE, "keep_predicted"] > here.loc[12 * PAGE, "keep_predicted"]
