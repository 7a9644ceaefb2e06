"""What the n-gram drafters (``ngram_simple``, ``ngram_map_k``, ``ngram_mod``) share: their
sources in llama.cpp, the history convention, and the test that tells a new sequence from a
continuation (``Continuity``), plus the n-token window iterator (``windows``).

Written from a reading of llama.cpp's ``common/ngram-map.cpp`` (``common_ngram_simple_draft``,
``common_ngram_map_draft``, ``common_ngram_map_accept``), ``common/ngram-mod.cpp``
(``common_ngram_mod``), ``common/speculative.cpp`` (``common_speculative_state_ngram_*``,
``common_speculative_draft``, ``common_speculative_accept``), ``common/common.h``
(``common_params_speculative_ngram_map`` / ``_ngram_mod`` defaults) and
``docs/speculative.md``; no code is taken from there.

History convention. llama.cpp hands a drafter ``(inp, sampled)``: the tokens so far and,
separately, the token just sampled. Here ``history`` is both: ``inp = history[:-1]``,
``sampled = history[-1]``, and every length rule in the drafters' docstrings is stated, as in llama.cpp, in
terms of ``cur_len = len(inp) = len(history) - 1``.

Each drafter keeps incremental state (an index or a table) over the history it has seen. A
history that is not a continuation of the previous one (shorter, or different at the
spot-checked positions) is taken as a new sequence, as if ``begin`` had been called with it.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["Continuity", "windows"]


class Continuity:
    """Tells a continuation of the history seen last from a new sequence, in O(1): length,
    first, middle and last token of what was seen are compared."""

    __slots__ = ("length", "first", "mid", "last")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.length = 0
        self.first = self.mid = self.last = None

    def record(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        self.length = n
        if n:
            self.first, self.mid, self.last = tokens[0], tokens[n // 2], tokens[n - 1]

    def continues(self, tokens: Sequence[int]) -> bool:
        n = self.length
        if n == 0:
            return True
        return (len(tokens) >= n and tokens[0] == self.first and tokens[n // 2] == self.mid
                and tokens[n - 1] == self.last)


def windows(h: list[int], start: int, stop: int, n: int):
    """The n-token windows ``tuple(h[j:j+n])`` for ``start <= j < stop``, lazily."""
    return zip(*(h[start + k: stop + k] for k in range(n)))
