"""``ngram-simple``: draft what followed the most recent earlier occurrence of the last n tokens
(llama.cpp's ``common_ngram_simple_draft``). Sources, the history convention and the
new-sequence rule: ``ngram_common``."""

from __future__ import annotations

from typing import Any, Sequence

from kvstream.speculators.base import Speculator
from kvstream.speculators.ngram_common import Continuity, windows
from kvstream.speculators.registry import register

__all__ = ["NgramSimple"]


class NgramSimple(Speculator):
    """``ngram-simple``: the key is the last ``n`` tokens of the history; the most recent
    earlier occurrence of the key is found searching backwards, and the draft is the (up to)
    ``m`` tokens that followed it.

    llama.cpp (``common_ngram_simple_draft``; defaults ``size_n = 12``, ``size_m = 48`` from
    ``common_params_speculative_ngram_map``), reproduced here:

    - no draft while ``cur_len <= n + m + 1``;
    - the search starts at ``j = cur_len - n - 1`` and walks down; the first (most recent)
      match is taken, and only that one;
    - ``copy = min(m, cur_len - (j + n))`` tokens follow it inside ``inp`` (the sampled token
      is never part of a draft); if ``copy < n`` there is no draft (an older occurrence with
      a longer continuation is not looked for);
    - stateless, no feedback (its ``accept`` is a no-op).

    Deviations:

    - The backward scan (O(history) per step) is replaced by an index, n-gram -> most recent
      start, extended incrementally as the history grows: the same match in O(1) per step
      (about 10 ms once for a 32K-token prompt).
    - Start 0 is searchable: llama.cpp uses ``match_pos == 0`` as its "no match" sentinel,
      so an occurrence at the very first token is never found there. An artefact, not a rule.
    - The draft is also cut at the call's ``n_max`` (the engine's draft budget).
    - The ``check_rate`` of early versions (look up only every R tokens, default 1) was
      removed upstream and is not implemented.
    """

    name = "ngram-simple"

    def __init__(self, n: int = 12, m: int = 48) -> None:
        super().__init__()
        if n < 1 or m < 1:
            raise ValueError(f"ngram-simple needs n >= 1 and m >= 1, got n={n}, m={m}")
        self.n, self.m = int(n), int(m)
        self.max_draft = self.m
        self._seen = Continuity()
        self._last_pos: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # starts [0, _indexed) are in _last_pos

    def reset(self) -> None:
        self._seen.clear()
        self._last_pos.clear()
        self._indexed = 0

    def begin(self, prompt: Sequence[int]) -> None:
        self.reset()
        self._seen.record(list(prompt))

    def _propose(self, h: list[int], n_max: int, state: Any) -> list[int]:
        if not self._seen.continues(h):
            self.reset()
        self._seen.record(h)
        n, m = self.n, self.m
        cur_len = len(h) - 1
        if cur_len <= n + m + 1:
            return []
        stop = cur_len - n  # starts 0 .. cur_len-n-1 are searched
        if stop > self._indexed:
            self._last_pos.update(zip(windows(h, self._indexed, stop, n),
                                      range(self._indexed, stop)))
            self._indexed = stop
        j = self._last_pos.get(tuple(h[-n:]))
        if j is None:
            return []
        copy = min(m, cur_len - (j + n))
        if copy < n:
            return []
        return h[j + n: j + n + copy]


register("ngram-simple", NgramSimple)
