"""The speculator interface (``Speculator``) and its per-speculator counters (``SpeculatorStats``).

One decode round, as the engine sees it (DESIGN.md, "One decode step, as data"):

1. ``draft = chain.propose(history, n_max, state)``: the chain (``chain.Chain``) asks its
   speculators in priority order; the first non-empty draft wins (``chain.last_winner``).
2. The target verifies ``1 + len(draft)`` tokens and keeps a prefix of the draft.
3. ``chain.accepted(len(draft), n_accepted)``: only the winner is told.

``history`` is every token of the sequence so far, prompt and generated, the last one being
the most recently sampled token (the one the draft continues). It only ever grows within a
sequence: rejected draft tokens never enter it. A new sequence starts with ``begin(prompt)``
(optional: the n-gram drafters notice a history that is not a continuation of the previous
one and start over) or ``reset()``.

Extension points, for a draft-model speculator and an MTP head:

- ``propose(..., state=None)``: ``state`` is whatever the engine hands every speculator for
  the round (for an MTP head the target's last hidden state, for a draft model a handle to
  its pinned KV and the arena); the chain passes it through unchanged and the n-gram
  drafters ignore it.
- ``last_probs``: ``None`` means the last draft was a point mass (q one-hot, as for the
  n-gram drafters); a model drafter sets it to its per-position draft distributions, which
  lossless rejection sampling at T > 0 needs. ``Chain.last_probs`` is the winner's.
- ``enabled``: a speculator that is switched off (e.g. a draft model the eject policy
  ejected) is skipped by the chain and not counted as called.
- ``max_draft``: the speculator's own cap on a draft's length (``None``: only the engine's
  ``n_max`` limits it); ``Chain.max_draft`` is the largest, for sizing verify batches.

Config names and factories are in ``registry``; the n-gram drafters in ``ngram_simple``,
``ngram_map_k`` and ``ngram_mod``, the draft model in ``draft``.
"""

from __future__ import annotations

import abc
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

__all__ = ["Speculator", "SpeculatorStats"]


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


@dataclass
class SpeculatorStats:
    """Counters of one speculator, the same ones llama.cpp prints per implementation
    (``#calls``, ``#gen drafts``, ``#acc drafts``, ``#gen tokens``, ``#acc tokens``)."""

    calls: int = 0  # propose() calls that reached this speculator
    drafts: int = 0  # non-empty proposals
    drafted_tokens: int = 0  # tokens over all non-empty proposals
    accepted_tokens: int = 0  # draft tokens the target accepted (feedback of the winner)
    accepted_drafts: int = 0  # drafts of which at least one token was accepted
    feedbacks: int = 0  # accepted() calls
    seconds: float = 0.0  # wall time spent in propose() (a draft model syncs the device per token)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any draft)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_draft_len(self) -> float:
        return self.drafted_tokens / self.drafts if self.drafts else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(asdict(self))
        d["acceptance_rate"] = self.acceptance_rate
        return d

    def clear(self) -> None:
        for k in asdict(self):
            setattr(self, k, 0)


# --------------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------------


def as_token_list(history: Any) -> list[int]:
    if isinstance(history, list):
        return history
    tolist = getattr(history, "tolist", None)  # numpy arrays, torch tensors
    if tolist is not None:
        return list(tolist())
    return [int(t) for t in history]


class Speculator(abc.ABC):
    """A drafter: proposes up to ``n_max`` tokens that continue ``history``.

    Subclasses implement ``_propose`` (and, when they learn from feedback, ``_accepted``);
    the public ``propose`` / ``accepted`` keep the statistics and enforce the contract
    (a draft never longer than ``n_max``; ``0 <= n_accepted <= n_drafted``).
    """

    #: config name; instances may override it
    name: str = "speculator"
    #: the speculator's own cap on a draft's length (None: only the engine's n_max)
    max_draft: int | None = None

    def __init__(self) -> None:
        self.stats = SpeculatorStats()
        self.enabled = True
        #: None: the last draft was a point mass (q one-hot). A model drafter stores its
        #: per-position draft distributions here for rejection sampling at T > 0.
        self.last_probs: Any = None

    # -- public API --------------------------------------------------------------------

    def propose(self, history: Sequence[int], n_max: int, state: Any = None) -> list[int]:
        """Up to ``n_max`` draft tokens continuing ``history`` (empty: no draft)."""
        self.stats.calls += 1
        self.last_probs = None
        if n_max <= 0 or len(history) == 0:
            return []
        t0 = time.perf_counter()
        draft = self._propose(as_token_list(history), int(n_max), state)
        self.stats.seconds += time.perf_counter() - t0
        if len(draft) > n_max:
            draft = draft[:n_max]
            if self.last_probs is not None:
                self.last_probs = self.last_probs[:n_max]
        if draft:
            self.stats.drafts += 1
            self.stats.drafted_tokens += len(draft)
        return list(draft)

    def accepted(self, n_drafted: int, n_accepted: int) -> None:
        """Feedback on this speculator's last draft: ``n_accepted`` of the ``n_drafted``
        draft tokens were kept by the target (the bonus token not counted)."""
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"{self.name}: need 0 <= n_accepted <= n_drafted, got "
                             f"n_accepted={n_accepted}, n_drafted={n_drafted}")
        if n_drafted == 0:
            return
        self.stats.feedbacks += 1
        self.stats.accepted_tokens += n_accepted
        if n_accepted > 0:
            self.stats.accepted_drafts += 1
        self._accepted(n_drafted, n_accepted)

    def begin(self, prompt: Sequence[int]) -> None:
        """A new sequence starts with ``prompt`` (optional; llama.cpp's ``begin``)."""

    def warm(self) -> None:
        """Untimed setup after ``begin`` (a draft model compiles and captures its step widths)."""

    def reset(self) -> None:
        """Forget everything learned (tables, indices). Statistics are kept:
        ``stats.clear()`` clears them."""

    # -- for subclasses ----------------------------------------------------------------

    @abc.abstractmethod
    def _propose(self, history: list[int], n_max: int, state: Any) -> list[int]:
        """The draft; may be longer than ``n_max`` (the caller truncates)."""

    def _accepted(self, n_drafted: int, n_accepted: int) -> None:  # noqa: B027
        """Learn from the feedback on the last draft (default: nothing)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
