"""Page residency: which logical pages of the context stay in the arena's page pool.

A policy is a pure function of the page count and the pool capacity (pages per layer). The
pages being written this step are always resident (the engine requires it); the others stream
from the host store through the ring. Residency is the same for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NewestResident:
    """Keep the newest pages: decode writes there, and the tail is what a rollback touches."""

    def resident(self, n_pages: int, capacity: int) -> range:
        return range(max(0, n_pages - capacity), n_pages)


@dataclass(frozen=True)
class SinkAndNewest:
    """Keep the first ``sink_pages`` pages and the newest ones (attention sinks stay on device)."""

    sink_pages: int = 1

    def resident(self, n_pages: int, capacity: int) -> list[int]:
        sinks = min(self.sink_pages, max(0, capacity - 1), n_pages)  # the tail always gets a slot
        newest = range(max(sinks, n_pages - (capacity - sinks)), n_pages)
        return list(range(sinks)) + list(newest)


RESIDENCY = {"newest": NewestResident, "sink_newest": SinkAndNewest}
