"""Draft eject / re-enable policies: pure decisions over a telemetry snapshot.

The engine hands a :class:`Snapshot` after every decode batch and carries out the returned
:class:`Action`. An *eject* gives the draft's pinned bytes (weights, draft KV, widened buffers)
back to the resident-page pool; a *re-enable* pins them again. Families (DESIGN.md):

- when to eject: ``Onset`` (the fork's default: as soon as the working set no longer fits the
  draft-active capacity), ``KeepPages(n)`` (above n pages per layer), ``Never``, ``Always``;
- hysteresis wrappers: ``ReenablePages(policy, margin)`` (re-enable only once the working set
  sits ``margin`` pages below the eject threshold) and ``StableDecodes(policy, n)`` (no
  transition before n decode batches since the last one);
- ``Auto``: no threshold; compares the goodput (tokens/s) measured online in each state and
  probes the other state when its measurement is missing or stale, unless what is left of the
  decode is too short to pay for the transitions (their costs as measured in this decode).
  Below the onset it measures plain decoding in place (``MEASURE_PLAIN``), with no transition.

Policies never read config and hold no defaults of their own: the entry point builds them
(``build``) with every number given (``kvstream.config.PolicyConfig`` holds the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    STAY = "stay"
    EJECT = "eject"
    REENABLE = "reenable"
    # a few plain steps with the draft still pinned: where neither state streams (at or below
    # the onset) they run as an ejected draft's would, so they measure that state's goodput
    # without the cost of an eject and a re-enable
    MEASURE_PLAIN = "measure_plain"


@dataclass(frozen=True)
class Snapshot:
    """What an eject policy may look at after a decode batch."""

    pages_per_layer: int          # the context's pages per layer (the decode working set)
    capacity_with_draft: int      # resident pages per layer that fit with the draft pinned
    capacity_without_draft: int   # ... and without it
    draft_active: bool
    decodes_since_transition: int
    # Goodput (tokens/s) of each state as last measured (its steady rounds, plus a page
    # opening's cost once per page where it streams; the batches right after a transition are the
    # transition's), and the pages per layer when that was last updated (None: never measured).
    goodput_with: float | None = None
    goodput_with_pages: int | None = None
    goodput_without: float | None = None
    goodput_without_pages: int | None = None
    # What is left of the decode (None: unbounded) and the seconds the latest eject / re-enable
    # cost beyond their decode batches (re-layout, graph captures, the draft's catch-up; None:
    # none measured yet).
    tokens_left: int | None = None
    eject_s: float | None = None
    reenable_s: float | None = None
    # MEASURE_PLAIN can be carried out now: the draft is pinned and is the only speculator (with
    # others, the ejected state still speculates), no transition is being charged, its plain steps
    # all fit at or below the onset, and enough of the decode is left to use what they measure
    plain_in_place: bool = False


def _toward(snap: Snapshot, want_draft: bool) -> Action:
    """The action that moves the draft to the wanted state (STAY when it is already there)."""
    if want_draft == snap.draft_active:
        return Action.STAY
    return Action.REENABLE if want_draft else Action.EJECT


class Threshold:
    """Keep the draft up to ``threshold(snap)`` pages per layer, eject above (re-enable at or below)."""

    def threshold(self, snap: Snapshot) -> int:
        raise NotImplementedError

    def decide(self, snap: Snapshot) -> Action:
        return _toward(snap, snap.pages_per_layer <= self.threshold(snap))


@dataclass(frozen=True)
class KeepPages(Threshold):
    """A fixed threshold of ``pages`` pages per layer."""

    pages: int

    def __post_init__(self):
        assert self.pages >= 1, self

    def threshold(self, snap: Snapshot) -> int:
        return self.pages


@dataclass(frozen=True)
class Onset(Threshold):
    """Eject at the streaming onset: when the working set exceeds the draft-active capacity."""

    def threshold(self, snap: Snapshot) -> int:
        return snap.capacity_with_draft


@dataclass(frozen=True)
class Never:
    """Keep the draft whatever the context (re-enable it if something ejected it)."""

    def decide(self, snap: Snapshot) -> Action:
        return _toward(snap, True)


@dataclass(frozen=True)
class Always:
    """No draft: eject at once and never re-enable (plain decoding with the largest pool)."""

    def decide(self, snap: Snapshot) -> Action:
        return _toward(snap, False)


@dataclass(frozen=True)
class ReenablePages:
    """Re-enable only once the working set fits ``margin`` pages below the inner policy's
    threshold, so a context that hovers at the threshold does not flip every batch."""

    inner: Threshold
    margin: int

    def decide(self, snap: Snapshot) -> Action:
        action = self.inner.decide(snap)
        if action is Action.REENABLE and snap.pages_per_layer > self.inner.threshold(snap) - self.margin:
            return Action.STAY
        return action


@dataclass(frozen=True)
class StableDecodes:
    """No transition before ``n`` decode batches since the last one."""

    inner: object
    n: int

    def decide(self, snap: Snapshot) -> Action:
        action = self.inner.decide(snap)
        return Action.STAY if snap.decodes_since_transition < self.n else action


@dataclass(frozen=True)
class Auto:
    """Find the keep/eject crossover online, without a threshold.

    At or below the onset nothing streams, so keeping the draft costs no pages: want it (with
    ``trust_onset``; without it the goodputs are compared there too, for drafts that may not
    pay even when nothing streams, e.g. launch-bound eager draft steps). Above, compare the
    measured goodputs. A measurement is *fresh* when taken within ``probe_pages``
    pages of the current working set. Nothing is decided in the first ``measure_batches``
    batches of a stint (until then the current state's measurement is the previous stint's).
    After that: if the other state's measurement is missing or stale, switch to probe it; if
    both are fresh, switch only when the other beats the current one by more than ``min_gain``
    (relative). So above the onset transitions are at least ``measure_batches`` batches apart; a
    probe that finds the other state worse returns once and, its result now fresh, is not
    repeated until the context has moved ``probe_pages`` pages (or the current goodput has
    fallen ``min_gain`` below it); a context that stands still sees one probe at most.

    In the last page before the onset (anywhere below it without ``trust_onset``), with no fresh
    measurement of plain decoding, it asks for
    ``MEASURE_PLAIN``: plain steps with the draft still pinned. Nothing streams there in either
    state, so they run as an ejected draft's would. When the context then crosses the onset,
    that measurement stays fresh for ``probe_pages`` pages, and the comparison needs no probe. An
    eject and a re-enable cost tenths of a second (re-layouts, graph captures, the draft's
    catch-up); the plain steps cost only the tokens they do not draft.

    With ``horizon``, a transition must be able to pay for itself within the decode: the time
    left (``tokens_left`` at the current goodput) is compared with the measured transition
    costs. A probe that finds the other state worse costs an eject and a re-enable, and skipping
    it can lose at most the time left (minimax regret with no bound on the other state's
    goodput), so a probe is skipped when the time left is below their sum. A switch to a state
    measured better saves ``time left x (1 - current / other)`` and costs one transition. Costs
    not yet measured count as zero: the first probe of a decode is always made.
    """

    probe_pages: int      # a measurement is fresh within this many pages of the working set
    measure_batches: int  # decode batches in a state before its goodput is compared
    min_gain: float       # relative goodput gain needed to switch state
    trust_onset: bool     # keep the draft at or below the onset without comparing
    horizon: bool         # no transition the rest of the decode cannot pay for

    def __post_init__(self):
        assert self.probe_pages >= 1 and self.measure_batches >= 1 and self.min_gain >= 0, self

    def _fresh(self, snap: Snapshot, pages: int | None) -> bool:
        return pages is not None and abs(snap.pages_per_layer - pages) <= self.probe_pages

    def _pays(self, snap: Snapshot, cur: float, other: float | None) -> bool:
        """Whether the decode left can pay for switching (``other`` None: a probe)."""
        if not self.horizon or snap.tokens_left is None:
            return True
        left = snap.tokens_left / cur
        there, back = (snap.eject_s, snap.reenable_s) if snap.draft_active else (snap.reenable_s, snap.eject_s)
        if other is None:
            return left >= (there or 0.0) + (back or 0.0)
        return left * (1.0 - cur / other) >= (there or 0.0)

    def decide(self, snap: Snapshot) -> Action:
        below = snap.pages_per_layer <= snap.capacity_with_draft
        if below and snap.plain_in_place and snap.decodes_since_transition >= self.measure_batches \
                and not self._fresh(snap, snap.goodput_without_pages) \
                and (not self.trust_onset or snap.pages_per_layer == snap.capacity_with_draft):
            return Action.MEASURE_PLAIN
        if self.trust_onset and below:
            return _toward(snap, True)
        if snap.decodes_since_transition < self.measure_batches:
            return Action.STAY
        with_ = (snap.goodput_with, snap.goodput_with_pages)
        without = (snap.goodput_without, snap.goodput_without_pages)
        (cur, cur_pages), (other, other_pages) = (with_, without) if snap.draft_active else (without, with_)
        if cur is None or not self._fresh(snap, cur_pages):
            return Action.STAY  # no trustworthy number for where we are: nothing to compare
        if other is None or not self._fresh(snap, other_pages):
            switch, other = True, None  # probe
        else:
            switch = other > cur * (1.0 + self.min_gain)
        if switch and self._pays(snap, cur, other):
            return _toward(snap, not snap.draft_active)
        return Action.STAY


NAMES = ("onset", "keep_pages", "never", "always", "auto")  # build's names


def build(name: str, *, keep_pages: int | None, reenable_margin: int, stable_decodes: int, probe_pages: int,
          measure_batches: int, min_gain: float, trust_onset: bool, horizon: bool):
    """The eject policy ``name`` (one of ``NAMES``), wrapped in its hysteresis: ``ReenablePages``
    (``reenable_margin`` pages, threshold policies only) and ``StableDecodes`` (``stable_decodes``
    batches between transitions); 0 turns either off. ``keep_pages`` is read by ``keep_pages``
    only; ``probe_pages``, ``measure_batches``, ``min_gain``, ``trust_onset`` and ``horizon`` by
    ``auto`` only, which has no threshold (freshness and ``min_gain`` are its hysteresis).
    ``StableDecodes`` wraps ``auto`` too; with ``measure_batches >= stable_decodes`` it binds only
    at the onset, since ``measure_batches`` already spaces the transitions above it."""
    if name == "keep_pages":
        policy = KeepPages(keep_pages)
    elif name == "auto":
        policy = Auto(probe_pages, measure_batches, min_gain, trust_onset, horizon)
    else:
        policy = {"onset": Onset, "never": Never, "always": Always}[name]()
    if reenable_margin and isinstance(policy, Threshold):
        policy = ReenablePages(policy, reenable_margin)
    if stable_decodes:
        policy = StableDecodes(policy, stable_decodes)
    return policy
