"""Eject / re-enable policies on synthetic telemetry traces, without a model."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from kvstream.config import PolicyConfig
from kvstream.engine.runner import eject_policy
from policies.eject import Action, Always, Auto, KeepPages, Never, Onset, ReenablePages, Snapshot, StableDecodes

CAP_WITH, CAP_WITHOUT = 40, 52  # pages per layer with / without the draft pinned


def build(name: str, **knobs):
    """The eject policy ``name`` as a run builds it: the config's defaults, but for ``knobs``."""
    return eject_policy(PolicyConfig(eject=name, **knobs))


def make_auto(**knobs) -> Auto:
    """Auto with the config's defaults but for ``knobs``, without the StableDecodes wrapper."""
    return build("auto", stable_decodes=0, **knobs)


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
    with pytest.raises(ValueError, match="policy.eject='sometimes'; choose one of onset, keep_pages, never, always, auto"):
        build("sometimes")
    with pytest.raises(ValueError, match=r"policy.keep_pages=None: give the pages per layer"):
        build("keep_pages")  # a threshold has no default


# --- auto: goodput measured online -------------------------------------------------------------


def auto_snap(pages, active, since=100, with_=None, without=None, **horizon):
    """A snapshot for Auto; ``with_`` / ``without`` are (goodput, pages when measured) or None;
    ``horizon``: tokens_left, eject_s, reenable_s (and plain_in_place)."""
    w, wp = with_ or (None, None)
    wo, wop = without or (None, None)
    return Snapshot(pages, CAP_WITH, CAP_WITHOUT, active, since, w, wp, wo, wop, **horizon)


@pytest.mark.parametrize("snap, expected", [
    # in the last page before the onset, plain decoding never measured or stale: measure it in place
    (auto_snap(CAP_WITH, True, plain_in_place=True), Action.MEASURE_PLAIN),
    (auto_snap(CAP_WITH, True, plain_in_place=True, without=(9.0, CAP_WITH - 17)), Action.MEASURE_PLAIN),
    # farther below (it would go stale sooner after the onset); fresh already; not possible (another speculator)
    (auto_snap(CAP_WITH - 1, True, plain_in_place=True), Action.STAY),
    (auto_snap(CAP_WITH, True, plain_in_place=True, without=(9.0, CAP_WITH - 16)), Action.STAY),
    (auto_snap(CAP_WITH, True), Action.STAY),
    # not within `measure_batches` batches of a transition; never above the onset (plain steps there would stream
    # with the draft's smaller pool: they are not the ejected state)
    (auto_snap(CAP_WITH, True, since=7, plain_in_place=True), Action.STAY),
    (auto_snap(CAP_WITH + 1, True, since=8, with_=(50.0, CAP_WITH + 1), plain_in_place=True), Action.EJECT),
])
def test_auto_measures_plain_decoding_in_place_below_the_onset(snap, expected):
    assert make_auto().decide(snap) is expected


def test_auto_without_trusting_the_onset_measures_in_place_anywhere_below_it():
    below = CAP_WITH - 30
    auto = make_auto(trust_onset=False)
    assert auto.decide(auto_snap(below, True, with_=(20.0, below), plain_in_place=True)) is Action.MEASURE_PLAIN
    assert auto.decide(auto_snap(below, True, with_=(20.0, below), without=(40.0, below))) is Action.EJECT  # worth it
    assert auto.decide(auto_snap(below, True, with_=(20.0, below), without=(10.0, below))) is Action.STAY


@pytest.mark.parametrize("snap, expected", [
    # at or below the onset: the draft, whatever the numbers say
    (auto_snap(CAP_WITH, True, without=(999.0, CAP_WITH)), Action.STAY),
    (auto_snap(CAP_WITH, False, since=0, without=(999.0, CAP_WITH)), Action.REENABLE),
    # above: nothing before `measure_batches` batches of the stint
    (auto_snap(60, True, since=7, with_=(50.0, 60)), Action.STAY),
    # the other state never measured, or measured more than probe_pages (16) ago: probe it
    (auto_snap(60, True, since=8, with_=(50.0, 60)), Action.EJECT),
    (auto_snap(60, True, with_=(50.0, 60), without=(10.0, 43)), Action.EJECT),
    (auto_snap(60, False, with_=(99.0, 43), without=(50.0, 60)), Action.REENABLE),
    # both fresh: switch only past the 3 % min_gain
    (auto_snap(60, True, with_=(50.0, 60), without=(51.0, 44)), Action.STAY),
    (auto_snap(60, True, with_=(50.0, 60), without=(51.6, 44)), Action.EJECT),
    (auto_snap(60, False, with_=(51.6, 59), without=(50.0, 60)), Action.REENABLE),
    (auto_snap(60, False, with_=(40.0, 59), without=(50.0, 60)), Action.STAY),
    # no fresh number for the current state: nothing to compare, stay
    (auto_snap(60, True, without=(99.0, 60)), Action.STAY),
    (auto_snap(60, True, with_=(50.0, 40), without=(99.0, 60)), Action.STAY),
])
def test_auto_decisions(snap, expected):
    assert make_auto().decide(snap) is expected


@pytest.mark.parametrize("snap, expected", [
    # a probe (the other state stale) from keep at 50 tok/s, transitions measured at 0.1 + 0.2 s:
    # 20 tokens left are 0.4 s >= 0.3 s, probe; 10 tokens are 0.2 s, skipped
    (auto_snap(60, True, with_=(50.0, 60), without=(10.0, 43), tokens_left=20, eject_s=0.1, reenable_s=0.2),
     Action.EJECT),
    (auto_snap(60, True, with_=(50.0, 60), without=(10.0, 43), tokens_left=10, eject_s=0.1, reenable_s=0.2),
     Action.STAY),
    # costs not measured yet count as zero: the first probe is made however little is left
    (auto_snap(60, True, with_=(50.0, 60), tokens_left=1), Action.EJECT),
    (auto_snap(60, True, with_=(50.0, 60), tokens_left=10, reenable_s=0.1), Action.EJECT),
    (auto_snap(60, True, with_=(50.0, 60), tokens_left=10, reenable_s=0.3), Action.STAY),
    (auto_snap(60, True, with_=(50.0, 60), tokens_left=10, eject_s=0.1, reenable_s=0.2), Action.STAY),
    # no end in sight (tokens_left None): the horizon does not bind
    (auto_snap(60, True, with_=(50.0, 60), eject_s=10.0, reenable_s=10.0), Action.EJECT),
    # a switch to a state measured better by 25 %: 100 tokens at 40 tok/s are 2.5 s, saving
    # 2.5 x (1 - 40/50) = 0.5 s; one re-enable of 0.4 s pays, one of 0.6 s does not
    (auto_snap(60, False, with_=(50.0, 59), without=(40.0, 60), tokens_left=100, reenable_s=0.4), Action.REENABLE),
    (auto_snap(60, False, with_=(50.0, 59), without=(40.0, 60), tokens_left=100, reenable_s=0.6), Action.STAY),
    (auto_snap(60, False, with_=(50.0, 59), without=(40.0, 60), tokens_left=100, eject_s=9.0), Action.REENABLE),
])
def test_auto_horizon(snap, expected):
    assert make_auto().decide(snap) is expected
    # without the horizon the decision is the one for an unbounded decode
    assert make_auto(horizon=False).decide(snap) is make_auto().decide(replace(snap, tokens_left=None))


# A synthetic engine for Auto. Goodput curves (tokens/s) over the context's pages per layer:
# the draft doubles goodput at the onset, but it pins 12 pages of the pool, so it streams sooner
# and its goodput falls faster; they cross at 228 pages per layer (then ejecting wins, by 23 %
# at 400 pages). The best fixed threshold beats onset, never and always by 7-10 %.
PAGE = 16  # tokens per page
CROSSOVER = 228


def keep_goodput(pages):
    return 200.0 / (1 + max(0, pages - CAP_WITH) / 100)


def eject_goodput(pages):
    return 100.0 / (1 + max(0, pages - CAP_WITHOUT) / 400)


KEEP_TOKENS = 3                 # tokens per verify round with the draft (accepted + bonus)
REENABLE_S, EJECT_S = 0.05, 0.01  # re-pinning the draft (weights, its KV catching up) / unpinning
WARMUP, WARMUP_SLOW = 2, 1.5    # the first batches of a stint run slower (what `measure_batches` waits out)
WINDOW = 4                      # goodput here (a model, not the engine's): tokens / seconds, last batches


@dataclass
class Run:
    tokens_per_s: float
    batches: list        # (pages, draft_active) per batch
    transitions: list    # (pages, action)

    def stints(self):
        """(draft_active, first pages, batches) per run of batches in one state."""
        out = []
        for pages, active in self.batches:
            if out and out[-1][0] == active:
                out[-1][2] += 1
            else:
                out.append([active, pages, 1])
        return out


PLAIN_BATCHES = 5  # a plain measurement in place, as DraftControl makes it: 1 batch charged, 4 measured


def simulate(policy, start=30, end=400, page_tokens=PAGE, max_batches=100_000, noise=0.03, seed=0, budget=None,
             in_place=False):
    """Play the engine: a snapshot per batch, carry out the action, run one decode batch in the
    current state, update that state's measured goodput. The context grows by the tokens kept.
    With ``budget`` the decode ends after that many tokens, and the snapshots say how many are
    left and what a transition cost once one was made (its seconds, warm-up batches aside).
    ``in_place``: the draft may measure plain decoding in place (the engine runs PLAIN_BATCHES
    plain batches, the draft pinned; at or below the onset they run at the ejected rate)."""
    rng = random.Random(seed)
    generated, seconds, active, since = 0, 0.0, True, 0
    measured = {True: (None, None), False: (None, None)}  # state -> (goodput, pages when measured)
    costs = {Action.EJECT: None, Action.REENABLE: None}
    stint, batches, transitions = [], [], []
    while (start + generated // page_tokens < end and len(batches) < max_batches
           and (budget is None or generated < budget)):
        pages = start + generated // page_tokens
        horizon = {} if budget is None else dict(tokens_left=budget - generated, eject_s=costs[Action.EJECT],
                                                 reenable_s=costs[Action.REENABLE])
        action = policy.decide(Snapshot(pages, CAP_WITH, CAP_WITHOUT, active, since, *measured[True], *measured[False],
                                        **horizon, plain_in_place=in_place and active))
        if action is Action.MEASURE_PLAIN:
            assert active and pages <= CAP_WITH, f"a plain measurement at {pages} pages, draft_active={active}"
            plain = []
            for _ in range(PLAIN_BATCHES):
                dt = 1 / eject_goodput(start + generated // page_tokens) * rng.uniform(1 - noise, 1 + noise)
                generated, seconds, since = generated + 1, seconds + dt, since + 1
                plain.append(dt)
                batches.append((start + generated // page_tokens, active))
            measured[False] = (len(plain[1:]) / sum(plain[1:]), start + generated // page_tokens)
            transitions.append((pages, action))
            continue
        if action is not Action.STAY:
            assert active == (action is Action.EJECT), f"{action} while draft_active={active}"
            active, since, stint = not active, 0, []
            costs[action] = REENABLE_S if active else EJECT_S
            seconds += costs[action]
            transitions.append((pages, action))
        n = KEEP_TOKENS if active else 1
        dt = n / (keep_goodput if active else eject_goodput)(pages) * rng.uniform(1 - noise, 1 + noise)
        dt *= WARMUP_SLOW if since < WARMUP else 1.0
        generated, seconds, since = generated + n, seconds + dt, since + 1
        stint.append((n, dt))
        recent = stint[-WINDOW:]
        measured[active] = (sum(k for k, _ in recent) / sum(t for _, t in recent), start + generated // page_tokens)
        batches.append((pages, active))
    return Run(generated / seconds, batches, transitions)


@pytest.mark.parametrize("seed", range(5))
def test_auto_keeps_the_draft_below_the_crossover_and_ejects_soon_after_it(seed):
    auto = build("auto")
    run = simulate(auto, seed=seed)
    probe, measure = auto.inner.probe_pages, auto.inner.measure_batches
    assert all(p > CAP_WITH for p, a in run.transitions if a is Action.EJECT)  # never below the onset
    # The curves sit within the 3 % min_gain of each other from ~211 to ~245 pages: either state is
    # right there, so the bounds below leave 2 probe intervals (32 pages) either side.
    near = 2 * probe
    stints = run.stints()
    # below the crossover an eject is a probe: back after `measure_batches` batches, once per probe_pages
    below = [n for active, p, n in stints if not active and p < CROSSOVER - near]
    assert below and max(below) == measure
    assert len(below) <= (CROSSOVER - CAP_WITH) // probe + 1
    # the first eject that sticks comes near the crossover ...
    first = next(p for active, p, n in stints if not active and n > measure)
    assert CROSSOVER - near <= first <= CROSSOVER + near
    # ... and past it the draft comes back only to probe
    assert all(n <= measure for active, p, n in stints if active and p > CROSSOVER + near)
    assert len(run.transitions) <= 2 * ((400 - CAP_WITH) // probe + 2)


def test_auto_reaches_the_best_fixed_threshold():
    auto = simulate(build("auto")).tokens_per_s
    fixed = {t: simulate(build("keep_pages", keep_pages=t)).tokens_per_s for t in range(CAP_WITH, 401, 5)}
    best = max(fixed, key=fixed.get)
    # the curves are what the test says they are: the best threshold on this 5-page grid lies within
    # two grid steps of the crossover (the batch-level simulation quantizes the gain near it)
    assert abs(best - CROSSOVER) <= 10, best
    # probes cost measure_batches batches in the worse state and two transitions per probe_pages pages
    assert auto >= 0.95 * fixed[best], (auto, best, fixed[best])
    assert auto > max(fixed[CAP_WITH], fixed[400], simulate(build("always")).tokens_per_s)  # onset, never, always


@pytest.mark.parametrize("pages, transitions", [(100, ["eject", "reenable"]), (300, ["eject"]), (CROSSOVER, ["eject"])])
def test_auto_does_not_flip_flop_on_a_standing_context(pages, transitions):
    """A context that stands still: one probe (and its return when the probe lost), then quiet;
    at the crossover the two states are within min_gain and the probe stays."""
    run = simulate(build("auto"), start=pages, page_tokens=10**9, max_batches=2000)
    assert [a.value for _, a in run.transitions] == transitions


def test_auto_horizon_skips_transitions_the_decode_cannot_pay_for():
    """Below the crossover, decodes that end soon after the plain-decoding measurement went
    stale (at 119 pages, ~304 tokens in). Without the horizon auto probes again however few
    tokens are left; with it, it skips a probe it cannot pay for (6-8 tokens left against ~0.06
    s of transitions) and, later, a return to the draft that would not pay back in time. It is
    never slower and never makes more transitions."""
    for budget in range(300, 330, 2):
        off, on = (simulate(build("auto", horizon=h), start=100, budget=budget) for h in (False, True))
        assert len(on.transitions) <= len(off.transitions) and on.tokens_per_s >= off.tokens_per_s, budget
    off, on = (simulate(build("auto", horizon=h), start=100, budget=308) for h in (False, True))
    assert [a.value for _, a in off.transitions] == ["eject", "reenable", "eject"]
    assert [a.value for _, a in on.transitions] == ["eject", "reenable"]


def test_auto_measuring_in_place_skips_the_probe_at_the_onset():
    """From below the onset: plain decoding is measured in place in the page before it, so the
    first probe (an eject and a re-enable) comes probe_pages pages later, not at the onset;
    up to there the decode is faster."""
    for seed in range(5):
        off, on = (simulate(build("auto"), seed=seed, in_place=p) for p in (False, True))
        first = lambda run: next(p for p, a in run.transitions if a is Action.EJECT)  # noqa: E731
        assert first(off) == CAP_WITH + 1 and first(on) == CAP_WITH + build("auto").inner.probe_pages + 1
        assert [p for p, a in on.transitions if a is Action.MEASURE_PLAIN] == [CAP_WITH]
        # up to there: a 5-batch plain measurement against a probe (two transitions, 8 plain batches)
        off, on = (simulate(build("auto"), seed=seed, in_place=p, end=CAP_WITH + 17) for p in (False, True))
        assert on.tokens_per_s > off.tokens_per_s
        early = lambda run: sum(a is Action.EJECT and p <= CAP_WITH + 16 for p, a in run.transitions)  # noqa: E731
        assert (early(off), early(on)) == (1, 0)


def test_build_auto():
    p = build("auto")
    assert isinstance(p, StableDecodes) and p.n == 4
    assert p.inner == Auto(probe_pages=16, measure_batches=8, min_gain=0.03, trust_onset=True, horizon=True)
    assert make_auto(probe_pages=8, measure_batches=6, min_gain=0.1) == Auto(8, 6, 0.1, True, True)
    assert build("auto", horizon=False).inner.horizon is False and p.inner.horizon is True
    for bad, message in (({"probe_pages": 0}, "policy.probe_pages=0"), ({"min_gain": -0.1}, "policy.min_gain=-0.1"),
                         ({"measure_batches": 5}, "policy.measure_batches=5: auto needs at least 6 batches")):
        with pytest.raises(ValueError, match=message):
            build("auto", **bad)
    build("onset", measure_batches=1, min_gain=-1.0)  # auto's knobs, not read by the others


def test_auto_without_trusting_the_onset_compares_below_it_too():
    """A draft that does not pay even when nothing streams (launch-bound eager draft steps):
    with trust_onset=False auto probes and ejects below the onset as well."""
    below = CAP_WITH - 5
    assert make_auto().decide(auto_snap(below, True, with_=(20.0, below))) is Action.STAY
    auto = make_auto(trust_onset=False)
    assert auto.decide(auto_snap(below, True, with_=(20.0, below))) is Action.EJECT  # probe
    assert auto.decide(auto_snap(below, False, with_=(20.0, below), without=(40.0, below))) is Action.STAY
    assert auto.decide(auto_snap(below, False, with_=(40.0, below), without=(20.0, below))) is Action.REENABLE
    assert build("auto", trust_onset=False).inner.trust_onset is False
