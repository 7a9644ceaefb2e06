"""``ngram-map-k``: a table of key n-grams with hit counts whose drafts are capped by their last
acceptance (llama.cpp's ``common_ngram_map_draft`` / ``_accept``, key only). Sources, the
history convention and the new-sequence rule: ``ngram_common``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvstream.speculators.base import Speculator
from kvstream.speculators.ngram_common import Continuity, windows
from kvstream.speculators.registry import register

__all__ = ["NgramMapK"]


@dataclass
class _KeyStats:
    hits: int = 0  # llama.cpp key_num: times this key was matched at a draft call
    n_accepted: int = 0  # llama.cpp values[0].n_accepted: accepted at the key's last draft


class NgramMapK(Speculator):
    """``ngram-map-k``: a table of key n-grams with hit counts; a key must have been hit
    ``min_hits`` times before it drafts, and each key remembers how many of its last draft's
    tokens were accepted, which caps its next draft.

    llama.cpp (``common_ngram_map_draft`` / ``common_ngram_map_accept`` with
    ``key_only = true``; defaults ``size_n = 12``, ``size_m = 48``, ``min_hits = 1``),
    reproduced here:

    - no draft while ``cur_len < 2n + m``;
    - a match is an earlier start ``j <= cur_len - n - m - 1`` of the key (so ``m`` tokens
      always follow it); llama.cpp finds it through a hash map n-gram -> start where the first
      writer wins and each call adds its new starts in descending order, falling back to a
      descending scan of the starts not yet in the map. So a key found in the map resolves to
      the start registered first (usually its earliest occurrence), one found only among the
      new starts to the most recent of them. Same rule here;
    - on a match the key's entry is found or created (``n_accepted = m``) and its hit count
      goes up by one (capped at 16380);
    - the draft is ``min(m, n_accepted)`` tokens following the match;
    - feedback: ``n_accepted`` of the key's entry is set to the number of accepted tokens, so
      the key's next draft is that long. llama.cpp's ``common_speculative_accept`` never
      forwards a feedback of 0 accepted tokens, so a key keeps its last non-zero value;
      same here (a 0 would silence the key for good).

    Deviations:

    - The 2^18-entry hash map (LCG hash, collisions possible: a key hidden by a collision
      gives no draft there) is an exact dict with the same first-writer rule; the key table,
      a vector scanned linearly there, is a dict. Same drafts, minus collision misses.
    - ``min_hits`` is applied: in llama.cpp's code the key-only branch returns its draft
      before the ``min_hits`` test (only ``ngram-map-k4v`` honours it), while
      docs/speculative.md documents ``--spec-ngram-min-hits`` for ``ngram-map-k``. With the
      default ``min_hits = 1`` both agree.
    - Start 0 is searchable (llama.cpp's ``0 == no match`` sentinel excludes it).
    - New sequence: ``common_ngram_map_begin`` prunes keys past the previous prompt (for
      reasoning chats whose history is edited); here a continuation keeps everything and any
      other history starts from an empty table.
    - The draft is also cut at the call's ``n_max``.
    """

    name = "ngram-map-k"
    MAX_COUNT = 16380  # llama.cpp COMMON_NGRAM_MAX_VALUE_COUNT

    def __init__(self, n: int = 12, m: int = 48, min_hits: int = 1) -> None:
        super().__init__()
        if n < 1 or m < 1 or min_hits < 0:
            raise ValueError(f"ngram-map-k needs n, m >= 1 and min_hits >= 0, got "
                             f"n={n}, m={m}, min_hits={min_hits}")
        self.n, self.m, self.min_hits = int(n), int(m), int(min_hits)
        self.max_draft = self.m
        self._seen = Continuity()
        self._first_pos: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # starts [0, _indexed) are in _first_pos
        self.keys: dict[tuple[int, ...], _KeyStats] = {}
        self._last: _KeyStats | None = None  # the entry whose draft awaits feedback

    def reset(self) -> None:
        self._seen.clear()
        self._first_pos.clear()
        self._indexed = 0
        self.keys.clear()
        self._last = None

    def begin(self, prompt: Sequence[int]) -> None:
        self.reset()
        self._seen.record(list(prompt))

    def _propose(self, h: list[int], n_max: int, state: Any) -> list[int]:
        self._last = None
        if not self._seen.continues(h):
            self.reset()
        self._seen.record(h)
        n, m = self.n, self.m
        cur_len = len(h) - 1
        if cur_len < 2 * n + m:
            return []
        stop = cur_len - n - m  # eligible starts: 0 .. cur_len-n-m-1
        key = tuple(h[-n:])
        j = self._first_pos.get(key)  # starts registered by earlier calls
        if stop > self._indexed:
            # this call's new starts; dict() keeps the largest start per n-gram, i.e. the one
            # a descending first-writer-wins pass would register
            batch = dict(zip(windows(h, self._indexed, stop, n), range(self._indexed, stop)))
            if j is None:
                j = batch.get(key)
            setdefault = self._first_pos.setdefault
            for k, pos in batch.items():
                setdefault(k, pos)
            self._indexed = stop
        if j is None:
            return []
        entry = self.keys.get(key)
        if entry is None:
            entry = self.keys[key] = _KeyStats(hits=0, n_accepted=m)
        entry.hits = min(entry.hits + 1, self.MAX_COUNT)
        if entry.hits < self.min_hits:
            return []
        self._last = entry
        return h[j + n: j + n + min(m, entry.n_accepted)]

    def _accepted(self, n_drafted: int, n_accepted: int) -> None:
        if self._last is not None and n_accepted > 0:
            self._last.n_accepted = n_accepted
        self._last = None


register("ngram-map-k", NgramMapK)
