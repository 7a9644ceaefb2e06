"""Paged, quantized, host-authoritative KV cache in the phase arena: resident or streamed.

Same interface as ``ContiguousCache`` (begin / attend / commit / truncate), so the model does
not change between modes. Per forward pass of n new tokens at positions [L, L + n):

1. ``begin``: the pages being written join the resident set (policy: ``policies.residency``);
   pages that enter it are uploaded from the host store; page tables and streaming rounds are
   rebuilt only when residency changes (``paged_plan``).
2. ``attend(layer, ...)``: quantize-on-store into the tail pages; then attention (``attend_rope``,
   the model's call: a decode pass rotates q and K and stores K and V in one launch first). A *round* is
   a contiguous run of logical pages holding at most half the ring's slots of streamed pages,
   copied host -> ring while the previous round computes (``paged_ring``). One round: a single
   attention call over every page, exactly the resident-mode call. Several rounds: the
   kernel's partials per round, side by side in one buffer sized from shapes, merged. Prefill
   chunks (n > MAX_N_Q) gather dequantized pages and use SDPA.
3. ``commit``: the written rows go back to the host store (every layer's at once), which thus
   holds every committed row; ``truncate`` is a shorter length (stale rows are never read, nor
   written back).

The arena layout and its re-layouts live in ``paged_layout``, the static buffers that captured
decode steps read in ``paged_staging``.
"""

from __future__ import annotations

import time

import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS, PageFormat
from policies.residency import NewestResident

from kvstream.cache.arena import Arena, ArenaTooSmall
from kvstream.cache.contiguous import CacheBase, ContextOverflow, causal_attention
from kvstream.cache.copier import Copier
from kvstream.cache.host_store import HostStore
from kvstream.cache.kv_ops import KVOps, hadamard
from kvstream.cache.paged_layout import ArenaLayout
from kvstream.cache.paged_plan import ResidencyPlan
from kvstream.cache.paged_ring import RingStreaming
from kvstream.cache.paged_staging import PinnedUpload, StepStaging
from kvstream.cache.slab_pool import SlabPool
from kvstream.cache.wait_clock import WaitClock
from kvstream.telemetry import StepStats

MODES = ("resident", "stream")


class PagedCache(ArenaLayout, ResidencyPlan, RingStreaming, StepStaging, CacheBase):
    """A paged KV cache in ``arena``; its parts by job: ``ArenaLayout`` (layout, sizing, slab
    pools), ``ResidencyPlan`` (resident pages, page tables, rounds), ``RingStreaming`` (ring
    copies) and ``StepStaging`` (static buffers of captured steps)."""

    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int, type_k: str,
                 type_v: str, mode: str, arena: Arena, ring_pages: int | None, slabs: dict[str, int],
                 verify_width: int = 1, residency=NewestResident(), both_slabs: bool = False,
                 time_waits: bool = False, rotate: bool = False, pdl: bool = False):
        if mode not in MODES:
            raise ValueError(f"cache.mode={mode!r}; choose one of {', '.join(MODES)}")
        if mode == "stream" and ring_pages is not None and ring_pages < 2:
            raise ValueError(f"cache.ring_pages={ring_pages}: streaming needs >= 2 ring slots (two halves)")
        self.k_fmt = PageFormat(type_k, n_kv_heads, head_dim)
        self.v_fmt = PageFormat(type_v, n_kv_heads, head_dim)
        self.n_layers, self.mode, self.arena, self.residency = n_layers, mode, arena, residency
        # ``rotate``: quantized K (and V) stored in a Walsh-Hadamard basis (CacheConfig.rotate); f16 pages as they are
        quantized = lambda f: f.kv_type.name.lower() != "f16"
        self.rot = hadamard(head_dim).to(arena.device) if rotate and (quantized(self.k_fmt) or quantized(self.v_fmt)) else None
        self.rot_k, self.rot_v = self.rot is not None and quantized(self.k_fmt), self.rot is not None and quantized(self.v_fmt)
        self.max_tokens = max_tokens
        self.max_pages = -(-max_tokens // PAGE_TOKENS)
        self.device = arena.device
        self.host = HostStore(n_layers, self.max_pages, self.k_fmt, self.v_fmt, pin=self.device.type == "cuda")
        self.ops = KVOps(self.device, pdl)  # pdl: the model's kernels launch so (model.gemv), the cache's too
        self.clock = WaitClock(self.device, time_waits)  # each pass's transfer wait (StepStats.wait_s)
        self.copier = Copier(self.device, self.clock)
        self.ring_request = ring_pages if mode == "stream" else 0  # None: sized at each layout
        self.length = 0
        self._n = 0
        self.stats = StepStats()
        self.slabs = slabs  # phase -> compute slab bytes (from the reserve passes)
        # a draft's cache stays in one phase while catch-up chunks and captured one-token steps
        # alternate: both slabs side by side (``both_slabs_bytes``), a pass's width picks one
        self.both_slabs = both_slabs
        self.verify_width = verify_width  # the widest decode batch the decode slab was reserved for
        self.phase = "prefill"
        self._init_step_buffers(n_layers)
        self._layout_version = self._plan_version = self._tables_version = 0
        self._plan_sig = None  # the streamed pages' rounds (and grouping) that the round keys are for
        # every round's key range as device scalars (CUDA), rewritten in place by each plan
        self._keys = torch.zeros(2 * (self.max_pages + 1), dtype=torch.int64, device=self.device)
        self._keys_upload = PinnedUpload(self._keys)
        self._wrap = False  # this decode step streams its first round: it copies the next step's at its end
        self._step_plan = (None,)  # (the plan_key and wrap it is for, shape, copies): RingStreaming.step_plan
        self._primed = None  # the plan_key (layout and plan) whose first round ring half 0 holds, copied by the last step's end
        # CUDA: the compute buffers of the phase's passes, and (both_slabs) of the decode-width ones
        self._pools: tuple[SlabPool | None, SlabPool | None] = (None, None)
        self._pools_at = None  # (arena address, slab bytes) the pools were made for
        # (graph, its owner's dict of entries) captured into the slab: released before it (drop_graphs)
        self.slab_graphs: list[tuple[torch.cuda.CUDAGraph, dict]] = []
        self.relayout()

    def __del__(self):
        # a write-back may still be filling the pinned host store, which torch's host allocator
        # cannot see (a raw 2-D copy): let it land before that memory can be handed out again
        copier = getattr(self, "copier", None)
        if copier is not None and copier.cuda:
            copier.stream.synchronize()
        clock = getattr(self, "clock", None)
        if clock is not None:  # its unread passes and it point at each other: read them, which ends that
            clock.flush()
        if getattr(self, "slab_graphs", None):
            self.drop_graphs()  # whatever order a collection frees this cache and the graphs' owners in
        for pool in getattr(self, "_pools", ()):
            if pool is not None:
                pool.pool = None  # its segments go before the arena's bytes can be reused

    def begin(self, n: int) -> torch.Tensor:
        if self.length + n > self.max_tokens:
            raise ContextOverflow(f"context of {self.length + n} tokens exceeds the cache's {self.max_tokens} "
                                  f"(host store sized for {self.max_pages} pages per layer)")
        if self.phase == "decode" and n > self.verify_width:
            raise ValueError(f"a decode batch of {n} tokens is wider than the reserved verify width "
                             f"{self.verify_width} (1 + the most draft tokens); reserve more at cache creation")
        self.stats = StepStats()
        first, n_pages = self.length // PAGE_TOKENS, self._pages_after(n)
        if n_pages - first > self.capacity:
            raise ArenaTooSmall(f"a batch of {n} tokens at position {self.length} writes {n_pages - first} pages "
                                f"per layer but only {self.capacity} fit in the pool; use smaller prefill chunks "
                                f"or a larger arena")
        self.clock.open_pass()  # past the gates: a pass that is refused does not open
        touched = range(first, n_pages)
        if self.replans(n):
            t0, version = time.perf_counter(), self._plan_version
            self._plan(n_pages, upload_below=-(-self.length // PAGE_TOKENS), writing=touched)
            if self._plan_version != version:
                self.stats.plan_change, self.stats.plan_s = "plan", time.perf_counter() - t0
        self._n = n
        if n <= MAX_N_Q:  # decode widths: computed on the host, one copy into the static buffers (or staged ahead)
            pos, slots = self._staged(n)
        else:  # prefill chunks: on the device
            pos = torch.arange(self.length, self.length + n, device=self.device)
            # once per step, not per layer: every layer's slot of each new row
            slots = self.tables[:, pos // PAGE_TOKENS].long() * PAGE_TOKENS + pos % PAGE_TOKENS
            self._len.fill_(self.length + n)
        self.pos, self.slots = pos, slots
        self._wrap = self.phase == "decode" and n <= MAX_N_Q and bool(self.rounds[0][2])
        if self._wrap and self._primed != self.plan_key():  # a new plan or layout: the ring holds another first round
            self.copier.reset()  # after the last step's readers of half 0
            self._prefetch(0, 0)
            self.copier.wait(0)  # eager, before any captured step: the step itself never waits for it
            self.stats.h2d_bytes += sum(src.numel() for _, src, _ in self.ring_copies(0, 0))  # its first group
        self._primed = None  # known again once this step has run (commit): one failing midway leaves it unknown
        # the length as the kernels read it: a device scalar on CUDA (no per-layer fill)
        if not self.ops.triton:
            self.seq_len = self.length + n
        else:
            self.seq_len = self._lens[n - 1:n] if n <= MAX_N_Q else self._len
        s = self.rounds
        self.stats.streamed_pages = sum(len(r[2]) for r in s)
        self.stats.h2d_bytes += self._ring_bytes  # this step's ring copies
        self.stats.resident_pages = n_pages - self.stats.streamed_pages
        self.stats.rounds = len(s)
        return self.pos

    def _pages_after(self, n: int) -> int:
        return -(-(self.length + n) // PAGE_TOKENS)

    def replans(self, n: int, at: int | None = None) -> bool:
        """Whether a ``begin(n)`` now (or once truncated to ``at``) makes a new residency plan (a page
        opening, a page not resident): one then stages its pass from the host, whatever was staged ahead."""
        at = self.length if at is None else at
        n_pages = -(-(at + n) // PAGE_TOKENS)
        return n_pages != self._n_pages or any(p not in self.slot for p in range(at // PAGE_TOKENS, n_pages))

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], k_new / v_new [n, KVH, D] -> attention output [n, H, D] in q's dtype."""
        if self.rot is None:
            return self._attend(layer, q, k_new, v_new)
        if self.rot.dtype != q.dtype:  # once: the model's dtype
            self.rot = self.rot.to(q.dtype)
        r = self.rot
        if self.rot_k:  # q.k is unchanged (the matrix is orthonormal); K is quantized in the rotated basis
            q, k_new = q @ r, k_new @ r
        out = self._attend(layer, q, k_new, v_new @ r if self.rot_v else v_new)
        return out @ r if self.rot_v else out  # (its own inverse)

    def attend_rope(self, layer: int, qk: torch.Tensor, v: torch.Tensor, rope, q8: bool = False):
        """``attend`` before RoPE (``CacheBase.attend_rope``): a decode pass rotates q and K and
        stores K and V in one launch (``KVOps.rope_store``), and with ``q8`` its attention's merge
        writes the output rows' q8_0 blocks too (the output projection's ``xq``: its programs then do
        not each quantize the row); prefill chunks and rotated pages (whose output is rotated back
        after the merge) rotate first, then attend. Its decode path does not call ``attend``: a
        subclass that overrides ``attend`` overrides this too (``factory._OneLayer``)."""
        if self.rot is not None or self._n > MAX_N_Q:
            return super().attend_rope(layer, qk, v, rope, q8)
        q = self.ops.rope_store(qk, v, rope, self.kspace, self.vspace, self.slots[layer], self.k_fmt, self.v_fmt)
        if not q8:
            return self._attention(layer, q)
        n, heads, d = q.shape
        blocks = (torch.empty((n, heads * d), dtype=torch.int8, device=q.device),
                  torch.empty((n, heads * d // 32), dtype=torch.float16, device=q.device))
        return self._attention(layer, q, blocks), blocks

    def _attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        slots = self.slots[layer]
        self.ops.store(self.kspace, k_new.contiguous(), slots, self.k_fmt)
        self.ops.store(self.vspace, v_new.contiguous(), slots, self.v_fmt)
        return self._attention(layer, q)

    def _attention(self, layer: int, q: torch.Tensor, q8_out: tuple | None = None) -> torch.Tensor:
        """q's attention over every key of the layer, its new rows stored (``q8_out``: a decode pass's
        output rows' q8_0 blocks written too, ``KVOps.attention``)."""
        table = self.tables[layer]
        L = self.length + self._n
        if self._n > MAX_N_Q:
            return self._prefill_attention(layer, q, L)
        # several rounds: one call's splits, each carried across the rounds in one state buffer (sized
        # by the table: the same bytes whatever the plan, as the reserve pass measured them), so the
        # output is the one call's, bit for bit
        state = None if len(self.rounds) == 1 else self.ops.round_state(q, self.k_fmt, table)
        for r, (a, b, streamed) in enumerate(self.rounds):
            if streamed and not (self._wrap and layer < self.group and r == 0):  # wait for the ring's copy
                self.copier.wait(self._half(layer, r))
            if state is None:  # everything in one call: the resident-mode computation
                out = self.ops.attention(q, self.kspace, self.vspace, table, self.seq_len, self.k_fmt, self.v_fmt,
                                         q8_out)
            else:
                start, end = self.round_keys[r]
                out = self.ops.attention_round(state, q, self.kspace, self.vspace, table, self.seq_len, self.k_fmt,
                                               self.v_fmt, start, end, first=r == 0, last=r == len(self.rounds) - 1,
                                               q8_out=q8_out)
            if streamed:
                self.copier.release(self._half(layer, r))
            self._next_copy(layer, r)
        return out

    def _prefill_attention(self, layer: int, q: torch.Tensor, L: int) -> torch.Tensor:
        table = self.tables[layer]
        k = torch.empty((L, self.k_fmt.n_kv_heads, self.k_fmt.head_dim), dtype=q.dtype, device=q.device)
        v = torch.empty_like(k)
        for r, (a, b, _) in enumerate(self.rounds):
            self.copier.wait(self._half(layer, r))
            lo, hi = a * PAGE_TOKENS, min(b * PAGE_TOKENS, L)
            k[lo:hi] = self.ops.gather(self.kspace, table[a:b], hi - lo, self.k_fmt, q.dtype)
            v[lo:hi] = self.ops.gather(self.vspace, table[a:b], hi - lo, self.v_fmt, q.dtype)
            self.copier.release(self._half(layer, r))
            self._next_copy(layer, r)
        return causal_attention(q, k, v)

    def commit(self) -> None:
        """The new rows become history: they go back to the host store, every layer's at once (a
        2-D copy per page for K and one for V when a pass fills whole pages, else one per KV head
        and section: a decode step moves its row, not its page, whose 3 MB a step on the 1.5B
        held the copy engine long enough to delay the next step's token readback)."""
        lo, hi = self.length, self.length + self._n
        spans = [(p, max(lo - p * PAGE_TOKENS, 0), min(hi - p * PAGE_TOKENS, PAGE_TOKENS))
                 for p in range(lo // PAGE_TOKENS, -(-hi // PAGE_TOKENS))]  # every written page is resident (begin)
        if self.copier.cuda:
            copies = [c for span in spans for c in self._row_copies(*span)]
            self.copier.write_back_rows(copies)
            self.stats.d2h_bytes += sum(c[4] * c[5] for c in copies)
        else:
            pairs = [pair for span in spans for pair in self._page_rows(*span)]
            self.copier.write_back(pairs)
            self.stats.d2h_bytes += sum(rows.numel() for _, rows in pairs)
        self._primed = self.plan_key() if self._wrap else None  # this step's end copied its first round
        self.clock.close_pass(self.stats)
        super().commit()
