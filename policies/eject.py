"""Draft eject / re-enable policies: pure decisions over a telemetry snapshot.

The engine hands a :class:`Snapshot` after every decode batch and carries out the returned
:class:`Action`. An *eject* gives the draft's pinned bytes (weights, draft KV, widened buffers)
back to the resident-page pool; a *re-enable* pins them again. Families (DESIGN.md):

- when to eject: ``Onset`` (the fork's default: as soon as the working set no longer fits the
  draft-active capacity), ``KeepPages(n)`` (above n pages per layer), ``Never``, ``Always``;
- hysteresis wrappers: ``ReenablePages(policy, margin)`` (re-enable only once the working set
  sits ``margin`` pages below the eject threshold) and ``StableDecodes(policy, n)`` (no
  transition before n decode batches since the last one).

Policies never read config; the entry point builds them (``build``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    STAY = "stay"
    EJECT = "eject"
    REENABLE = "reenable"


@dataclass(frozen=True)
class Snapshot:
    """What an eject policy may look at after a decode batch."""

    pages_per_layer: int          # the context's pages per layer (the decode working set)
    capacity_with_draft: int      # resident pages per layer that fit with the draft pinned
    capacity_without_draft: int   # ... and without it
    draft_active: bool
    decodes_since_transition: int


def _toward(snap: Snapshot, want_draft: bool) -> Action:
    """The action that moves the draft to the wanted state (STAY when it is already there)."""
    if want_draft == snap.draft_active:
        return Action.STAY
    return Action.REENABLE if want_draft else Action.EJECT


@dataclass(frozen=True)
class KeepPages:
    """Keep the draft up to ``pages`` pages per layer, eject above (re-enable at or below)."""

    pages: int

    def threshold(self, snap: Snapshot) -> int:
        return self.pages

    def decide(self, snap: Snapshot) -> Action:
        return _toward(snap, snap.pages_per_layer <= self.threshold(snap))


@dataclass(frozen=True)
class Onset(KeepPages):
    """Eject at the streaming onset: when the working set exceeds the draft-active capacity."""

    pages: int = 0  # unused: the threshold is the snapshot's draft-active capacity

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

    inner: KeepPages
    margin: int = 8

    def decide(self, snap: Snapshot) -> Action:
        action = self.inner.decide(snap)
        if action is Action.REENABLE and snap.pages_per_layer > self.inner.threshold(snap) - self.margin:
            return Action.STAY
        return action


@dataclass(frozen=True)
class StableDecodes:
    """No transition before ``n`` decode batches since the last one."""

    inner: object
    n: int = 4

    def decide(self, snap: Snapshot) -> Action:
        action = self.inner.decide(snap)
        return Action.STAY if snap.decodes_since_transition < self.n else action


def build(name: str, *, keep_pages: int = 0, reenable_margin: int = 8, stable_decodes: int = 4):
    """An eject policy by config name, wrapped in the default hysteresis (margin pages below
    the threshold to re-enable, ``stable_decodes`` batches between transitions; 0 turns each
    off). Names: onset, keep_pages, never, always."""
    base = {"onset": Onset(), "keep_pages": KeepPages(keep_pages), "never": Never(), "always": Always()}
    if name not in base:
        raise ValueError(f"policy.eject={name!r}; choose one of {', '.join(base)}")
    if name == "keep_pages" and keep_pages < 1:
        raise ValueError(f"policy.keep_pages must be >= 1 pages per layer for keep_pages, got {keep_pages}")
    policy = base[name]
    if reenable_margin and isinstance(policy, KeepPages):
        policy = ReenablePages(policy, reenable_margin)
    if stable_decodes:
        policy = StableDecodes(policy, stable_decodes)
    return policy
