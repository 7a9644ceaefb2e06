"""Page residency: which logical pages of the context stay in the arena's page pool.

A policy is a pure function of the page count and the pool capacity (pages per layer). The
pages being written this step are always resident (the engine requires it); the others stream
from the host store through the ring. Residency is the same for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_step(step: int) -> None:
    if step < 1:
        raise ValueError(f"residency step {step}: give a whole number of pages >= 1")


def _first_newest(low: int, need: int, step: int, room: int) -> int:
    """The first of the newest pages: ``need`` (evictions forced by the capacity) rounded up to
    a multiple of ``step`` above ``low``. A step beyond ``room`` (the pool slots the newest pages
    share) acts as ``room``: larger, the newest page alone would be resident for several pages."""
    step = max(1, min(step, room))
    return low + -(-max(0, need - low) // step) * step


@dataclass(frozen=True)
class NewestResident:
    """Keep the newest pages: decode writes there, and the tail is what a rollback touches.

    ``step``: the oldest resident pages leave ``step`` at a time, so the streamed set (and with
    it a captured step's copies) changes once per ``step`` new pages instead of each one, at
    the price of up to ``step - 1`` pool slots left empty until new pages fill them (a step
    beyond the capacity acts as the capacity)."""

    step: int = 1

    def __post_init__(self):
        _check_step(self.step)

    def resident(self, n_pages: int, capacity: int) -> range:
        return range(_first_newest(0, n_pages - capacity, self.step, capacity), n_pages)


@dataclass(frozen=True)
class SinkAndNewest:
    """Keep the first ``sink_pages`` pages and the newest ones (attention sinks stay on device);
    ``step`` as for ``NewestResident``."""

    sink_pages: int = 1
    step: int = 1

    def __post_init__(self):
        _check_step(self.step)

    def resident(self, n_pages: int, capacity: int) -> list[int]:
        sinks = min(self.sink_pages, max(0, capacity - 1), n_pages)  # the tail always gets a slot
        newest = range(_first_newest(sinks, n_pages - (capacity - sinks), self.step, capacity - sinks), n_pages)
        return list(range(sinks)) + list(newest)


RESIDENCY = {"newest": NewestResident, "sink_newest": SinkAndNewest}
