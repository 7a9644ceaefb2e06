"""``ngram-mod``: a hashed table of next tokens (``NgramModTable``, llama.cpp's
``common_ngram_mod``) and the drafter that walks it (``NgramMod``). Sources, the history
convention and the new-sequence rule: ``ngram_common``."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvstream.speculators.base import Speculator
from kvstream.speculators.ngram_common import Continuity
from kvstream.speculators.registry import register

__all__ = ["NgramMod", "NgramModTable"]


_LCG_MUL = 6364136223846793005  # llama.cpp common_ngram_mod::idx multiplier
_MASK64 = (1 << 64) - 1


class NgramModTable:
    """llama.cpp's ``common_ngram_mod``: a hashed table of next tokens. The hash of an n-gram
    is ``h = h * 6364136223846793005 + token`` over its tokens in 64-bit arithmetic, modulo
    the table size; a slot holds the token that followed the n-gram hashed there last
    (last writer wins, no key check: a collision returns another n-gram's token). ``used``
    counts occupied slots. Can be shared by several drafters, as llama.cpp shares one pool
    across server slots."""

    EMPTY = -1

    def __init__(self, n: int = 24, size: int = 4 * 1024 * 1024) -> None:
        if n < 1 or size < 1:
            raise ValueError(f"ngram-mod table needs n >= 1 and size >= 1, got n={n}, size={size}")
        self.n, self.size = int(n), int(size)
        self.entries = np.full(self.size, self.EMPTY, dtype=np.int32)
        self.used = 0
        self._lead = pow(_LCG_MUL, self.n - 1, 1 << 64)  # weight of a window's first token

    @property
    def occupancy(self) -> float:
        return self.used / self.size

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def reset(self) -> None:
        self.entries.fill(self.EMPTY)
        self.used = 0

    def hash(self, window: Sequence[int]) -> int:
        """The 64-bit hash of one n-gram (before the modulo)."""
        h = 0
        for t in window:
            h = (h * _LCG_MUL + int(t)) & _MASK64
        return h

    def slot(self, window: Sequence[int]) -> int:
        return self.hash(window) % self.size

    def get(self, window: Sequence[int]) -> int:
        return int(self.entries[self.slot(window)])

    def add_range(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """``add`` for every start ``start <= i < stop``: key ``tokens[i:i+n]``, value
        ``tokens[i+n]``, in increasing ``i`` (so the last writer wins), vectorised."""
        cnt = stop - start
        if cnt <= 0:
            return
        n = self.n
        seg = np.asarray(tokens[start: stop + n], dtype=np.int64)
        if len(seg) < cnt + n:
            raise ValueError("add_range: tokens too short for the requested starts")
        useg = seg.astype(np.uint64)  # two's complement, as C's int32 -> size_t
        mul = np.uint64(_LCG_MUL)
        h = np.zeros(cnt, dtype=np.uint64)
        for k in range(n):
            h = h * mul + useg[k: k + cnt]  # wraps modulo 2^64
        slots = (h % np.uint64(self.size)).astype(np.int64)
        values = seg[n: n + cnt].astype(np.int32)
        # last writer wins: keep each slot's last occurrence
        _, first_in_rev = np.unique(slots[::-1], return_index=True)
        keep = cnt - 1 - first_in_rev
        slots, values = slots[keep], values[keep]
        self.used += int(np.count_nonzero(self.entries[slots] == self.EMPTY))
        self.entries[slots] = values


class NgramMod(Speculator):
    """``ngram-mod``: a hashed table of next tokens (``NgramModTable``, 4 Mi int32 slots =
    16 MiB); the draft follows the table from the last ``n`` tokens, one token at a time
    (rolling the n-gram forward over the drafted tokens), until an empty slot or ``n_max``.

    llama.cpp (``common_speculative_state_ngram_mod``, ``common_ngram_mod``; table of
    ``4*1024*1024`` entries; defaults ``n_match = 24``, ``n_max = 64``, ``n_min = 48`` from
    ``common_params_speculative_ngram_mod``; n < 16 warned against), reproduced here:

    - ``begin(prompt)``: every n-gram of the prompt is added with its next token; then, if
      the table is more than a quarter full, it is cleared;
    - a draft call first adds the new n-grams in chunks: when ``i_last + 32 < cur_len`` the
      starts ``i_last .. cur_len-n-1`` are added (their next tokens lie in ``inp``) and
      ``i_last = cur_len - n``;
    - drafting: from the last n tokens (``inp[-(n-1):] + [sampled]``), look up the next token,
      append it, slide; stop at an empty slot; if that happens before ``n_min`` tokens there
      is no draft at all;
    - feedback: ``f = accepted / drafted``; ``f < 0.5`` increments a streak, otherwise the
      streak is reset; at 3 consecutive low rounds the table is cleared;
    - the table persists across sequences (``begin`` does not clear it; llama.cpp shares it
      across server slots); ``reset()`` clears it.

    Deviations:

    - ``used`` counts occupied slots (``add`` on an empty slot). One upstream revision
      incremented it on writes into an occupied slot instead, which measures overwrites, not
      occupancy; the later revisions count empty -> occupied, as here.
    - The quarter-full rule is also checked after each chunk added during drafting, not only
      in ``begin``: a kvstream run may decode one long sequence without a new ``begin``. With
      the default table it cannot fire below ~1M tokens of history.
    - A round with 0 accepted tokens counts as a low-acceptance round. llama.cpp's
      ``common_speculative_accept`` returns before calling the drafter when nothing was
      accepted, so there a fully rejected draft neither extends nor breaks the streak; the
      rule "3 consecutive rounds below 0.5" counts it, and a drafter whose drafts are all
      rejected is exactly the one whose table should go.
    - The fraction uses the feedback's ``n_drafted`` (the tokens actually verified, equal to
      the draft's length unless the engine cut it).
    - After a low-acceptance clear ``i_last`` is kept (the table relearns from new tokens,
      as in the original PR 19164). Upstream later (PR 22168) also resets ``i_last``, so the
      next draft re-adds the whole history, which for one sequence rebuilds nearly the same
      table; ``reseed_after_reset=True`` gives that. Newer upstream revisions moved the
      thresholds to 0.25 / 5 rounds: ``low_accept_frac`` / ``low_accept_rounds``.
    - The call's ``n_max`` caps the draft and ``n_min`` is capped at the effective ``n_max``
      (so an engine budget below 48 still gets drafts instead of none).
    - Insertion is vectorised with numpy (same slots, same last-writer-wins result) and the
      draft walk uses the rolling form of the same hash (O(1) per drafted token).
    """

    name = "ngram-mod"
    ADD_CHUNK = 32

    def __init__(self, n: int = 24, n_max: int = 64, n_min: int = 48,
                 size: int = 4 * 1024 * 1024, occupancy_limit: float = 0.25,
                 low_accept_frac: float = 0.5, low_accept_rounds: int = 3,
                 reseed_after_reset: bool = False, table: NgramModTable | None = None) -> None:
        super().__init__()
        if n_max < 1 or n_min < 0:
            raise ValueError(f"ngram-mod needs n_max >= 1 and n_min >= 0, got "
                             f"n_max={n_max}, n_min={n_min}")
        if table is not None and table.n != n:
            raise ValueError(f"shared ngram-mod table has n={table.n}, drafter asks n={n}")
        self.table = table if table is not None else NgramModTable(n, size)
        self.n = int(n)
        self.n_max, self.n_min = int(n_max), int(n_min)
        self.max_draft = self.n_max
        self.occupancy_limit = float(occupancy_limit)
        self.low_accept_frac = float(low_accept_frac)
        self.low_accept_rounds = int(low_accept_rounds)
        self.reseed_after_reset = bool(reseed_after_reset)
        self._seen = Continuity()
        self.i_last = 0  # starts [0, i_last) of the history are in the table
        self.n_low = 0  # consecutive low-acceptance rounds
        self._n_draft_last = 0
        self.clears_full = 0  # table clears: quarter full
        self.clears_low = 0  # table clears: low-acceptance streak

    # -- lifecycle ---------------------------------------------------------------------

    def reset(self) -> None:
        self.table.reset()
        self._seen.clear()
        self.i_last = 0
        self.n_low = 0
        self._n_draft_last = 0

    def begin(self, prompt: Sequence[int]) -> None:
        prompt = list(prompt)
        self._begin(prompt)
        self._seen.record(prompt)

    def _begin(self, prompt: list[int]) -> None:
        self.i_last = 0
        self.n_low = 0
        self._n_draft_last = 0
        if len(prompt) < self.n:
            return
        self.table.add_range(prompt, 0, len(prompt) - self.n)
        self.i_last = len(prompt) - self.n
        self._check_occupancy()

    def _check_occupancy(self) -> None:
        if self.table.used > self.occupancy_limit * self.table.size:
            self.table.reset()
            self.clears_full += 1

    # -- drafting ----------------------------------------------------------------------

    def _propose(self, h: list[int], n_max: int, state: Any) -> list[int]:
        if self._seen.length == 0 or not self._seen.continues(h):
            self._begin(h[:-1])  # a new sequence: as llama.cpp's begin(prompt)
        self._seen.record(h)
        self._n_draft_last = 0
        n, table = self.n, self.table
        cur_len = len(h) - 1
        if cur_len < n:
            return []
        if self.i_last + self.ADD_CHUNK < cur_len:
            stop = cur_len - n
            if stop > self.i_last:
                table.add_range(h, self.i_last, stop)
                self.i_last = stop
                self._check_occupancy()

        n_hi = min(self.n_max, n_max)
        n_lo = min(self.n_min, n_hi)
        ctx = [int(t) for t in h[-n:]]  # the rolling window: ctx[i:i+n] at step i
        hv = table.hash(ctx)
        lead, size, entries, empty = table._lead, table.size, table.entries, table.EMPTY
        draft: list[int] = []
        for i in range(n_hi):
            tok = int(entries[hv % size])
            if tok == empty:
                if i < n_lo:
                    return []
                break
            draft.append(tok)
            ctx.append(tok)
            hv = ((hv - ctx[i] * lead) * _LCG_MUL + tok) & _MASK64
        self._n_draft_last = len(draft)
        return draft

    def _accepted(self, n_drafted: int, n_accepted: int) -> None:
        if self._n_draft_last <= 0:
            return
        if n_accepted / n_drafted < self.low_accept_frac:
            self.n_low += 1
            if self.n_low >= self.low_accept_rounds:
                self.table.reset()
                self.clears_low += 1
                self.n_low = 0
                if self.reseed_after_reset:
                    self.i_last = 0
        else:
            self.n_low = 0


register("ngram-mod", NgramMod)
