"""Per-step telemetry: what one forward pass moved and how long it took."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kernels.formats import PAGE_TOKENS


@dataclass
class StepStats:
    """What a cache did in the last forward pass (filled by the cache)."""

    streamed_pages: int = 0  # per layer
    resident_pages: int = 0  # per layer
    rounds: int = 0          # ring rounds per layer
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    # ns the compute stream waited for (or ran) transfers; None: not timed (kvstream.cache.wait_clock),
    # or on CUDA not read yet, while ``clock`` is set: ``wait_s`` reads it
    wait_ns: int | None = 0
    clock: object = field(default=None, repr=False, compare=False)
    # a new streaming plan in this pass: "plan" (made; eager), "update" (a captured step's copies
    # re-pointed), "capture" (a step captured); plan_s: the host seconds it took
    plan_change: str = ""
    plan_s: float = 0.0

    @property
    def wait_s(self) -> float | None:
        if self.clock is not None:
            self.clock.resolve(self)
        return None if self.wait_ns is None else self.wait_ns / 1e9


@dataclass
class StepRecord:
    """One decode step, as DESIGN.md's telemetry lists it (speculation fields come with drafts)."""

    step: int
    context: int          # tokens in the cache after the step
    pages_per_layer: int
    resident_pages: int
    streamed_pages: int
    rounds: int
    h2d_bytes: int
    d2h_bytes: int
    new_tokens: int       # tokens this step added (1 + accepted draft tokens)
    step_s: float         # the whole step: drafting, verification, acceptance
    verify_width: int = 1  # tokens of the target's forward pass (1 + drafted)
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0  # seconds the speculator chain spent proposing
    draft_active: bool = False  # a draft model is pinned (not ejected) during the step
    speculator: str = ""  # the chain's winner, if any
    plain_measure: bool = False  # a plain step measuring the ejected state, the draft pinned (MEASURE_PLAIN)
    plan_change: str = ""  # StepStats.plan_change of the target pass
    plan_s: float = 0.0  # its host seconds
    stats: StepStats | None = field(default=None, repr=False, compare=False)  # the target pass's: its wait

    @classmethod
    def of(cls, step: int, cache, new_tokens: int, step_s: float, *, context: int | None = None,
           stats: StepStats | None = None, **spec) -> "StepRecord":
        """The cache's state after the step; ``context`` / ``stats`` when the cache has already
        moved on (a next step queued ahead)."""
        s = stats or cache.stats
        n = cache.length if context is None else context
        return cls(step, n, -(-n // PAGE_TOKENS), s.resident_pages, s.streamed_pages, s.rounds,
                   s.h2d_bytes, s.d2h_bytes, new_tokens, step_s, plan_change=s.plan_change, plan_s=s.plan_s,
                   stats=s, **spec)

    @property
    def wait_s(self) -> float | None:
        """Seconds of the step's target pass spent waiting for (or running) transfers, in device
        time on CUDA (read when asked: the device may still be running the step); None: not timed."""
        return self.stats.wait_s if self.stats is not None else None

    @property
    def target_s(self) -> float:
        """The rest of the step: the target's forward pass, sampling and the host's own work (and
        the wait, where it was not timed). On CUDA with the host a step ahead, ``step_s`` is a host
        interval and ``wait_s`` device time: compare sums over steps, not single steps."""
        return self.step_s - self.draft_s - (self.wait_s or 0.0)

    def row(self) -> dict:
        """The record as a table row: its fields, then the step-time split's wait and target parts."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stats"}
        return d | {"wait_s": self.wait_s, "target_s": self.target_s}
