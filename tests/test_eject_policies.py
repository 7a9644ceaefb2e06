"""Eject / re-enable policies on synthetic telemetry traces, without a model."""

from __future__ import annotations

import pytest

from policies.eject import Action, Always, KeepPages, Never, Onset, ReenablePages, Snapshot, StableDecodes, build

CAP_WITH, CAP_WITHOUT = 40, 52  # pages per layer with / without the draft pinned


def replay(policy, pages_trace, draft_active=True):
    """Feed a trace of working-set sizes; apply each action; return (states, transitions)."""
    states, transitions, since = [], [], 0
    for i, pages in enumerate(pages_trace):
        snap = Snapshot(pages, CAP_WITH, CAP_WITHOUT, draft_active, since)
        action = policy.decide(snap)
        if action is Action.EJECT:
            assert draft_active, f"step {i}: eject while ejected"
            draft_active, since = False, 0
            transitions.append((i, "eject"))
        elif action is Action.REENABLE:
            assert not draft_active, f"step {i}: re-enable while active"
            draft_active, since = True, 0
            transitions.append((i, "reenable"))
        since += 1
        states.append(draft_active)
    return states, transitions


GROW = list(range(30, 60))  # the context grows past both capacities


def test_onset_ejects_when_the_working_set_exceeds_the_draft_active_capacity():
    states, tr = replay(Onset(), GROW)
    assert tr == [(GROW.index(CAP_WITH + 1), "eject")]


def test_keep_pages_ejects_above_its_threshold():
    assert replay(KeepPages(45), GROW)[1] == [(GROW.index(46), "eject")]


def test_never_and_always():
    assert replay(Never(), GROW)[1] == []
    assert replay(Never(), GROW, draft_active=False)[1] == [(0, "reenable")]
    assert replay(Always(), GROW)[1] == [(0, "eject")]
    assert replay(Always(), GROW, draft_active=False)[1] == []


HOVER = [40, 41, 40, 41, 39, 41, 40, 42, 38, 41, 31, 30, 45]  # a context hovering at the threshold


def test_without_hysteresis_a_hovering_context_flips_every_batch():
    assert len(replay(Onset(), HOVER)[1]) >= 8


def test_reenable_margin_stops_the_flipping():
    _, tr = replay(ReenablePages(Onset(), margin=8), HOVER)
    # ejected at 41, re-enabled only once 32 (= 40 - 8) pages or fewer, ejected again at 45
    assert tr == [(1, "eject"), (10, "reenable"), (12, "eject")]


def test_stable_decodes_waits_between_transitions():
    _, tr = replay(StableDecodes(Onset(), n=4), HOVER)
    gaps = [b - a for (a, _), (b, _) in zip(tr, tr[1:])]
    assert len(tr) >= 2 and min(gaps) >= 4


def test_build_wraps_the_default_hysteresis_and_rejects_bad_names():
    p = build("onset")
    assert isinstance(p, StableDecodes) and isinstance(p.inner, ReenablePages) and p.inner.margin == 8 and p.n == 4
    assert isinstance(build("never", stable_decodes=0), Never)
    assert build("keep_pages", keep_pages=300).inner.inner == KeepPages(300)
    with pytest.raises(ValueError, match="policy.eject='sometimes'; choose one of onset, keep_pages, never, always"):
        build("sometimes")
    with pytest.raises(ValueError, match="keep_pages must be >= 1"):
        build("keep_pages")
