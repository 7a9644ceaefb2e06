"""Carrying out eject / re-enable decisions on a draft pinned in the target's arena.

After every decode batch the engine calls ``after_step``: it measures goodput in the current
state, builds the policy's ``Snapshot`` and, on EJECT, gives the draft's pinned bytes (weights,
draft KV and its compute slab) back to the target's page pool; on REENABLE it pins them again
from the host copy. Both re-lay the target's arena (``PagedCache.rearrange``): the pool grows or
shrinks by the draft's bytes and resident pages are re-uploaded from the host store.

Below the onset the policy may ask for ``MEASURE_PLAIN`` instead: a few plain steps with the
draft still pinned. Nothing streams there in either state, so those steps measure the
ejected state's goodput with no re-layout. The engine then drafts nothing (``plain``).

Goodput per state is measured as steady rounds plus a cost per page. The steady part is the mean
tokens per batch over the median batch time of the state's latest batches, so a lone slow batch
(a verify width captured late) does not count. The batches right after a transition are charged
to the transition instead. The per-page part is paid by a state that streams pages: a streaming
plan changes when a page opens (the plan, the captured copies re-pointed; a capture where the
step's shape changes). It is measured on the batches that open a page and applied to whichever
state streams (until a page opens, an eject's capture cost stands in for it), on the target's part of those batches: the draft's own slow batches (its window
restarts, ~0.1 s) are not page costs, and one landing on an opening would make a paying draft
look slow. A probe is too short to meet a page boundary, and a long stint meets one per page:
measured over a window, the two states would not compare alike.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from statistics import median

from kernels.formats import PAGE_TOKENS
from policies.eject import Action, Snapshot

from kvstream.telemetry import StepStats

GOODPUT_WINDOW = 16  # decode batches a state's steady rate looks at
GOODPUT_MIN = 4      # steady batches in a state before its goodput counts as measured
CHARGED = 2          # batches after a transition charged to it (graph captures, the draft's catch-up), not to the state
PAGE_SAMPLES = 8     # residency steps of page openings the per-page cost is the mean of
PLAIN_CHARGED = 1    # a plain measurement's first batch, not measured: its step was not queued ahead yet


@dataclass
class Transition:
    step: int
    action: str
    pages_per_layer: int
    capacity_before: int  # resident pages per layer before / after the re-layout
    capacity_after: int
    seconds: float
    h2d_bytes: int  # host->device bytes: the target's resident pages; re-enabling, the draft's weights and KV too
    # what the first CHARGED batches after it took beyond the new state's steady rate (graph
    # captures, the draft's catch-up); None until that rate is measured
    after_s: float | None = None

    @property
    def cost_s(self) -> float | None:
        return None if self.after_s is None else self.seconds + self.after_s


class DraftControl:
    """Pins ``draft`` into ``cache``'s arena and applies ``policy`` after each decode batch."""

    def __init__(self, draft, cache, policy, *, measure_in_place: bool = True):
        """``measure_in_place``: plain steps with the draft pinned measure the ejected state (the
        draft is the chain's only speculator; with others, the ejected state still speculates)."""
        if not hasattr(cache, "rearrange"):
            raise ValueError("a draft model is pinned in the target's arena, and the contiguous cache has none: "
                             "use cache=resident or cache=stream")
        self.draft, self.cache, self.policy = draft, cache, policy
        self.measure_in_place = measure_in_place
        cache.rearrange(lambda: draft.pin(cache.arena))
        self.bytes = draft.pinned_bytes
        self._caps = None  # (layout, (with, without)): see _capacities
        self.since = 1 << 30  # no transition yet: hysteresis must not hold off the first one
        self.streaming = {True: False, False: False}  # per state: the working set exceeds its capacity
        self.plain_left = 0  # batches left in a plain measurement (MEASURE_PLAIN)
        self._resumed = False  # the next batch is the first drafting round after one: its catch-up is not a steady round
        self.plains: list[dict] = []  # the plain measurements made: step, pages per layer
        # per state: (tokens, seconds, the draft's seconds) of its latest batches
        self.meter = {True: deque(maxlen=GOODPUT_WINDOW), False: deque(maxlen=GOODPUT_WINDOW)}
        # seconds a page opening took beyond the steady rate; whole residency steps of them (one
        # opening in a step changes the plan), so the mean counts the same number of plan changes
        self.residency_step = getattr(getattr(cache, "residency", None), "step", 1)
        self.page_costs: deque[float] = deque(maxlen=PAGE_SAMPLES * self.residency_step)
        self._pages: int | None = None  # pages per layer of the latest step launched, after the previous batch
        self.measured: dict[bool, tuple[float | None, int | None]] = {True: (None, None), False: (None, None)}
        self.transitions: list[Transition] = []
        self._after: list[tuple[int, float]] = []  # (tokens, seconds) of the batches since the latest transition

    @property
    def active(self) -> bool:
        return self.draft.enabled

    @property
    def plain(self) -> bool:
        """A plain measurement runs: the engine drafts nothing, and the draft stays pinned."""
        return self.plain_left > 0

    def _capacities(self) -> tuple[int, int]:
        """(with, without) the draft for the current layout (the prefill slab is larger than the
        decode one, so they change at the phase switch): the state we are in is measured, the
        other computed; recomputed only when the layout changes, not every decode batch."""
        layout = self.cache.layout
        if self._caps is None or self._caps[0] is not layout:
            cap = self.cache.capacity
            other = self.cache.capacity_if_pinned(self.bytes if not self.active else -self.bytes)
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

    @property
    def page_s(self) -> float:
        """Seconds a streaming state pays once per page.

        - It is the mean of the latest page openings. With ``cache.residency_step`` k, one
          opening in k changes the plan and the others cost nothing.
        - Until k openings are measured, the missing ones count as nothing. The first opening
          after a plan change is the one that pays, so one plan change measured stands for one
          page in k, not every page.
        - Before the first opening, the stand-in is what the latest eject's first batches cost
          beyond the plain rate, over k (graphs captured for a new layout: an upper bound on a
          page opening's plan change; undivided, it would charge a kept draft on every page
          instead of one in k).
        - With neither, 0."""
        if self.page_costs:
            return max(0.0, sum(self.page_costs) / max(len(self.page_costs), self.residency_step))
        return next((t.after_s / self.residency_step for t in reversed(self.transitions)
                     if t.action == "eject" and t.after_s is not None), 0.0)

    def _streams(self, state: bool, pages: int) -> bool:
        """Whether ``state`` (draft pinned or not) streams pages at ``pages`` pages per layer."""
        return pages > (self.capacity_with if state else self.capacity_without)

    def goodput(self, state: bool, pages: int) -> tuple[float | None, int | None]:
        """(tokens/s, pages when measured) of ``state`` at ``pages`` pages per layer: its steady
        rate, plus ``page_s`` per page of tokens where that state streams."""
        rate, at = self.measured[state]
        if rate is None or not self._streams(state, pages):
            return rate, at
        return 1.0 / (1.0 / rate + self.page_s / PAGE_TOKENS), at

    def snapshot(self, length: int | None = None, tokens_left: int | None = None) -> Snapshot:
        length = self.cache.length if length is None else length
        pages, n = -(-length // PAGE_TOKENS), PLAIN_CHARGED + GOODPUT_MIN
        # every plain step, and the one queued after the last, inside the onset's page or below: they must
        # not stream (they would measure the pinned draft's streaming, not the ejected state); and at least
        # as much decode left after them as they take, to use what they measure
        in_place = self.measure_in_place and self.active and not self.plain and self.since > CHARGED and \
            length + n + 1 <= self.capacity_with * PAGE_TOKENS and (tokens_left is None or tokens_left > 2 * n)
        return Snapshot(pages, self.capacity_with, self.capacity_without, self.active, self.since,
                        *self.goodput(True, pages), *self.goodput(False, pages), tokens_left, self.cost("eject"),
                        self.cost("reenable"), in_place)

    def _steady(self, state: bool) -> tuple[float, float] | None:
        """(median batch seconds, mean tokens per batch) of ``state``'s latest batches."""
        m = self.meter[state]
        seconds = median(s for _, s, _ in m) if len(m) >= GOODPUT_MIN else 0.0
        return (seconds, sum(n for n, _, _ in m) / len(m)) if seconds > 0 else None

    def _record(self, new_tokens: int, step_s: float, pages: int, state: bool, measured: bool = True,
                draft_s: float = 0.0) -> None:
        """One batch into ``state``'s measurements (``measured`` False: into nobody's), or into
        the latest transition's. A page opens in the batch that launched the step writing its
        first row: with a plain step queued ahead (run-ahead), the batch before the one whose
        context enters the page."""
        launched = max(pages, -(-self.cache.length // PAGE_TOKENS))
        opens, self._pages = self._pages is not None and launched > self._pages, launched
        if not measured:
            return
        if self.since < CHARGED:
            self._after.append((new_tokens, step_s))
            return
        m = self.meter[state]
        if opens and len(m) >= GOODPUT_MIN and self._streams(state, pages):  # the target's part, beyond its median
            self.page_costs.append(step_s - draft_s - median(s - d for _, s, d in m))
        m.append((new_tokens, step_s, draft_s))
        steady = self._steady(state)
        if steady is None:
            return
        rate = steady[1] / steady[0]
        self.measured[state] = (rate, pages)
        if state == self.active and self.transitions and self.transitions[-1].after_s is None:  # the transition into it
            self.transitions[-1].after_s = max(0.0, sum(s - n / rate for n, s in self._after))

    def after_step(self, step: int, new_tokens: int, step_s: float, length: int | None = None,
                   tokens_left: int | None = None, draft_s: float = 0.0) -> Action:
        """Record one decode batch; apply the policy's decision. Returns it. ``length``: the
        context after the batch, when the cache holds a next step queued ahead; ``tokens_left``:
        what the decode has still to generate (None: unbounded); ``draft_s``: the draft's part of
        ``step_s``."""
        length = self.cache.length if length is None else length
        pages = -(-length // PAGE_TOKENS)
        flipped = False
        for state in (True, False):  # a state that starts or stops streaming: its earlier batches tell nothing
            if self._streams(state, pages) != self.streaming[state]:
                self.streaming[state] = not self.streaming[state]
                self.meter[state].clear()
                self.measured[state] = (None, None)
                flipped = True
        if flipped and (not self.transitions or self.transitions[-1].after_s is not None):  # none pending a charge
            self._after = []
        if self.plain_left:  # a plain measurement: the batches of the ejected state, the draft pinned
            self.plain_left -= 1
            self._record(new_tokens, step_s, pages, False, measured=self.plain_left < GOODPUT_MIN)
            self._resumed = self.plain_left == 0
            self.since += 1
            return Action.STAY
        self._record(new_tokens, step_s, pages, self.active, measured=not self._resumed, draft_s=draft_s)
        self._resumed = False
        self.since += 1
        if tokens_left == 0:  # the decode is over: a transition now would only cost
            return Action.STAY
        snap = self.snapshot(length, tokens_left)
        action = self.policy.decide(snap)
        if action is Action.MEASURE_PLAIN:
            if not snap.plain_in_place:
                raise RuntimeError(f"{self.policy} asked for a plain measurement the snapshot said cannot be made")
            self.plain_left = PLAIN_CHARGED + GOODPUT_MIN
            self.meter[False].clear()  # this measurement's batches alone: earlier ones were at another context
            self.plains.append({"step": step, "action": action.value, "pages_per_layer": snap.pages_per_layer})
            return action
        if action is Action.STAY:
            return action
        before, t0 = self.cache.capacity, time.perf_counter()
        # the transition's bytes in stats of their own: the caches' current ones may be those of a
        # step already queued ahead, whose record must keep its own count
        caches = [c for c in (self.cache, self.draft.cache) if c is not None]
        kept = [c.stats for c in caches]
        for c in caches:
            c.stats = StepStats()
        try:
            if action is Action.EJECT:
                self.cache.rearrange(lambda: self.draft.eject(self.cache.arena))
            else:
                self.cache.rearrange(lambda: self.draft.pin(self.cache.arena))
            moved = self.cache.stats.h2d_bytes
            if action is Action.REENABLE:  # the draft's weights and KV pages came back too
                moved += self.draft.host_nbytes + self.draft.cache.stats.h2d_bytes
        finally:
            for c, st in zip(caches, kept):
                c.stats = st
        self.transitions.append(Transition(step, action.value, snap.pages_per_layer, before, self.cache.capacity,
                                           time.perf_counter() - t0, moved))
        self.since = 0
        self.meter[self.active].clear()
        self._after = []
        return action

    def transitions_rows(self) -> list[dict]:
        """The transitions and the plain measurements, in step order."""
        return sorted([asdict(t) for t in self.transitions] + self.plains, key=lambda r: r["step"])

    def count(self, action: str) -> int:
        return sum(r["action"] == action for r in self.transitions_rows())
