"""Speculator interface, per-speculator statistics, the priority chain and the name registry.

One decode round, as the engine sees it (DESIGN.md, "One decode step, as data"):

1. ``draft = chain.propose(history, n_max, state)``: the chain asks its speculators in
   priority order; the first non-empty draft wins (``chain.last_winner``).
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

Registry: ``register(name, factory)`` (also usable as a decorator) maps a config name to a
factory; ``build_chain("ngram-simple,draft", options)`` builds a chain from the comma string
of ``spec.type`` (``none`` is the empty chain). Modules that register speculators at import
time are listed in ``BUILTIN_MODULES`` and imported lazily by the builders, so adding the
draft-model speculator is: write its module with ``@register("draft")`` on its factory and
append the module to ``BUILTIN_MODULES`` (or import it before building the chain).
"""

from __future__ import annotations

import abc
import importlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

__all__ = [
    "BUILTIN_MODULES",
    "Chain",
    "REGISTRY",
    "Speculator",
    "SpeculatorStats",
    "UnknownSpeculatorError",
    "build_chain",
    "create",
    "known_names",
    "normalize_name",
    "parse_chain_spec",
    "register",
]


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


def _as_token_list(history: Any) -> list[int]:
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
        draft = self._propose(_as_token_list(history), int(n_max), state)
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


# --------------------------------------------------------------------------------------------
# the chain
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

SpeculatorFactory = Callable[..., Speculator]

#: config name -> factory(**options) -> Speculator
REGISTRY: dict[str, SpeculatorFactory] = {}

#: modules whose import registers speculators; imported on first use of the builders
BUILTIN_MODULES: list[str] = ["kvstream.speculators.ngram", "kvstream.speculators.draft"]

NONE = "none"


class UnknownSpeculatorError(ValueError):
    """A speculator name that is not registered."""


def normalize_name(name: str) -> str:
    """Config spelling: case-insensitive, ``_`` and ``-`` alike (llama.cpp used both)."""
    return str(name).strip().lower().replace("_", "-")


def register(name: str, factory: SpeculatorFactory | None = None, *, replace: bool = False):
    """Register ``factory`` under ``name``; without ``factory`` it returns a decorator."""
    key = normalize_name(name)
    if key == NONE or not key:
        raise ValueError(f"{name!r} cannot be registered")

    def _do(f: SpeculatorFactory) -> SpeculatorFactory:
        old = REGISTRY.get(key)
        same = old is not None and (getattr(old, "__module__", None), getattr(
            old, "__qualname__", None)) == (getattr(f, "__module__", None),
                                            getattr(f, "__qualname__", None))
        if old is not None and old is not f and not (replace or same):  # same: a reload
            raise ValueError(f"speculator {key!r} is already registered")
        REGISTRY[key] = f
        return f

    return _do if factory is None else _do(factory)


def _load_builtins() -> None:
    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)


def known_names() -> list[str]:
    """Every name a chain may use (``none`` included)."""
    _load_builtins()
    return [NONE, *sorted(REGISTRY)]


def _unknown(name: str) -> UnknownSpeculatorError:
    return UnknownSpeculatorError(
        f"unknown speculator {name!r}; known: {', '.join(known_names())}")


def create(name: str, **options: Any) -> Speculator:
    """One speculator from its registered name; ``options`` go to its factory."""
    _load_builtins()
    key = normalize_name(name)
    if key not in REGISTRY:
        raise _unknown(name)
    try:
        spec = REGISTRY[key](**options)
    except TypeError as e:
        raise ValueError(f"bad options for speculator {key!r} ({dict(options)}): {e}") from e
    spec.name = key
    return spec


def parse_chain_spec(spec: str | Sequence[str] | None) -> list[str]:
    """``"ngram-simple,draft"`` -> ``["ngram-simple", "draft"]``; ``none``/empty -> ``[]``.
    Unknown names, duplicates and ``none`` mixed with others are errors."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [normalize_name(s) for s in items]
    if isinstance(spec, str) and spec.strip() == "":
        return []
    if any(not n for n in names):
        raise ValueError(f"empty entry in speculator chain {spec!r}")
    if NONE in names:
        if len(names) > 1:
            raise ValueError(f"'none' cannot be combined with other speculators: {spec!r}")
        return []
    _load_builtins()
    for n, raw in zip(names, items):
        if n not in REGISTRY:
            raise _unknown(str(raw).strip())
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"speculator chain {spec!r} lists {', '.join(dup)} more than once")
    return names


def build_chain(spec: str | Sequence[str] | None,
                options: Mapping[str, Mapping[str, Any]] | None = None) -> Chain:
    """A chain from a ``spec.type`` string; ``options[name]`` are that speculator's
    constructor arguments (names spelled either way; options of unused names are ignored)."""
    names = parse_chain_spec(spec)
    opts = {normalize_name(k): dict(v or {}) for k, v in (options or {}).items()}
    return Chain([create(n, **opts.get(n, {})) for n in names])
