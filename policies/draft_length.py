"""Draft length: how many tokens to draft next round, a pure decision over a snapshot.

The engine hands a :class:`LengthSnapshot` before each round and asks the chain for
``decide(snap)`` tokens (never more than ``n_max``; 0 only when ``n_max`` is 0). Families
(DESIGN.md, "Policies"):

- ``Fixed(n)``: always n;
- ``Heuristic(n_min, start)``: +2 after a wholly accepted draft, -1 otherwise (the schedule of
  llama.cpp and of HF assisted generation);
- ``Goodput()``: the n that maximises expected tokens per second, from the measured
  acceptance, verify time per width and draft time per token.

Policies never read config; the entry point builds them (``build``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

_MIN_STEP_S = 1e-9  # floor on a modelled round's time: an extrapolation may reach 0 s


@dataclass(frozen=True)
class LengthSnapshot:
    """What a draft-length policy may look at before a round."""

    n_max: int                          # the engine's cap on a draft's length
    last_drafted: int                   # tokens drafted last round (0: the chain proposed nothing)
    last_accepted: int                  # ... of which the target kept this many
    acceptance: float | None            # running per-token acceptance rate of the draft (None: unknown)
    target_step_s: Mapping[int, float]  # verify seconds per width (1 + n tokens), widths measured so far
    draft_token_s: float | None         # draft seconds per drafted token (None: unmeasured; 0.0: free)
    current: int                        # the length used last round (0: no round yet)


def _clamp(n: int, lo: int, n_max: int) -> int:
    return max(min(lo, n_max), min(n, n_max))


def _current(snap: LengthSnapshot) -> int:
    """Last round's length, or ``n_max`` before the first round."""
    return _clamp(snap.current if snap.current > 0 else snap.n_max, 1, snap.n_max)


def expected_tokens(acceptance: float, n: int) -> float:
    """Tokens a round keeps from an n-token draft when each draft token is accepted with
    probability ``acceptance`` given its predecessors were: 1 + a + ... + a**n (the target's
    correction or bonus token included)."""
    if acceptance >= 1.0:
        return n + 1.0
    return (1.0 - acceptance ** (n + 1)) / (1.0 - acceptance)


def verify_time(target_step_s: Mapping[int, float], width: int) -> float | None:
    """Verify seconds at ``width`` from the measured widths: the measurement itself, else linear
    between the neighbouring measured widths, else linear from the two nearest ones with the
    slope clipped at 0 (noise must not make wider verifies look cheaper) and the time at 0.
    None with fewer than two measured widths."""
    t = target_step_s
    if width in t:
        return t[width]
    widths = sorted(t)
    if len(widths) < 2:
        return None
    if widths[0] < width < widths[-1]:
        w1 = next(w for w in widths if w > width)
        w0 = widths[widths.index(w1) - 1]
        return t[w0] + (t[w1] - t[w0]) * (width - w0) / (w1 - w0)
    w0, w1 = widths[:2] if width < widths[0] else widths[-2:]
    near = w0 if width < w0 else w1
    slope = max(0.0, (t[w1] - t[w0]) / (w1 - w0))
    return max(0.0, t[near] + slope * (width - near))


@dataclass(frozen=True)
class Fixed:
    """Always ``n`` tokens (capped at ``n_max``)."""

    n: int
    static = True  # (not a field) no round's outcome changes it: the engine may launch a round before the last one's readback

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"draft length fixed needs n >= 1, got {self.n}")

    def decide(self, snap: LengthSnapshot) -> int:
        return _clamp(self.n, 1, snap.n_max)


@dataclass(frozen=True)
class Heuristic:
    """+2 when the whole last draft was accepted, -1 otherwise, within [n_min, n_max]. The first
    round drafts ``start`` (None: ``n_max``); a round without a draft leaves the length alone
    (it says nothing about how long a draft could be)."""

    n_min: int = 1
    start: int | None = None

    def __post_init__(self):
        if self.n_min < 1 or (self.start is not None and self.start < 1):
            raise ValueError(f"draft length heuristic needs n_min >= 1 and start >= 1 (or None), "
                             f"got n_min={self.n_min}, start={self.start}")

    def decide(self, snap: LengthSnapshot) -> int:
        if snap.current <= 0:
            n = snap.n_max if self.start is None else self.start
        elif snap.last_drafted == 0:
            n = snap.current
        elif snap.last_accepted == snap.last_drafted:
            n = snap.current + 2
        else:
            n = snap.current - 1
        return _clamp(n, self.n_min, snap.n_max)


@dataclass(frozen=True)
class Goodput:
    """The n in 1..n_max with the most expected tokens per second: ``expected_tokens(a, n)``
    over ``verify_time(n + 1) + n * draft_token_s``; ties go to the shorter draft. Until the
    acceptance, the draft time and two verify widths are measured it keeps the current length
    (a drafter that costs nothing should report ``draft_token_s = 0.0``, not None)."""

    def decide(self, snap: LengthSnapshot) -> int:
        if snap.n_max < 1 or snap.acceptance is None or snap.draft_token_s is None or len(snap.target_step_s) < 2:
            return _current(snap)
        a = min(1.0, max(0.0, snap.acceptance))
        best, best_rate = 1, -1.0
        for n in range(1, snap.n_max + 1):
            seconds = verify_time(snap.target_step_s, n + 1) + n * snap.draft_token_s
            rate = expected_tokens(a, n) / max(seconds, _MIN_STEP_S)
            if rate > best_rate:
                best, best_rate = n, rate
        return best


POLICIES = {"fixed": Fixed, "heuristic": Heuristic, "goodput": Goodput}


def build(name: str, **kw):
    """A draft-length policy by config name with its keyword arguments (fixed: n; heuristic:
    n_min, start; goodput: none)."""
    if name not in POLICIES:
        raise ValueError(f"policy.draft_length={name!r}; choose one of {', '.join(POLICIES)}")
    try:
        return POLICIES[name](**kw)
    except TypeError as e:  # a missing or unknown keyword: say which policy it was for
        raise ValueError(f"policy.draft_length={name}: {e}") from None
