"""Carrying out eject / re-enable decisions on a draft pinned in the target's arena.

After every decode batch the engine calls ``after_step``: it measures goodput in the current
state, builds the policy's ``Snapshot`` and, on EJECT, gives the draft's pinned bytes (weights,
draft KV and its compute slab) back to the target's page pool; on REENABLE it pins them again
from the host copy. Both re-lay the target's arena (``PagedCache.rearrange``): the pool grows or
shrinks by the draft's bytes and resident pages are re-uploaded from the host store.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

from kernels.formats import PAGE_TOKENS
from policies.eject import Action, Snapshot

GOODPUT_MIN = 4  # steady batches in a state before its goodput counts as measured
CHARGED = 2      # batches after a transition charged to it (graph captures, the draft's catch-up), not to the state


@dataclass
class Transition:
    step: int
    action: str
    pages_per_layer: int
    capacity_before: int  # resident pages per layer before / after the re-layout
    capacity_after: int
    seconds: float
    h2d_bytes: int  # host->device bytes: the target's resident pages; re-enabling, the draft's weights and KV too
    # the first batches after it beyond the new state's measured rate (graph captures, the draft's
    # catch-up); None until that rate is measured
    after_s: float | None = None

    @property
    def cost_s(self) -> float | None:
        return None if self.after_s is None else self.seconds + self.after_s


class _Meter:
    """Goodput over the latest batches that hold at least a page of tokens: tokens / seconds, so
    that costs paid once per page (graphs re-captured when a streaming plan's copies change, a
    page written back) count as they do in a long decode."""

    def __init__(self):
        self.batches: deque[tuple[int, float]] = deque()
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.batches.append((tokens, seconds))
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        while self.tokens - self.batches[0][0] >= PAGE_TOKENS:
            n, s = self.batches.popleft()
            self.tokens, self.seconds = self.tokens - n, self.seconds - s

    def clear(self) -> None:
        self.__init__()

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


class DraftControl:
    """Pins ``draft`` into ``cache``'s arena and applies ``policy`` after each decode batch."""

    def __init__(self, draft, cache, policy):
        if not hasattr(cache, "rearrange"):
            raise ValueError("a draft model is pinned in the arena: use cache.mode=resident or stream")
        self.draft, self.cache, self.policy = draft, cache, policy
        cache.rearrange(lambda: draft.pin(cache.arena))
        self.bytes = draft.pinned_bytes
        self._caps = None  # (layout, (with, without)): see _capacities
        self.since = 1 << 30  # no transition yet: hysteresis must not hold off the first one
        self.streaming = False  # the working set exceeds the draft-active capacity
        self.meter = {True: _Meter(), False: _Meter()}
        self.measured: dict[bool, tuple[float | None, int | None]] = {True: (None, None), False: (None, None)}
        self.transitions: list[Transition] = []
        self._after: list[tuple[int, float]] = []  # (tokens, seconds) of the batches since the latest transition

    @property
    def active(self) -> bool:
        return self.draft.enabled

    def _capacities(self) -> tuple[int, int]:
        """(with, without) the draft for the current layout (the prefill slab is larger than the
        decode one, so they change at the phase switch): the state we are in is measured, the
        other computed; recomputed only when the layout changes, not every decode batch."""
        layout = self.cache.layout
        if self._caps is None or self._caps[0] is not layout:
            cap = self.cache.capacity
            other = self.cache.capacity_with(self.bytes if not self.active else -self.bytes)
            self._caps = (layout, (cap, other) if self.active else (other, cap))
        return self._caps[1]

    @property
    def capacity_with(self) -> int:
        return self._capacities()[0]

    @property
    def capacity_without(self) -> int:
        return self._capacities()[1]

    def cost(self, action: str) -> float | None:
        """Seconds the latest measured ``action`` ("eject" / "reenable") cost (None: none yet)."""
        return next((t.cost_s for t in reversed(self.transitions) if t.action == action and t.cost_s is not None),
                    None)

    def snapshot(self, length: int | None = None, tokens_left: int | None = None) -> Snapshot:
        pages = -(-(self.cache.length if length is None else length) // PAGE_TOKENS)
        return Snapshot(pages, self.capacity_with, self.capacity_without, self.active, self.since,
                        *self.measured[True], *self.measured[False], tokens_left, self.cost("eject"),
                        self.cost("reenable"))

    def _charge_transition(self) -> None:
        """Once the state entered by the latest transition has a measured rate, charge the
        transition with what its first ``CHARGED`` batches took beyond that rate."""
        rate = self.measured[self.active][0]
        if self.transitions and self.transitions[-1].after_s is None:
            self.transitions[-1].after_s = sum(max(0.0, s - n / rate) for n, s in self._after)

    def after_step(self, step: int, new_tokens: int, step_s: float, length: int | None = None,
                   tokens_left: int | None = None) -> Action:
        """Record one decode batch; apply the policy's decision. Returns it. ``length``: the
        context after the batch, when the cache holds a next step queued ahead; ``tokens_left``:
        what the decode has still to generate (None: unbounded)."""
        length = self.cache.length if length is None else length
        pages = -(-length // PAGE_TOKENS)
        if (pages > self.capacity_with) != self.streaming:  # crossed the onset: earlier batches tell nothing
            self.streaming = not self.streaming
            for state in (True, False):
                self.meter[state].clear()
                self.measured[state] = (None, None)
        m = self.meter[self.active]
        if self.since >= CHARGED:
            m.add(new_tokens, step_s)
        else:
            self._after.append((new_tokens, step_s))
        if len(m) >= GOODPUT_MIN:
            self.measured[self.active] = (m.rate, pages)
            self._charge_transition()
        self.since += 1
        snap = self.snapshot(length, tokens_left)
        action = self.policy.decide(snap)
        if action is Action.STAY:
            return action
        before, t0 = self.cache.capacity, time.perf_counter()
        self.cache.stats.h2d_bytes = 0
        if self.draft.cache is not None:
            self.draft.cache.stats.h2d_bytes = 0
        if action is Action.EJECT:
            self.cache.rearrange(lambda: self.draft.eject(self.cache.arena))
        else:
            self.cache.rearrange(lambda: self.draft.pin(self.cache.arena))
        moved = self.cache.stats.h2d_bytes
        if action is Action.REENABLE:  # the draft's weights and KV pages came back too
            moved += self.draft.host.nbytes + self.draft.cache.stats.h2d_bytes
        self.transitions.append(Transition(step, action.value, snap.pages_per_layer, before, self.cache.capacity,
                                           time.perf_counter() - t0, moved))
        self.since = 0
        self.meter[self.active].clear()
        self._after = []
        return action

    def transitions_rows(self) -> list[dict]:
        return [asdict(t) for t in self.transitions]

    def count(self, action: str) -> int:
        return sum(t.action == action for t in self.transitions)
