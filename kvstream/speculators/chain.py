"""The priority chain of speculators (``Chain``) and ``build_chain``, which makes one from the
comma string of ``spec.type`` through the name registry (``registry``)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from kvstream.speculators.base import Speculator, SpeculatorStats, as_token_list
from kvstream.speculators.registry import create, normalize_name, parse_chain_spec

__all__ = ["Chain", "build_chain"]


class Chain:
    """Speculators asked in priority order; the first non-empty draft wins and only the
    winner is told how many of its tokens were accepted (llama.cpp's
    ``common_speculative_draft`` / ``common_speculative_accept``). An empty chain never
    drafts (``spec.type=none``)."""

    def __init__(self, speculators: Sequence[Speculator] = ()) -> None:
        self.speculators: list[Speculator] = list(speculators)
        names = [s.name for s in self.speculators]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"speculator chain lists {', '.join(dup)} more than once")
        self.last_winner: Speculator | None = None
        self._pending: int = 0  # length of the winner's draft awaiting feedback

    # -- the round ---------------------------------------------------------------------

    def propose(self, history: Sequence[int], n_max: int, state: Any = None) -> list[int]:
        self.last_winner = None
        self._pending = 0
        if n_max <= 0:
            return []
        for spec in self.speculators:
            if not spec.enabled:
                continue
            draft = spec.propose(history, n_max, state)
            if draft:
                self.last_winner = spec
                self._pending = len(draft)
                return draft
        return []

    def propose_device(self, history: Sequence[int], n: int) -> Any:
        """A round drafted on the device ((tokens, valid) tensors of ``n``, see
        ``DraftModel.propose_device``) by the chain's one speculator when it can; None otherwise
        (several speculators, or one that drafts on the host: ``propose``)."""
        self.last_winner = None
        self._pending = 0
        spec = self.speculators[0] if len(self.speculators) == 1 else None
        if n <= 0 or spec is None or not spec.enabled or not hasattr(spec, "propose_device"):
            return None
        out = spec.propose_device(as_token_list(history), n)  # (the engine's list itself: no copy a round)
        if out is not None:
            self.last_winner, self._pending = spec, n
        return out

    def propose_ahead(self, n: int) -> tuple[Speculator, Any] | None:
        """The next round drafted on the device before the feedback on this one, by this round's
        winner when it can (``MTPDraft.propose_ahead``): (that speculator, its (tokens, valid)), or
        None. The chain's pending round stays this one until ``accepted``; ``resume`` then makes
        the launched one pending."""
        spec = self.last_winner
        if n <= 0 or len(self.speculators) != 1 or spec is None or not spec.enabled or not hasattr(spec, "propose_ahead"):
            return None
        out = spec.propose_ahead(n)
        return None if out is None else (spec, out)

    def resume(self, spec: Speculator, n: int) -> None:
        """A round ``propose_ahead`` launched becomes the pending one (after the last one's ``accepted``)."""
        self.last_winner, self._pending = spec, n

    def cancel_device(self) -> None:
        """Drop the round ``propose_device`` drafted last, unverified: its speculator rolls its
        drafted rows back (``cancel_device_round``), as if the round had not been proposed."""
        winner, self.last_winner, self._pending = self.last_winner, None, 0
        if winner is not None:
            winner.cancel_device_round()

    def accepted(self, n_drafted: int, n_accepted: int) -> None:
        """Feedback for the last draft, passed to its speculator only. A call after a round
        without a draft is allowed with ``n_drafted == 0`` and does nothing."""
        winner = self.last_winner
        if winner is None:
            if n_drafted != 0:
                raise RuntimeError("accepted() without a pending draft")
            return
        if n_drafted > self._pending:
            raise ValueError(f"n_drafted={n_drafted} exceeds the draft's length {self._pending}")
        self.last_winner = None
        self._pending = 0
        winner.accepted(n_drafted, n_accepted)

    @property
    def last_probs(self) -> Any:
        return None if self.last_winner is None else self.last_winner.last_probs

    # -- lifecycle ---------------------------------------------------------------------

    def begin(self, prompt: Sequence[int]) -> None:
        for s in self.speculators:
            s.begin(prompt)

    def warm(self) -> None:
        for s in self.speculators:
            s.warm()

    def reset(self) -> None:
        self.last_winner = None
        self._pending = 0
        for s in self.speculators:
            s.reset()

    def reorder(self, names: Sequence[str]) -> None:
        """New priority order (a policy's decision); ``names`` must be a permutation of the
        chain's names."""
        norm = [normalize_name(n) for n in names]
        by_name = {s.name: s for s in self.speculators}
        if sorted(norm) != sorted(by_name):
            raise ValueError(f"reorder needs a permutation of {self.names}, got {list(names)}")
        self.speculators = [by_name[n] for n in norm]

    # -- views -------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.speculators]

    @property
    def empty(self) -> bool:
        return not self.speculators

    @property
    def idle(self) -> bool:
        """No speculator is enabled (an ejected draft alone, or an empty chain): the next round
        is a plain step whatever the history."""
        return not any(s.enabled for s in self.speculators)

    @property
    def max_draft(self) -> int | None:
        caps = [s.max_draft for s in self.speculators]
        if not caps or any(c is None for c in caps):
            return None
        return max(c for c in caps if c is not None)

    def stats(self) -> dict[str, SpeculatorStats]:
        return {s.name: s.stats for s in self.speculators}

    def get(self, name: str) -> Speculator:
        name = normalize_name(name)
        for s in self.speculators:
            if s.name == name:
                return s
        raise KeyError(f"no speculator {name!r} in chain {self.names}")

    def __len__(self) -> int:
        return len(self.speculators)

    def __iter__(self) -> Iterator[Speculator]:
        return iter(self.speculators)

    def __repr__(self) -> str:
        return f"Chain({','.join(self.names) or 'none'})"


def build_chain(spec: str | Sequence[str] | None,
                options: Mapping[str, Mapping[str, Any]] | None = None) -> Chain:
    """A chain from a ``spec.type`` string; ``options[name]`` are that speculator's
    constructor arguments (names spelled either way; options of unused names are ignored)."""
    names = parse_chain_spec(spec)
    opts = {normalize_name(k): dict(v or {}) for k, v in (options or {}).items()}
    return Chain([create(n, **opts.get(n, {})) for n in names])
