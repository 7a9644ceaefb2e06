"""Speculator chain order: who the chain asks first, a pure decision over per-speculator stats.

The chain asks its speculators in order and the first non-empty draft wins
(``kvstream/speculators/chain.py``), so the order decides who drafts. The engine hands a
:class:`ChainSnapshot` (the current order and each speculator's counters) and reorders the
chain to ``decide(snap)``, a permutation of ``snap.names``. Families (DESIGN.md, "Policies"):

- ``Fixed()``: the configured order;
- ``ByGoodput(min_calls)``: accepted tokens per second of drafting time, best first.

Policies never read config; the entry point builds them (``build``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

# Drafting seconds charged per call to a speculator that reports less (an n-gram lookup
# reports 0). Far below any real drafting cost, so a free speculator that gets tokens accepted
# ranks ahead of every timed one (asking it first costs nothing: on a miss the chain falls
# through), and free ones rank among themselves by accepted tokens per call.
EPS_S = 1e-9

_NEVER_CALLED = (0, 0, 0, 0.0)


@dataclass(frozen=True)
class ChainSnapshot:
    """What a chain-order policy may look at."""

    names: tuple[str, ...]  # the current order
    # name -> (calls, drafted tokens, accepted tokens, seconds spent drafting); a name
    # missing here counts as never called
    stats: Mapping[str, tuple[int, int, int, float]]


@dataclass(frozen=True)
class Fixed:
    """Keep the configured order."""

    def decide(self, snap: ChainSnapshot) -> list[str]:
        return list(snap.names)


@dataclass(frozen=True)
class ByGoodput:
    """Order by accepted tokens per second of drafting time, best first (``score``).

    A speculator with fewer than ``min_calls`` calls keeps its slot, so it is tried as often
    as the configured order would try it before numbers this small can demote it; the others
    are sorted into the remaining slots. Ties keep the current order, so equal speculators
    never swap back and forth.
    """

    min_calls: int = 8

    def __post_init__(self):
        if self.min_calls < 0:
            raise ValueError(f"chain order by_goodput needs min_calls >= 0, got {self.min_calls}")

    @staticmethod
    def score(stats: tuple[int, int, int, float]) -> float:
        calls, _, accepted, seconds = stats
        return accepted / max(seconds, max(calls, 1) * EPS_S)

    def decide(self, snap: ChainSnapshot) -> list[str]:
        stats = {n: snap.stats.get(n, _NEVER_CALLED) for n in snap.names}
        ready = [n for n in snap.names if stats[n][0] >= self.min_calls]
        ranked = iter(sorted(ready, key=lambda n: -self.score(stats[n])))  # stable: ties keep the order
        return [next(ranked) if stats[n][0] >= self.min_calls else n for n in snap.names]


POLICIES = {"fixed": Fixed, "by_goodput": ByGoodput}


def build(name: str, **kw):
    """A chain-order policy by config name with its keyword arguments (fixed: none;
    by_goodput: min_calls)."""
    if name not in POLICIES:
        raise ValueError(f"policy.chain_order={name!r}; choose one of {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**kw)
    except TypeError as e:  # an unknown keyword: say which policy it was for
        raise ValueError(f"policy.chain_order={name}: {e}") from None
