"""The MTP-head speculator (``spec.type=mtp``): one decoder block that drafts from the target's
own hidden states (``kvstream.model.mtp``), pinned in the target's arena like the draft model.

Its own weights and its one layer of KV pages live in the arena's pinned region (views into the
one allocation, ``pin``); the embedding, final norm and LM head are the target's, shared. An eject
gives those bytes back to the target's page pool and a re-enable pins them again from the host
copy of the weights, the head's KV coming back from its own host store (a resident paged cache:
every committed row is on the host too).

The head's KV row at position t + 1 is made from the target's states at t (the streams its head
reads: ``MTPHead.features``) and the token at
t + 1, so it follows the target: the engine hands it every committed row's hidden state
(``observe``: prefill chunks, then each round's accepted rows from the verify pass). A round
drafts ``n`` tokens as a chain: the first step reads the rows committed since the last round, the
last of which starts the draft; each later step feeds its own output state and token. Drafted rows
are rolled back after verification (``_accepted``); the committed rows come with the next round.
A round's feed and its draft steps are one pass of the head's cache (one ``begin`` / ``commit``,
each step a row of its own: ``PagedCache.sub_pass``); on CUDA (``graphs``, the engine's
``cuda_graphs``) that pass replays one graph per (feed width, draft length), captured at the
warm-up for the longest draft, so a round costs the host one launch instead of one per step (run
as separate captured steps, a round's feed and 4 steps cost 1.5 ms at 4K on the H200, twice
their device time: ``results/mtp_h200_graphed``). In device rounds the next round's feed is staged
before the round's readback (``prepare``: the verify's states and the kept tokens on the device,
the head's pass staged ahead), so after the readback the host launches the next round without
staging it; with a fixed draft length the engine launches that round before the readback
(``propose_ahead``: the feed is the verify's rows, the chain starts from the last kept one).
Feeds too wide for one pass (the prompt's last chunk) and a re-enable's catch-up run as separate
steps, each a graph per width (``HeadStep`` through ``GraphedModel``). While ejected
the head still reads the target's states, into host memory (``feature_dim`` values a token); the
first round after a re-enable makes their rows, so its KV holds every committed row again, like
the draft model's catch-up from the tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.argmax import scratch_for
from kernels.decode_attention import MAX_N_Q

from kvstream.cache.arena import Arena, pins_bytes
from kvstream.cache.factory import paged_bytes
from kvstream.cache.paged import PagedCache
from kvstream.cache.paged_staging import PinnedUpload
from kvstream.engine.graphs import ChainGraphs, GraphedModel, warm_widths
from kvstream.speculators.pinned import pin_kv, unpin
from kvstream.model.mtp import MTPHead
from kvstream.speculators.base import Speculator
from kvstream.speculators.device_draft import pick, stop_mask
from kvstream.speculators.host_rows import HostRows
from kvstream.speculators.registry import register


CATCH_UP_CHUNK = 256  # rows per eager pass when a re-enable catches the head's KV up
CHAIN_ROWS = MAX_N_Q  # the widest pass of a round's feed and draft steps (the cache's static step buffers)


class HeadStep:
    """The head as ``GraphedModel`` drives a model: ``step(tokens, cache, all_logits, hidden)``
    appends the rows and returns (logits [n, draft_vocab], h_out [n, d]) of every row. The rows'
    input states come from ``rows`` (``h_in``, a static buffer that captured steps read; a prefill
    chunk wider than it sets ``rows`` to its own states for its eager pass) and their positions
    are the cache's row indices + ``offset`` (the head's row r sits at position r + 1; after an
    eject's gap, further on), a device scalar written in place."""

    def __init__(self, head: MTPHead):
        c = head.cfg
        self.head, self.cfg = head, c
        self.device, self.dtype = head.eh_proj.device, head.eh_proj.dtype
        self.h_in = torch.zeros(MAX_N_Q, head.feature_dim, dtype=self.dtype, device=self.device)
        self.rows = self.h_in
        self.offset = torch.ones((), dtype=torch.long, device=self.device)

    def body(self, tokens: torch.Tensor, pos: torch.Tensor, cache, all_logits: bool = False, hidden: bool = True):
        return self.head.block(self.rows[:tokens.shape[0]], tokens, pos + self.offset, cache)

    def __call__(self, tokens: torch.Tensor, cache, all_logits: bool = False, hidden: bool = True):
        pos = cache.begin(tokens.shape[0])
        with cache.compute():
            out = self.body(tokens, pos, cache)
        cache.commit()
        return out


class MTPDraft(Speculator):
    """Drafts with an MTP head; ``pin``/``eject`` move its weights and KV in and out of an arena."""

    name = "mtp"

    def __init__(self, head: MTPHead, device: str | torch.device, *, max_tokens: int, type_k: str = "f16",
                 type_v: str = "f16", p_min: float = 0.0, n_min: int = 0, graphs: bool = False,
                 max_width: int = MAX_N_Q):
        super().__init__()
        self.head, self.device = head, torch.device(device)
        # the target's states the engine passes it (``observe``): the streams its head reads (Qwen.body's hidden)
        self.wants_hidden = head.features
        self.graphs = graphs and self.device.type == "cuda"  # its steps of up to MAX_N_Q rows replay captured graphs
        self.max_width = max_width  # the widest feed of a round (1 + spec.n_max): what warm() captures
        self._step, self._graphed, self._graphed_at = HeadStep(head), None, None
        self.step = self._step  # the eager HeadStep, or a GraphedModel over it while pinned (see pin)
        self._offset = 1  # what the HeadStep's device offset holds
        self.type_k, self.type_v, self.p_min, self.n_min = type_k, type_v, p_min, n_min
        self.kv_tokens = max_tokens + 16  # + a round's drafted rows beyond the history
        # the host copy the weights are (re-)pinned from; the head's parameters point into the arena while pinned
        pin = self.device.type == "cuda"
        self.host_weights = {k: p.detach().to("cpu").pin_memory() if pin else p.detach().clone()
                             for k, p in head.named_parameters()}
        self.cache: PagedCache | None = None
        self.pinned_bytes = 0
        self.enabled = False  # until pinned
        self.committed = 0  # rows of the head's KV that are committed history (positions 1..committed)
        self._rows: tuple[torch.Tensor, list[int], int] | None = None  # (h, next tokens, first position): not yet fed
        # the target's states (its dtype: the shared final norm's) seen while ejected, on the host
        self._backlog = HostRows(head.feature_dim, head.out_norm.dtype, pin=self.device.type == "cuda")
        self._ids = PinnedUpload(torch.zeros(MAX_N_Q, dtype=torch.long, device=self.device), buffers=4)
        self._round = 0
        self._prepared = None  # (first position, rows, accepted count kept) of a next feed ``prepare`` staged
        self._ahead = None  # the feed's first row of a chain ``propose_ahead`` launched, before its round's readback
        self._accepted_rows = torch.zeros(1, dtype=torch.long, device=self.device)  # its verify's accepted count
        self._argmax = scratch_for(self.device) if self.device.type == "cuda" else None  # a chain's greedy picks'
        # a round's feed and draft steps as one graph per (feed width, draft length) (``_run_chain``)
        self.chains = ChainGraphs(self.device) if self.graphs else None

    # ---- arena ------------------------------------------------------------------------

    @property
    def host_nbytes(self) -> int:
        return sum(t.nbytes for t in self.host_weights.values())

    def _kv_bytes(self) -> int:
        """Its one layer of KV pages, every page resident (no compute slab: its buffers are the allocator's)."""
        c = self.head.cfg
        one_layer = SimpleNamespace(n_layers=1, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
        return paged_bytes(one_layer, self.type_k, self.type_v, self.kv_tokens, 0)

    def estimated_bytes(self) -> int:
        """What ``pin`` takes: the head's own weights with their alignment, and its KV region."""
        return pins_bytes([t.nbytes for t in self.host_weights.values()]) + self._kv_bytes()

    def pin(self, arena: Arena) -> int:
        """Pin the head's weights and KV into ``arena``'s pinned region; returns the bytes."""
        self._mark, before = arena.mark(), arena.pinned_bytes
        for k, p in self.head.named_parameters():
            src = self.host_weights[k]
            p.data = arena.pin("mtp." + k, tuple(src.shape), src.dtype).copy_(src, non_blocking=True)
        if self.graphs:
            # a re-enable pins the same tensors from the same mark: the captured steps stay valid
            at = tuple(p.data_ptr() for p in self.head.parameters())
            if self._graphed is None or self._graphed_at != at:
                self._graphed, self._graphed_at = GraphedModel(self._step), at
            self.step = self._graphed
        c = self.head.cfg
        # no compute slab (its buffers are the allocator's); the prefill phase takes any width
        return pin_kv(self, arena, self._kv_bytes(), before, n_layers=1, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                      max_tokens=self.kv_tokens, type_k=self.type_k, type_v=self.type_v,
                      slabs={"prefill": 0, "decode": 0}, verify_width=MAX_N_Q, pdl=self.head.gemv)

    def eject(self, arena: Arena) -> int:
        """Give the pinned bytes back; the head's KV stays on the host. Returns the bytes freed."""
        self._prepared = None
        for p in self.head.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # nothing may read the arena's bytes now
        if self._rows is not None:  # rows seen while pinned but not fed: the re-enable feeds them
            self._backlog.add(self._rows[0], self._rows[2])
            self._rows = None
        return unpin(self, arena)

    # ---- the target's rows --------------------------------------------------------------

    def observe(self, h: torch.Tensor, tokens: list[int], start: int) -> None:
        """Committed target rows: ``h`` [m, feature_dim] their states at positions start..start+m-1,
        ``tokens`` the m tokens at positions start+1.. (the last may be the one just sampled).
        Their KV rows are made at the next round (prefill chunks: at once, all but the last).
        Ejected (after a first pin), the states go to the host, and the first round after the
        re-enable makes their rows (``_catch_up``): the head's KV then lacks nothing."""
        if h.shape[-1] != self.head.feature_dim:  # states of other streams would be read as its own chained ones
            raise ValueError(f"the MTP head reads the target's streams {self.wants_hidden} ({self.head.feature_dim} "
                             f"values a row), given rows of {h.shape[-1]}: pass hidden={self.wants_hidden}")
        if not self.enabled or self._backlog:
            if self.cache is not None:
                self._backlog.add(h, start)
            return
        if self._rows is not None:  # a prefill chunk after another: feed the earlier rows now
            ph, pt, ps = self._rows
            if len(pt) < ph.shape[0]:  # the prompt's last row waits for its token (the first sampled):
                self._rows = None      # both go to the next round, which reads the tokens from the history
                self._backlog.add(ph, ps)
                self._backlog.add(h, start)
                return
            self._feed(ph, pt, ps)
        self._rows = (h, list(tokens), start)

    def _feed(self, h: torch.Tensor, tokens: list[int], start: int) -> None:
        """Append the rows (their KV) at positions start+1.. (after a gap, their own positions)."""
        n, step = len(tokens), self._step
        self._prepared = None  # its rows overwrite the staged ones
        if n == 0:
            return
        if n <= MAX_N_Q:  # a round's rows: from pinned buffers (a pageable copy would sync the host)
            self.step(self._stage(h, tokens, start), self.cache, False, True)
        else:  # prefill chunks: one eager pass over their own states
            self._set_offset(start)
            step.rows = h.to(step.dtype)
            try:
                step(torch.tensor(tokens, dtype=torch.long, device=self.device), self.cache)
            finally:
                step.rows = step.h_in
        self.committed = self.cache.length

    def _set_offset(self, start: int) -> None:
        """Rows fed from ``start`` sit at positions start + 1..: the offset from the cache's row
        index, written in place (captured steps read it) only when it changes, after a gap."""
        offset = start + 1 - self.cache.length
        if offset != self._offset:
            self._step.offset.fill_(offset)
            self._offset = offset

    def _stage(self, h: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        """The rows' states and tokens into the static input buffers; the token ids' view."""
        n = len(tokens)
        self._set_offset(start)
        self._ids.stage().numpy()[:n] = tokens
        self._ids.send()
        self._step.h_in[:n].copy_(h)
        return self._ids.dst[:n]

    def warm(self) -> None:
        """CUDA: compile (and capture) a feed or draft step of each width a round uses, and a
        round's chain of each feed width at the longest draft."""
        if self.enabled:
            warm_widths(self.step, self.cache, [(w, False, True) for w in range(1, self.max_width + 1)])
            n = self.max_width - 1
            if self.device.type == "cuda" and n > 0:
                # every feed width, and a whole verify's feed launched ahead (``propose_ahead``)
                for w, ahead in [(w, False) for w in range(1, self.max_width + 1)] + [(self.max_width, True)]:
                    if w + n - 1 <= CHAIN_ROWS:  # rows past the length, rolled back as a round's drafts are
                        length, committed = self.cache.length, self.committed
                        self._run_chain(w, n, ahead)
                        self.cache.truncate(length)
                        self.committed = committed

    # ---- drafting -----------------------------------------------------------------------

    def _catch_up(self, history: list[int]) -> tuple[torch.Tensor, list[int], int]:
        """Make the rows of the states seen while ejected (their tokens: ``history``'s, which holds
        position p at index p), in runs of consecutive positions, all but the last; that one's
        (state, token, position) starts the round's chain."""
        *runs, (start, h) = self._backlog.take(self.device)
        for at0, rows in runs + [(start, h[:-1])]:
            for lo in range(0, rows.shape[0], CATCH_UP_CHUNK):
                piece, at = rows[lo:lo + CATCH_UP_CHUNK], at0 + lo
                self._feed(piece, history[at + 1:at + 1 + piece.shape[0]], at)
        last = start + h.shape[0] - 1
        return h[-1:], history[last + 1:last + 2], last

    def _draft(self, history: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """n greedy draft tokens and their ``p_min`` mask, on the device (no host sync): the
        rows committed since the last round fed, then the draft steps, as one pass (``_run_chain``);
        rows that do not fit in it (a prefill chunk's, a re-enable's catch-up) are fed first."""
        if not self.enabled or (self._rows is None and not self._backlog):
            return None
        if self._backlog:
            h, toks, start = self._catch_up(history)
        else:
            h, toks, start = self._rows
            self._rows = None
            if len(toks) == h.shape[0] - 1:  # the prefill's last row: its token is the one sampled after it
                toks = toks + [history[-1]]
        if len(toks) + n - 1 > CHAIN_ROWS:  # all but the last row on their own
            self._feed(h[:-1], toks[:-1], start)
            h, toks, start = h[-1:], toks[-1:], start + len(toks) - 1
        prepared, self._prepared = self._prepared, None
        if prepared is None or prepared[0] != start or len(toks) > prepared[1]:
            self._stage(h, toks, start)  # (else ``prepare`` staged these rows, before the readback told their count)
        self._round = n
        return self._run_chain(len(toks), n)

    def _chain(self, w: int, n: int, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A round's device work between one ``begin(w + n - 1)`` and its ``commit``: the feed of
        the w staged rows, then n - 1 draft steps, each a row of its own (``sub_pass``) fed the
        step before's output state and token; (tokens [n] as target ids, the ``p_min`` stop as a
        mask [n]: ``stop_mask``). The same kernels on the same rows as a feed and n - 1
        separate steps, so the same tokens, with one host pass instead of n. ``ahead``: the feed
        is a whole verify's rows, of which the first ``_accepted_rows`` + 1 are kept: the chain
        starts from the last kept row, and its steps' rows are where the device staged them
        (``propose_ahead``), over the rejected rows' (never read: beyond each step's length)."""
        head, step, cache = self.head, self._step, self.cache
        pos = cache.sub_pass(0, w)
        logits, g = head.block(step.h_in[:w], self._ids.dst[:w], pos + step.offset, cache)
        if ahead:
            logits, g = logits.index_select(0, self._accepted_rows), g.index_select(0, self._accepted_rows)
        tokens, top = [], []
        for i in range(n):
            t, p = pick(logits[-1], self.p_min, self._argmax)
            tokens.append(head.to_target(t.view(1)))
            top += [p] if p is not None else []
            if i + 1 < n:
                pos = cache.sub_pass(w + i, 1)
                logits, g = head.block(g[-1:], tokens[-1], pos + step.offset, cache)
        return torch.cat(tokens), stop_mask(top, n, self.p_min, self.n_min, self.device)

    def _run_chain(self, w: int, n: int, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``_chain`` over the staged rows: eager, or (``graphs``) a graph captured once per (w, n, ahead)
        for the head's weights and the cache's layout. The fed rows become committed history;
        the drafted ones are rolled back after verification (``_accepted``)."""
        cache = self.cache
        cache.begin(w + n - 1)
        if self.graphs:  # (the weights' addresses, as ``pin`` took them, and the cache's layout)
            out = self.chains.run((w, n, ahead), lambda: self._chain(w, n, ahead), cache,
                                  (self._graphed_at, cache.layout_key()))
        else:
            with cache.compute():
                out = self._chain(w, n, ahead)
        cache.commit()
        self.committed = cache.length - (n - 1)
        return out

    def prepare(self, kept: torch.Tensor, start: int, h: torch.Tensor | None = None,
                accepted: torch.Tensor | None = None, fed: torch.Tensor | None = None, ahead: int = 0) -> None:
        """Stage the next round's feed before this round's readback, while the device verifies (the
        host would only wait): the feed is this round's kept rows, a prefix of the verify's w rows
        (its states ``h`` [w, feature_dim] from position ``start``, their next tokens ``kept`` [w],
        on the device); the drafted rows roll back now, and the head's cache stages the pass of the
        widest feed and draft. After the readback the round that ``observe`` hands the kept rows
        to launches without staging them (``_draft``); any other use of the head discards this.
        ``accepted`` (int64 [1] on the device, the verify's accepted drafts) is kept for a chain
        ``propose_ahead`` launches before the readback. ``fed`` and ``ahead`` (the verify's input and the
        next round's length where it launches ahead) are the draft model's: the head stages the whole
        verify's rows either way."""
        if h is None:
            return
        w = h.shape[0]
        if not self.enabled or self._backlog or self._rows is not None or self.cache is None:
            return
        self.cache.truncate(self.committed)  # as ``_accepted`` does after the readback
        self._set_offset(start)
        self._ids.dst[:w].copy_(kept)
        self._step.h_in[:w].copy_(h)
        if accepted is not None:
            self._accepted_rows.copy_(accepted.view(1))
        self.cache.stage_ahead(min(CHAIN_ROWS, w + self.max_width - 2))
        self._prepared = (start, w, accepted is not None)

    def propose_ahead(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next round's chain, launched right after ``prepare``, before this round's readback (the
        engine's ``_DeviceRound``): the device drafts while the host reads the round back and does its
        bookkeeping, instead of waiting for it. The feed is the verify's w rows whatever was kept (the
        host does not know yet): the chain starts from row ``accepted`` (``_chain(ahead=True)``) and
        its n - 1 steps' rows are staged by the device after the kept ones. ``read_device_round``
        then tells the host how many fed rows are history; this round's ``observe`` is not needed
        (the engine skips it). None (launch after the readback) where the pass would re-plan (a page
        opening stages it from the host), nothing was staged for it, or the pass is wider than a chain."""
        prepared, cache = self._prepared, self.cache
        if prepared is None or not prepared[2] or cache is None:
            return None
        w, at = prepared[1], cache.length
        if n <= 0 or w + n - 1 > CHAIN_ROWS or cache.replans(w + n - 1) or not cache.staged_ahead(w + n - 1):
            return None  # (what ``begin`` stages from the host would undo the rows staged below)
        cache.restage_rows_on_device(w, self._accepted_rows, at + 1, n - 1)  # rows at + accepted + 1..
        self._prepared, self._ahead, self._round = None, at, n
        self.stats.calls += 1
        return self._run_chain(w, n, ahead=True)

    def propose_device(self, history: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``DraftModel.propose_device``'s contract: (tokens [n], valid [n]) without a host sync."""
        out = self._draft(history, n)
        if out is not None:
            self.stats.calls += 1
        return out

    def cancel_device_round(self) -> None:
        """Drop the round ``propose_device`` launched, unverified (``Chain.cancel_device``): its drafted
        rows go; the rows it fed are committed history, as after a verified round."""
        if self._round:
            self.cache.truncate(self.committed)
            self._round = 0
            self.stats.calls -= 1

    def read_device_round(self, tokens: list[int], n_valid: int, kept: list[int]) -> None:
        """A verified round's tokens, read back. With the next chain launched ahead (``propose_ahead``),
        its feed's first ``len(kept)`` rows are now known history: the host's length drops the rest
        (the device's rows stay where its steps read them)."""
        if self._ahead is not None:
            self.committed, self._ahead = self._ahead + len(kept), None
            self.cache.truncate(self.committed)
        else:
            self._round = 0
            if not n_valid:  # every draft masked (p_min): no feedback comes (Speculator.accepted): the rows go now
                self.cache.truncate(self.committed)
        if n_valid:
            self.stats.drafts += 1
            self.stats.drafted_tokens += n_valid

    def _propose(self, history: list[int], n_max: int, state) -> list[int]:
        out = self._draft(history, n_max)
        if out is None:
            return []
        tokens, valid = out
        draft = tokens[:int(valid.sum())].tolist()  # the host path: the mask's prefix (none under n_min)
        if not draft:
            self._accepted(0, 0)
        return draft

    def _accepted(self, n_drafted: int, n_accepted: int) -> None:
        self.cache.truncate(self.committed)  # drafted rows go; the accepted ones come back as committed rows


@register("mtp")
def _factory(head: MTPHead, device: str | torch.device = "cpu", max_tokens: int = 4096, **options) -> MTPDraft:
    """``spec.type=mtp``: ``head`` from ``kvstream.model.mtp_gguf.load_head``; ``options`` as :class:`MTPDraft`."""
    return MTPDraft(head, device, max_tokens=max_tokens, **options)
