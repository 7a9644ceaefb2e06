"""Crossover analysis, step-cost model and draft-threshold plot on synthetic studies with known answers
(CPU, no model).

runs: keep = 100 - 2*pages tok/s; onset = keep up to the onset (10 pages), 60 flat above it; so
keep - onset = 40 - 2*pages and the crossover is at 20 pages = 5120 tokens. steps: noiseless step
times from known cost coefficients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from experiments.common import title
from experiments.cost_model import (CostModel, acceptance_per_token, after_transition, eject_cost, eject_seconds,
                                    fit_cost_model, page_cost, page_costs, round_pages)
from experiments.crossover import (PAGE, analyze, best_threshold, capacity_curve, crossover, decode_table, mixed,
                                   eject_threshold, main, predicted_crossover, read_study)
from experiments.crossover import arm_label, arm_order
from experiments.plot_draft_thresholds import plot

CAP_WITH, CAP_WITHOUT = 10, 40  # pages/layer that fit with / without the draft
PAGES = [4, 8, 12, 18, 26, 32]  # 18 and 26 bracket the crossover at 20, asymmetrically
DRAFT_S = 0.002  # the draft's seconds per drafted token
DRAFTED = (4, 4, 8)  # the drafted tokens of the rounds at each context (make_steps); each accepts 3
TRUE = CostModel(a=0.020, b=0.004, c=0.001, d=0.0001, acceptance=0.75, drafted_per_round=16 / 3,
                 draft_s_per_round=DRAFT_S * 16 / 3, tokens_per_round=4.0, n_steps=0, rms_residual_s=0.0)


def tok_s(arm: str, p: float, keep_slope: float = 2.0) -> float:
    keep = 100 - keep_slope * p
    return {"none": 50.0, "always": 60.0, "keep": keep, "onset": keep if p <= CAP_WITH else 60.0,
            "keep_pages=20": keep - 0.5 if p <= 20 else 61.0,
            "auto": 0.97 * max(keep, keep if p <= CAP_WITH else 60.0, keep - 0.5 if p <= 20 else 61.0)}[arm]


RAN = {"none": ("onset", None, "none"), "keep": ("never", None, "draft"), "keep_pages=20": ("keep_pages", 20, "draft")}


def make_runs(arms=("none", "keep", "onset", "keep_pages=20", "auto"), reps=3, keep_slope=2.0, alpha=None):
    """runs.csv rows of these arms: each row records what it ran (policy, keep_pages, spec_type)."""
    rows = []
    for arm in arms:
        policy, keep_pages, spec_type = RAN.get(arm, (arm, None, "draft"))
        for p in PAGES:
            for r in range(reps):
                # offsets -1, 0, +1 keep every mean exact while giving the bootstrap something to resample
                off = (r - 1.0) if reps == 3 else 0.0
                rows.append(dict(run_id=f"{arm}-{p}-{r}", arm=arm, policy=policy, keep_pages=keep_pages,
                                 spec_type=spec_type, context=p * PAGE,
                                 rep=r, new_tokens=64, decode_tok_s=tok_s(arm, p, keep_slope) + off,
                                 prefill_tok_s=1000.0, capacity_with_draft=CAP_WITH,
                                 capacity_without_draft=CAP_WITHOUT, ejects=0, reenables=0, acceptance_rate=0.7,
                                 synthetic_acceptance=alpha, arena_mib=512, model="qwen-1.5b",
                                 draft_model="qwen-0.5b", device="cpu", git_commit="abc"))
    return pd.DataFrame(rows)


def make_steps(model: CostModel = TRUE) -> pd.DataFrame:
    """Noiseless steps: with the draft, rounds of 4, 4 and 8 drafts (widths 5 and 9), each accepting
    3 tokens (3 successes and one rejection: per-token acceptance exactly 0.75), and without it, over
    contexts on both sides of the capacities."""
    rows = []
    for p in range(1, 61, 3):
        for drafted, cap in [(n, CAP_WITH) for n in DRAFTED] + [(0, CAP_WITHOUT)]:
            streamed = max(0, p - cap)
            draft_s = drafted * DRAFT_S
            rows.append(dict(run_id=f"r{drafted}", step=p, context=p * PAGE, pages_per_layer=p,
                             resident_pages=p - streamed, streamed_pages=streamed, rounds=1, h2d_bytes=0,
                             d2h_bytes=0, new_tokens=1, verify_width=1 + drafted, drafted=drafted,
                             accepted=3 if drafted else 0, draft_s=draft_s, draft_active=drafted > 0, speculator="",
                             step_s=model.target_s(p, streamed, 1 + drafted) + draft_s))
    return pd.DataFrame(rows)


def analytic_crossover_pages(m: CostModel, cap_with: float = CAP_WITH, cap_without: float = CAP_WITHOUT) -> float:
    """keep = T / (a + b(p - cw) + c n + d p + D), eject = 1 / (a + d p) for cw < p <= cw': equal at p
    (T tokens, n drafted and D draft seconds per round)."""
    T, n, D = m.tokens_per_round, m.drafted_per_round, m.draft_s_per_round
    p = (m.a * T - m.a + m.b * cap_with - m.c * n - D) / (m.b + m.d - m.d * T)
    assert cap_with < p <= cap_without  # the closed form holds only in this window
    return p


def write_study(tmp_path: Path, runs: pd.DataFrame, steps: pd.DataFrame | None = None) -> Path:
    runs.to_csv(tmp_path / "runs.csv", index=False)
    if steps is not None:
        steps.to_csv(tmp_path / "steps.csv", index=False)
    return tmp_path


def test_the_arm_is_named_from_what_the_run_ran(tmp_path):
    assert arm_label("never", None, "draft") == "keep"
    assert arm_label("keep_pages", 64.0, "draft") == "keep_pages=64"
    assert arm_label("onset", None, "none") == "none"
    assert arm_label("never", None, "ngram-simple,draft") == "keep[ngram-simple,draft]"
    runs = make_runs().assign(arm="a label the analysis does not read")
    assert arm_order(read_study(write_study(tmp_path, runs))[0]) == ["none", "keep", "onset", "keep_pages=20", "auto"]


def test_decode_table_mean_std_n():
    t = decode_table(make_runs())
    row = t[(t.arm == "keep") & (t.context == 18 * PAGE)].iloc[0]
    assert (row["mean"], row["std"], row["n"], row["pages_per_layer"]) == (64.0, 1.0, 3, 18)
    assert list(t.arm.unique()) == ["none", "keep", "onset", "keep_pages=20", "auto"]


def test_decode_table_counts_the_commits_and_configs_it_averages():
    runs = make_runs()
    assert mixed(decode_table(runs)) is None
    runs.loc[(runs.arm == "keep") & (runs.context == 18 * PAGE) & (runs.rep == 2), "git_commit"] = "def"
    t = decode_table(runs)
    assert t[t.commits > 1][["arm", "context"]].values.tolist() == [["keep", 18 * PAGE]]
    assert mixed(t).startswith("warning: 1 of ") and f"keep at {18 * PAGE}" in mixed(t)


def test_crossover_interpolates_and_bootstrap_contains_it(tmp_path):
    runs = pd.read_csv(write_study(tmp_path, make_runs()) / "runs.csv")
    c = crossover(runs)
    # both arms are linear in context between 18 and 26 pages, so the interpolation is exact: float rounding only
    assert c["context_tokens"] == pytest.approx(20 * PAGE, abs=1e-9)
    assert c["pages_per_layer"] == pytest.approx(20.0, abs=1e-9)
    assert c["bracket_tokens"] == [18 * PAGE, 26 * PAGE]
    lo, mid, hi = c["ci_tokens"]
    assert 18 * PAGE <= lo <= 20 * PAGE <= hi <= 26 * PAGE and lo < mid < hi
    assert c["draws_without_crossing"] == 0.0
    assert crossover(runs)["ci_tokens"] == c["ci_tokens"]  # seeded


def test_single_rep_interval_is_the_bracket():
    c = crossover(make_runs(reps=1))
    assert c["ci_tokens"] == [18 * PAGE, pytest.approx(20 * PAGE), 26 * PAGE]
    assert "bracketing" in c["ci_method"]


def test_noise_below_the_onset_is_not_a_crossover():
    runs = make_runs(arms=("keep", "onset"), reps=1)
    below = (runs.arm == "onset") & (runs.context == 4 * PAGE)  # keep > onset at 4 pages, equal at 8: noise
    runs.loc[below, "decode_tok_s"] -= 3
    assert crossover(runs)["context_tokens"] == pytest.approx(20 * PAGE)


@pytest.mark.parametrize("keep_slope, winner, words", [(1.0, "keep", "keep is faster"),
                                                       (4.0, "onset", "onset is as fast or faster")])
def test_no_sign_change_says_who_wins(keep_slope, winner, words):
    # slope 1: keep = 100 - p > 60 up to 32 pages; slope 4: keep = 100 - 4p < 60 above 10 pages
    c = crossover(make_runs(keep_slope=keep_slope))
    assert c["context_tokens"] is None and c["winner"] == winner and words in c["reason"]


def test_best_threshold_picks_the_best_fixed_arm_and_auto_ratio():
    b = best_threshold(make_runs())
    expected = {4: "keep", 8: "keep", 12: "keep", 18: "keep", 26: "keep_pages=20", 32: "keep_pages=20"}
    assert dict(zip(b.pages_per_layer, b.best_arm)) == expected  # ties at 4, 8 pages go to keep
    assert b.best_tok_s.tolist() == [tok_s("keep", p) for p in PAGES[:4]] + [61.0, 61.0]
    assert np.allclose(b.auto_ratio, 0.97, atol=1e-12) and b.auto_meets_goal.all()
    assert (b.none_tok_s == 50.0).all()


def test_missing_arms_and_columns_are_named():
    with pytest.raises(ValueError, match="no keep/eject arms found"):
        best_threshold(make_runs(arms=("none", "auto")))
    with pytest.raises(ValueError, match="'onset'"):
        crossover(make_runs(arms=("keep",)))
    with pytest.raises(ValueError, match="decode_tok_s"):
        crossover(make_runs().drop(columns=["decode_tok_s"]))
    with pytest.raises(ValueError, match="draft_s"):
        fit_cost_model(make_steps().drop(columns=["draft_s"]))
    with pytest.raises(ValueError, match=r"constant \['streamed_pages'\]"):  # b cannot be fitted: nothing streams
        fit_cost_model(make_steps().assign(streamed_pages=0))


def test_cost_model_recovers_known_coefficients():
    m = fit_cost_model(make_steps())
    # noiseless, well-conditioned least squares: only float64 rounding separates fit and truth
    for k in ("a", "b", "c", "d", "acceptance", "drafted_per_round", "draft_s_per_round", "tokens_per_round"):
        assert getattr(m, k) == pytest.approx(getattr(TRUE, k), rel=1e-9, abs=1e-12), k
    assert m.rms_residual_s < 1e-12
    assert m.eject_s == 0.0  # no run of make_steps ejects
    assert m.tok_s(5, 0, False) == pytest.approx(1 / (0.020 + 0.0005))
    # rounds of 4, 4 and 8 drafts: 16/3 drafted, 32/3 ms of drafting and 1 + 3 tokens per round
    assert m.tok_s(5, 0, True) == pytest.approx(4 / (0.020 + 0.001 * 16 / 3 + 0.0005 + 0.032 / 3))



def test_copy_bound_steps_get_their_own_line():
    # streaming hides behind compute until the copy takes longer: truth = max(compute, 0.010 + 0.006 *
    # streamed), which binds at a streamed count that grows with the verify width
    truth = replace(TRUE, e=0.010, f=0.006)
    m = fit_cost_model(make_steps(truth))
    assert m.f > 0 and m.rms_residual_s < 1e-9  # noiseless: the max of two lines is exact
    for k in ("a", "b", "c", "d", "e", "f"):
        # least squares on exact data: float64 rounding of the normal equations (1e-6 relative is far above it;
        # abs for coefficients that are 0)
        assert getattr(m, k) == pytest.approx(getattr(truth, k), rel=1e-6, abs=1e-12), k
    plain = fit_cost_model(make_steps())  # linear truth: the copy line's 3 more parameters buy nothing
    assert (plain.e, plain.f) == (0.0, 0.0)
    # nothing streamed, nothing copied: the copy line never binds there, however high it lies
    assert replace(TRUE, e=1.0, f=0.001).target_s(5, 0, 1) == pytest.approx(TRUE.target_s(5, 0, 1))


def test_the_copy_line_does_not_extrapolate_below_its_fastest_page():
    # the copy line over its measured range, and beyond it the fewest seconds a page any copy-bound design
    # point took (the largest streamed count's, e/s + f with e > 0): a copy's rate does not keep climbing
    # past the fastest one measured
    truth = replace(TRUE, e=0.010, f=0.006)
    steps = make_steps(truth)
    m = fit_cost_model(steps)
    top = steps["streamed_pages"].max()
    assert m.copy_floor == pytest.approx(truth.e / top + truth.f, rel=1e-6)
    assert m.rms_residual_s < 1e-9  # within the range the floor lies under every median: the fit is exact
    p = 60  # the most pages per layer measured
    assert m.target_s(p, top, 1) == pytest.approx(truth.target_s(p, top, 1), rel=1e-6)
    far = 3 * top
    assert m.target_s(p, far, 1) == pytest.approx(m.copy_floor * far, rel=1e-9)
    assert m.target_s(p, far, 1) > truth.target_s(p, far, 1)  # by e * (far / top - 1): the floor's pessimism
    assert fit_cost_model(make_steps()).copy_floor == 0.0  # no copy line, no floor


def test_few_design_points_keep_one_line():
    # 9 design points (6 compute-bound, 3 copy-bound): a 7-parameter max of two lines fits them
    # exactly, as it would fit noise; below 10 points the fit keeps one line by design
    steps = make_steps(replace(TRUE, e=0.010, f=0.006))
    keep = [(1, 1), (1, 5), (1, 9), (4, 1), (4, 5), (13, 5), (43, 5), (52, 5), (58, 5)]  # (step, verify width)
    few = steps[[(a, b) in keep for a, b in zip(steps["step"], steps["verify_width"])]]
    assert few.groupby(["streamed_pages", "verify_width", "pages_per_layer"]).ngroups == 9
    m = fit_cost_model(few)
    assert (m.e, m.f) == (0.0, 0.0)


def test_cost_model_ignores_transition_outliers():
    steps = pd.concat([make_steps()] * 3, ignore_index=True)  # three steps per design point
    slow = steps.index[:len(steps) // 3][steps["drafted"][:len(steps) // 3] == 0][::7]
    steps.loc[slow, "step_s"] += 0.040  # every 7th plain step of the first copy also ejected: 40 ms more
    m = fit_cost_model(steps)
    # each design point has at most one slow step of three, so its median is a clean step
    for k in ("a", "b", "c", "d"):
        assert getattr(m, k) == pytest.approx(getattr(TRUE, k), rel=1e-9, abs=1e-12), k



def test_plain_steps_measured_in_place_are_target_steps_not_drafting_rounds():
    """Plain steps with the draft pinned (auto's plain measurement, ``plain_measure``) enter the
    target's step model like ejected plain steps (their draft_s is bookkeeping that overlaps the
    step), but not the draft's per-round statistics."""
    steps = make_steps()
    plain = steps[steps["drafted"] == 0]
    in_place = plain.assign(run_id="r4", draft_active=True, plain_measure=True, draft_s=1e-4,
                            step_s=plain["step_s"] + 1e-4)  # host a step ahead: the 0.1 ms overlaps the device
    m = fit_cost_model(pd.concat([steps.assign(plain_measure=False), in_place], ignore_index=True))
    ref = fit_cost_model(steps)
    for k in ("drafted_per_round", "tokens_per_round", "draft_s_per_round", "acceptance"):
        assert getattr(m, k) == pytest.approx(getattr(ref, k), rel=1e-12), k
    # without the column they count as drafting rounds of 0 tokens (older steps.csv: none exist)
    old = pd.concat([steps, in_place.drop(columns="plain_measure")], ignore_index=True)
    assert fit_cost_model(old).drafted_per_round < ref.drafted_per_round


def test_round_statistics_per_prompt_length():
    # two prompt lengths (runs starting at 1 and at 31 pages) whose drafting rounds keep 4 and 5 tokens:
    # the model keeps each length's own statistics and interpolates between them
    steps = make_steps()
    late = steps["step"] > 30
    steps["run_id"] = steps["run_id"] + np.where(late, "-late", "")
    steps.loc[late & (steps["drafted"] > 0), "accepted"] = 4
    m = fit_cost_model(steps)
    assert m.round_contexts == (PAGE, 31 * PAGE)
    assert m.rounds(1)[2] == pytest.approx(4.0) and m.rounds(31)[2] == pytest.approx(5.0)
    assert m.rounds(16)[2] == pytest.approx(4.5)  # halfway between the two prompt lengths
    assert m.rounds(60)[2] == pytest.approx(5.0)  # flat past the last
    # pooled over both, as before, where the study has a single prompt length
    assert fit_cost_model(make_steps()).round_contexts == ()
    drafted, draft_s, tokens = m.rounds(31)
    assert m.tok_s(31, 21, True) == pytest.approx(tokens / (m.target_s(31, 21, 1 + drafted) + draft_s))

def test_acceptance_is_per_token_not_the_accepted_fraction():
    rng = np.random.default_rng(0)
    alpha, n = 0.7, 8
    # a round accepts drafts until the first rejection: geometric, capped at n
    accepted = np.minimum(rng.geometric(1 - alpha, 20000) - 1, n)
    steps = make_steps()
    drafting = pd.DataFrame({"drafted": n, "accepted": accepted})
    assert drafting.accepted.sum() / drafting.drafted.sum() == pytest.approx(0.28, abs=0.01)  # what it is not
    # 20000 rounds: the MLE's standard error is ~0.003; 0.01 is > 3 of them
    assert acceptance_per_token(drafting) == pytest.approx(alpha, abs=0.01)
    assert fit_cost_model(steps).acceptance == pytest.approx(0.75, rel=1e-12)


def test_predicted_crossover_matches_analytic():
    m = fit_cost_model(make_steps())
    table, p = predicted_crossover(m, CAP_WITH, CAP_WITHOUT, np.arange(PAGE, 80 * PAGE, PAGE))
    # bisection on the continuous model: 60 halvings of a one-page bracket, so float rounding only
    assert p["pages_per_layer"] == pytest.approx(analytic_crossover_pages(TRUE), rel=1e-9)
    assert p["keep_wins_again_tokens"] is not None  # once both arms stream, keep amortises it over more tokens
    assert (table.keep_tok_s == table.eject_tok_s)[table.pages_per_layer <= CAP_WITH].all()


def test_eject_cost_and_a_decode_that_pays_it():
    steps = make_steps()
    run = pd.DataFrame(dict(run_id="onset", step=range(8), step_s=[0.03, 0.03, 0.05, 0.01, 0.01, 0.012, 0.01, 0.01],
                            draft_active=[True, True, False, False, False, False, False, False], verify_width=1))
    # the first step without the draft takes 0.04 s more than the run's median plain step (0.01 s)
    assert eject_cost(run) == pytest.approx(0.04)
    # no run of make_steps ejects; runs.csv's transitions add the ejects' own re-layout time
    assert fit_cost_model(steps, pd.DataFrame({"transitions": ['[{"action": "eject", "seconds": 0.02}]']})).eject_s \
        == pytest.approx(0.02)
    m = replace(fit_cost_model(steps), eject_s=0.04)
    ctx = np.arange(PAGE, 80 * PAGE, PAGE)
    short, p = predicted_crossover(m, CAP_WITH, CAP_WITHOUT, ctx, new_tokens=64)
    # a 64-token decode after each prompt: the time per token averaged over its span, which for a
    # step time linear in the pages (past the onset, short of the capacity without the draft) is
    # the time at the span's middle, plus the eject once
    mid, _ = predicted_crossover(m, CAP_WITH, CAP_WITHOUT, ctx + 32)
    inside = ((short.pages_per_layer > CAP_WITH) & (short.pages_per_layer < CAP_WITHOUT - 1)).to_numpy()
    assert np.allclose(short.eject_tok_s[inside], 64 / (64 / mid.eject_tok_s[inside] + 0.04))
    assert p["pages_per_layer"] > analytic_crossover_pages(TRUE)  # paying the eject, ejecting wins later


def test_a_page_opened_while_streaming_costs_once_per_page():
    """A streaming plan re-captures its CUDA graphs when a page opens: here the first of each
    page's 10 steps takes 0.1 s more where pages stream, nothing more where none do (that plan
    keeps its graphs). page_cost recovers it from the steps; tok_s charges it once per page of
    tokens where pages stream, and the crossover comes sooner (only keep streams there)."""
    rows = []
    for run, cap, drafted in (("keep", CAP_WITH, 4), ("plain", CAP_WITHOUT, 0)):
        for p in range(CAP_WITH - 4, CAP_WITH + 12):
            streamed = max(0, p - cap)
            for i in range(10):
                recapture = 0.1 if streamed and not i else 0.0
                step_s = TRUE.target_s(p, streamed, 1 + drafted) + drafted * DRAFT_S + recapture
                rows.append(dict(run_id=run, context=(p - 1) * PAGE + 1 + i, pages_per_layer=p, streamed_pages=streamed,
                                 verify_width=1 + drafted, draft_s=drafted * DRAFT_S, draft_active=drafted > 0,
                                 step_s=step_s))
    steps = pd.DataFrame(rows)
    assert page_cost(steps, pd.Series(False, index=steps.index)) == pytest.approx(0.1)
    assert page_cost(steps[steps.streamed_pages == 0], pd.Series(False, index=steps.index)) == 0.0
    assert page_cost(steps, pd.Series(True, index=steps.index)) == 0.0  # every step still paying a transition
    m, p = replace(TRUE, page_s=0.1), CAP_WITH + 5
    assert m.tok_s(p, 5, False) == pytest.approx(1 / (TRUE.target_s(p, 5, 1) + 0.1 / PAGE))
    assert m.tok_s(p, 0, False) == TRUE.tok_s(p, 0, False)
    assert 1 / m.tok_s(p, 5, True) == pytest.approx(1 / TRUE.tok_s(p, 5, True) + 0.1 / PAGE)
    ctx = np.arange(PAGE, 80 * PAGE, PAGE)
    assert predicted_crossover(m, CAP_WITH, CAP_WITHOUT, ctx)[1]["pages_per_layer"] < analytic_crossover_pages(TRUE)


def test_the_page_cost_grows_with_the_streaming_rounds():
    """A plan of more rounds captures a larger graph (and, before 6be990b, a multi-round plan
    re-captured at every page): openings cost 0.03 s in one round and 0.09 s in two, here with rounds of 4
    streamed pages (a fixed ring of 8). page_costs recovers both; tok_s charges each state the
    cost of its own round count, flat beyond the measured ones; a ring that is not one fixed size
    has no round size, and the model keeps one mean cost."""
    rows = []
    for p in range(CAP_WITH - 2, CAP_WITH + 9):
        streamed = max(0, p - CAP_WITH)
        rounds = max(1, -(-streamed // 4))
        for i in range(10):
            recapture = (0.03 if rounds == 1 else 0.09) if streamed and not i else 0.0
            rows.append(dict(run_id="keep", context=(p - 1) * PAGE + 1 + i, pages_per_layer=p, streamed_pages=streamed,
                             rounds=rounds, verify_width=5, draft_s=4 * DRAFT_S, draft_active=True,
                             step_s=TRUE.target_s(p, streamed, 5) + 4 * DRAFT_S + recapture))
    steps = pd.DataFrame(rows)
    costs = page_costs(steps, pd.Series(False, index=steps.index))
    assert costs["page_rounds"] == (1, 2) and costs["page_s_rounds"] == pytest.approx((0.03, 0.09))
    assert page_costs(steps.drop(columns="rounds"), pd.Series(False, index=steps.index)) == {}
    m = replace(TRUE, page_s=0.06, ring_round_pages=4, **costs)
    assert m.page_seconds([0, 3, 4, 5, 8, 40]) == pytest.approx([0, 0.03, 0.03, 0.09, 0.09, 0.09])
    assert 1 / m.tok_s(20, 6, False) == pytest.approx(TRUE.target_s(20, 6, 1) + 0.09 / PAGE)
    runs = lambda ring: pd.DataFrame(dict(config=[json.dumps(dict(cache=dict(ring_pages=ring)))]))  # noqa: E731
    assert round_pages(runs("8")) == 4 and round_pages(runs("auto")) is None and round_pages(None) is None
    fitted = fit_cost_model(make_steps(), runs("8"))  # one step per page: no opening to measure
    assert fitted.ring_round_pages == 4 and fitted.page_rounds == () and fitted.page_s == 0.0


def test_steps_that_still_pay_for_a_transition_are_marked():
    run = pd.DataFrame(dict(run_id="auto", verify_width=[5, 5, 1, 1, 1, 5, 5, 5, 2],
                            draft_active=[True, True, False, False, False, True, True, True, True]))
    # after the eject (step 2) and the re-enable (step 5): their first two steps, and the first step of
    # each width in the new layout (step 8: the first 2-wide round captures its graph)
    assert after_transition(run).tolist() == [False, False, True, True, False, True, True, False, True]


def test_fit_leaves_out_steps_that_pay_a_transition():
    steps = make_steps()
    t = TRUE.target_s(10, 0, 1)
    # a run that re-enables its draft: the first round after it (a lone 3-wide round: its own design
    # point) re-captures graphs and catches up, 0.3 s; left in, it would bend c
    run = pd.DataFrame(dict(run_id="x", step=[0, 1, 2], context=10 * PAGE, pages_per_layer=10, streamed_pages=0,
                            verify_width=[1, 1, 3], drafted=[0, 0, 2], accepted=[0, 0, 2],
                            draft_s=[0.0, 0.0, 2 * DRAFT_S], draft_active=[False, False, True],
                            step_s=[t, t, TRUE.target_s(10, 0, 3) + 2 * DRAFT_S + 0.3]))
    m = fit_cost_model(pd.concat([steps, run], ignore_index=True))
    for k in ("a", "b", "c", "d", "drafted_per_round", "tokens_per_round"):
        assert getattr(m, k) == pytest.approx(getattr(TRUE, k), rel=1e-9, abs=1e-12), k


def test_always_ejects_at_zero_pages_and_odd_transition_cells_are_skipped():
    runs = make_runs(arms=("keep", "always"), reps=1)
    assert eject_threshold(runs, "always") == 0.0 and eject_threshold(runs, "onset") == CAP_WITH * PAGE
    cells = ['[{"action": "eject", "seconds": 0.02}]', "", "null", '[{"action": "eject"}]', None, "[]",
             '[{"action": "reenable", "seconds": 9}]']
    assert eject_seconds(pd.DataFrame({"transitions": cells})) == 0.02
    assert eject_seconds(pd.DataFrame({"x": [1]})) == 0.0


def test_capacity_curve_ignores_capped_capacities():
    runs = make_runs(arms=("keep",), reps=1)
    runs["capacity_with_draft"] = [5, 9, 11, 12, 12, 12]  # 5 and 9: all of those contexts' pages (capped)
    cw = capacity_curve(runs, "capacity_with_draft")
    assert cw(12 * PAGE) == 11 and cw(15 * PAGE) == pytest.approx(11.5) and cw(4 * PAGE) == 11  # flat outside
    assert np.isinf(capacity_curve(runs.assign(capacity_without_draft=[5, 9, 13, 19, 27, 33]),
                                   "capacity_without_draft")(50 * PAGE))  # every one capped: nothing streams


def test_cli_writes_tables_and_json(tmp_path, capsys):
    study = write_study(tmp_path, make_runs(), make_steps())
    main([str(study)])
    out = json.loads((study / "crossover.json").read_text())
    assert out["measured"]["context_tokens"] == pytest.approx(20 * PAGE)
    steady = analytic_crossover_pages(TRUE) * PAGE
    assert out["predicted_steady"]["context_tokens"] == pytest.approx(steady, rel=1e-9)
    # the study's 64-token decodes (no eject cost): the prompt whose decode's middle is at the steady crossover
    pred = steady - 64 / 2
    assert out["predicted"]["context_tokens"] == pytest.approx(pred, rel=1e-9)
    assert out["relative_error"] == pytest.approx(abs(pred - 20 * PAGE) / (20 * PAGE), rel=1e-9)
    assert out["cost_model"]["b"] == pytest.approx(TRUE.b)
    assert len(pd.read_csv(study / "decode_table.csv")) == 5 * len(PAGES)
    assert len(pd.read_csv(study / "best_threshold.csv")) == len(PAGES)
    assert "measured:" in capsys.readouterr().out


def test_cli_bad_input_is_one_line(tmp_path):
    runs = make_runs(reps=1)
    write_study(tmp_path, runs[runs["context"] == 8 * PAGE])  # one context: no crossover to locate
    with pytest.raises(SystemExit, match=r"^crossover: arms 'keep' and 'onset' share 1 context\(s\)"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^crossover: no runs\.csv in"):
        main([str(tmp_path / "missing")])


def test_a_study_without_steps_csv_reads_its_per_cell_files(tmp_path):
    """A study may keep only the per-cell steps/<run_id>.csv the sweep writes (a large study's
    one steps.csv would be a big file): read_study gathers them."""
    steps = make_steps()
    write_study(tmp_path, make_runs())
    (tmp_path / "steps").mkdir()
    for run_id, cell in steps.groupby("run_id"):
        cell.to_csv(tmp_path / "steps" / f"{run_id}.csv", index=False)
    _, got = read_study(tmp_path)
    steps.to_csv(tmp_path / "steps.csv", index=False)  # the same steps, as one file
    _, one = read_study(tmp_path)
    order = lambda df: df.sort_values(["run_id", "step"]).reset_index(drop=True)  # noqa: E731
    assert len(got) == len(steps) and got["run_id"].nunique() == steps["run_id"].nunique() > 1
    pd.testing.assert_frame_equal(order(got), order(one))


def test_without_steps_the_prediction_says_why():
    r = analyze(make_runs(), None)
    assert r["predicted"]["context_tokens"] is None and "steps.csv" in r["predicted"]["reason"]


def test_cli_as_module(tmp_path):
    study = write_study(tmp_path, make_runs(reps=1), make_steps())
    subprocess.run([sys.executable, "-m", "experiments.crossover", str(study)], check=True, capture_output=True,
                   cwd=Path(__file__).parents[1])
    assert (study / "crossover.json").is_file()


def test_plot_writes_png(tmp_path):
    study = write_study(tmp_path, make_runs(alpha=0.7), make_steps())
    png = plot(study)
    assert png == study / "draft_thresholds.png" and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = pd.read_csv(study / "runs.csv")
    assert "synthetic acceptance α=0.7" in title(runs) and "qwen-1.5b + draft qwen-0.5b on cpu" in title(runs)
    assert "synthetic" not in title(make_runs())


def test_plot_without_keep_or_steps(tmp_path):
    study = write_study(tmp_path, make_runs(arms=("none", "auto")))
    assert plot(study).stat().st_size > 0
