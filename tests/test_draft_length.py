"""Draft-length policies on hand-made snapshots, without a model; expectations computed by hand."""

from __future__ import annotations

import pytest

from policies.draft_length import Fixed, Goodput, Heuristic, LengthSnapshot, build, expected_tokens, verify_time


def snap(n_max=8, drafted=0, accepted=0, acceptance=None, target=None, draft_s=None, current=4):
    return LengthSnapshot(n_max, drafted, accepted, acceptance, target or {}, draft_s, current)


@pytest.mark.parametrize("a, n, tokens", [
    (1.0, 4, 5.0),       # every token kept, plus the bonus
    (0.5, 2, 1.75),      # 1 + 0.5 + 0.25
    (0.8, 1, 1.8),
    (0.0, 5, 1.0),       # only the target's own token
])
def test_expected_tokens(a, n, tokens):
    assert expected_tokens(a, n) == pytest.approx(tokens, rel=1e-12)  # float rounding only


@pytest.mark.parametrize("target, width, seconds", [
    ({2: 1.0, 4: 1.4}, 2, 1.0),          # measured
    ({2: 1.0, 4: 1.4}, 3, 1.2),          # between measured widths
    ({2: 1.0, 4: 1.4}, 6, 1.8),          # above: slope 0.2 per width
    ({2: 1.0, 4: 1.4}, 1, 0.8),          # below
    ({2: 1.0, 3: 0.9}, 5, 0.9),          # noise says wider is cheaper: slope clipped at 0
    ({5: 0.1, 6: 1.0}, 2, 0.0),          # extrapolated below zero: clipped at 0
    ({2: 1.0}, 3, None),                 # one width: no line
    ({}, 3, None),
])
def test_verify_time(target, width, seconds):
    got = verify_time(target, width)
    assert got == (None if seconds is None else pytest.approx(seconds, abs=1e-12))  # float rounding only


def test_fixed_is_capped_at_n_max():
    assert Fixed(4).decide(snap(n_max=8)) == 4
    assert Fixed(4).decide(snap(n_max=2)) == 2
    assert Fixed(4).decide(snap(n_max=0)) == 0
    with pytest.raises(ValueError, match="fixed needs n >= 1, got 0"):
        Fixed(0)


def test_heuristic_plus_two_minus_one():
    h = Heuristic(n_min=2)
    assert h.decide(snap(current=0)) == 8                               # first round: n_max
    assert Heuristic(start=3).decide(snap(current=0)) == 3              # ... or start
    assert h.decide(snap(drafted=4, accepted=4, current=4)) == 6        # all kept: +2
    assert h.decide(snap(drafted=4, accepted=4, current=7)) == 8        # capped at n_max
    assert h.decide(snap(drafted=4, accepted=3, current=4)) == 3        # one rejected: -1
    assert h.decide(snap(drafted=2, accepted=0, current=2)) == 2        # floored at n_min
    assert h.decide(snap(drafted=0, accepted=0, current=5)) == 5        # no draft: no evidence
    assert h.decide(snap(drafted=3, accepted=3, current=3)) == 5        # a short draft wholly kept
    with pytest.raises(ValueError, match="n_min >= 1"):
        Heuristic(n_min=0)


def test_heuristic_replay():
    """A run of rounds, the engine feeding each decision back as ``current``."""
    h, n, lengths = Heuristic(), 4, []
    for kept_all in [True, True, False, False, False, False, False, True]:
        n = h.decide(snap(drafted=n, accepted=n if kept_all else 0, current=n))
        lengths.append(n)
    assert lengths == [6, 8, 7, 6, 5, 4, 3, 5]


FLAT = {2: 1.0, 3: 1.0}  # verify time does not depend on the width (memory-bound)


def test_goodput_cheap_draft_takes_n_max():
    # rate(n) = (1 - 0.8**(n+1)) / 0.2 / (1 + 0.001 n): 4.132 at n=7, 4.295 at n=8, still rising
    assert Goodput().decide(snap(acceptance=0.8, target=FLAT, draft_s=0.001)) == 8


def test_goodput_expensive_draft_takes_a_short_one():
    # rate(n) = (1 - 0.8**(n+1)) / 0.2 / (1 + 0.5 n): 1.2 at n=1, 1.22 at n=2, 1.1808 at n=3
    assert Goodput().decide(snap(acceptance=0.8, target=FLAT, draft_s=0.5)) == 2


def test_goodput_interpolated_verify_time_and_ties():
    # verify 1 + 0.25 w (measured at widths 2 and 4), free draft, a = 0.5:
    # rate(n) = (2 - 0.5**n) / (1 + 0.25 (n + 1)) = 1.0 at n=1 and n=2, 0.9375 at n=3: tie -> shorter
    assert Goodput().decide(snap(acceptance=0.5, target={2: 1.5, 4: 2.0}, draft_s=0.0)) == 1


def test_goodput_with_every_token_accepted():
    # a = 1: rate(n) = (n + 1) / (1 + 0.5 n), rising to 9 / 5 at n = 8
    assert Goodput().decide(snap(acceptance=1.0, target=FLAT, draft_s=0.5)) == 8


@pytest.mark.parametrize("kw, n", [
    ({"acceptance": None, "target": FLAT, "draft_s": 0.0}, 4),
    ({"acceptance": 0.8, "target": {2: 1.0}, "draft_s": 0.0}, 4),   # one verify width measured
    ({"acceptance": 0.8, "target": FLAT, "draft_s": None}, 4),
    ({"acceptance": None, "current": 0}, 8),                        # no round yet: n_max
    ({"acceptance": None, "current": 12}, 8),                       # capped
    ({"acceptance": 0.8, "target": FLAT, "draft_s": 0.0, "n_max": 0}, 0),
])
def test_goodput_keeps_the_current_length_until_measured(kw, n):
    assert Goodput().decide(snap(**kw)) == n


def test_build():
    assert build("fixed", n=3) == Fixed(3)
    assert build("heuristic", n_min=2, start=5) == Heuristic(2, 5)
    assert build("goodput") == Goodput()
    with pytest.raises(ValueError, match="policy.draft_length='best'; choose one of fixed, heuristic, goodput"):
        build("best")
    with pytest.raises(ValueError, match="policy.draft_length=fixed: .*'n'"):
        build("fixed")
    with pytest.raises(ValueError, match="policy.draft_length=goodput: .*'n'"):
        build("goodput", n=3)
