"""Paged, quantized, host-authoritative KV cache in the phase arena: resident or streamed.

Same interface as ``ContiguousCache`` (begin / attend / commit / truncate), so the model does
not change between modes. Per forward pass of n new tokens at positions [L, L + n):

1. ``begin``: the pages being written join the resident set (policy: ``policies.residency``);
   pages that enter it are uploaded from the host store; page tables and streaming rounds are
   rebuilt only when residency changes (once per 256 tokens in steady decode).
2. ``attend(layer, ...)``: quantize-on-store into the tail pages; then attention. A *round* is
   a contiguous run of logical pages holding at most half the ring's slots of streamed pages;
   its streamed pages are copied host -> ring (one copy per run, on a copy stream, the next
   round's while this one computes; ring halves alternate). When a layer's streamed pages fill
   at most half a ring half, a *group* of layers shares one 2-D copy (a row per layer): every
   copy has a fixed cost of a few microseconds, which small sets otherwise spend more time on
   than on their bytes (``experiments/bench_copies.py``). One round: a single attention
   call over every page, exactly the resident-mode call. Several rounds: the kernel's
   partials per round, side by side in one buffer sized from shapes, merged. Prefill chunks (n > 16) gather dequantized pages and use SDPA.
   A decode step copies the *next* step's first round (of its first group) at its end, under
   its last layer (group) and the LM head (the plan rarely changes between steps; when it does,
   ``begin`` copies it again): copy-bound steps then keep the copy engine busy from one step
   into the next.
3. ``commit``: the written pages go back to the host store, which thus holds every committed
   row; ``truncate`` is a shorter length (stale rows are never read).
"""

from __future__ import annotations

import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS, PageFormat
from policies.residency import NewestResident

from kvstream.cache.arena import Arena, ArenaPlan, ArenaTooSmall, Layout, both_slabs_bytes
from kvstream.cache.contiguous import CacheBase, ContextOverflow, causal_attention
from kvstream.cache.streams import copy_stream
from kvstream.cache.cudart import copy_rows
from kvstream.cache.host_store import HostStore
from kvstream.cache.kv_ops import KVOps
from kvstream.cache.slab_pool import SlabPool
from kvstream.telemetry import StepStats
from kvstream.cache.wait_clock import WaitClock

MODES = ("resident", "stream")
# an automatic ring's halves grow up to this much into bytes no resident page can use: on the
# H200 a host -> device copy costs ~2.8 us besides its bytes (55 GB/s pinned), so one layer's
# few streamed pages per copy reach only 36-80% of the pinned rate, several layers' together
# most of it (results/stream/copy_ways.csv)
RING_HALF_BYTES = 4 * 2**20


def group_size(n_layers: int, fit: int) -> int:
    """Layers per ring copy when a ring half holds ``fit`` layers' streamed pages: the fewest
    groups, their count even (> 1), so the next step's first group (ring half 0) is copied while
    this step's last group reads half 1; 1 when no such grouping fits."""
    n = max(2, -(-n_layers // max(1, fit)))
    for n_groups in range(n + n % 2, n_layers + 1, 2):
        g = -(-n_layers // n_groups)
        if g <= fit and -(-n_layers // g) % 2 == 0:
            return g
    return 1


def copy_runs(pages: list[int]) -> list[tuple[int, int]]:
    """(first page, count) of the host -> ring copies of a round's streamed pages: one copy when
    they are contiguous (the newest-resident policy streams the oldest), else one per page."""
    a, n = pages[0], len(pages)
    return [(a, n)] if pages[-1] - a == n - 1 else [(p, 1) for p in pages]


class _Copier:
    """Host<->device copies on a side stream with events (CUDA); plain copies elsewhere."""

    def __init__(self, device: torch.device, clock: WaitClock):
        self.cuda = device.type == "cuda"
        self.clock = clock  # times what the compute stream waits for or runs itself
        if self.cuda:
            # an int: torch.cuda.current_stream(None or a device) looks the device index up on
            # each call, and a captured pass makes ~240 of these calls (results/capture)
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = copy_stream(device)  # never the capture stream
            self.ready = [torch.cuda.Event(), torch.cuda.Event()]
            self.free = [torch.cuda.Event(), torch.cuda.Event()]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, half: int) -> None:
        """Host rows -> ring rows (2-D views, one copy) in half ``half``, after that half's
        previous reader is done."""
        if not self.cuda:  # synchronous: the compute "stream" itself does it
            with self.clock.timing():
                dst.copy_(src)
            return
        self.stream.wait_event(self.free[half])  # explicit streams throughout: no stream context to enter
        copy_rows(dst, src, self.stream)
        self.ready[half].record(self.stream)

    def write_back(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Arena rows -> a strided host view (one page of every layer), after the compute
        stream's writes to them; asynchronous (one 2-D copy), so the host does not wait for
        the step. The source is the arena itself: nothing is freed under the copy."""
        if not self.cuda:
            with self.clock.timing():
                dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.index))
        copy_rows(dst, src, self.stream)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A strided host view -> arena rows, on the compute stream (after ``wait``: the host
        rows may still be arriving from a write-back): one 2-D copy, the host never reads."""
        with self.clock.timing():
            if not self.cuda:
                dst.copy_(src)
                return
            copy_rows(dst, src, torch.cuda.current_stream(self.index))

    def reset(self) -> None:
        """Both ring halves are free once the compute stream's work so far is done. Recorded
        afresh by every step (and eagerly before copies issued outside one): an event last
        recorded inside a graph capture cannot be waited on outside it."""
        if self.cuda:
            s = torch.cuda.current_stream(self.index)
            for e in self.free:
                e.record(s)

    def wait(self, half: int | None = None) -> None:
        """The compute stream waits for ring half ``half``'s copy (None: every copy so far)."""
        if self.cuda:
            s = torch.cuda.current_stream(self.index)
            with self.clock.timing():
                s.wait_event(self.ready[half]) if half is not None else s.wait_stream(self.stream)

    def release(self, half: int) -> None:
        if self.cuda:
            self.free[half].record(torch.cuda.current_stream(self.index))


class PagedCache(CacheBase):
    def __init__(self, *, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int, type_k: str,
                 type_v: str, mode: str, arena: Arena, ring_pages: int | None, slabs: dict[str, int],
                 verify_width: int = 1, residency=NewestResident(), both_slabs: bool = False,
                 time_waits: bool = False):
        if mode not in MODES:
            raise ValueError(f"cache.mode={mode!r}; choose one of {', '.join(MODES)}")
        if mode == "stream" and ring_pages is not None and ring_pages < 2:
            raise ValueError(f"cache.ring_pages={ring_pages}: streaming needs >= 2 ring slots (two halves)")
        self.k_fmt = PageFormat(type_k, n_kv_heads, head_dim)
        self.v_fmt = PageFormat(type_v, n_kv_heads, head_dim)
        self.n_layers, self.mode, self.arena, self.residency = n_layers, mode, arena, residency
        self.max_tokens = max_tokens
        self.max_pages = -(-max_tokens // PAGE_TOKENS)
        self.device = arena.device
        self.host = HostStore(n_layers, self.max_pages, self.k_fmt, self.v_fmt, pin=self.device.type == "cuda")
        self.ops = KVOps(self.device)
        self.clock = WaitClock(self.device, time_waits)  # each pass's transfer wait (StepStats.wait_s)
        self.copier = _Copier(self.device, self.clock)
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
        # static step buffers, written in place by begin: a captured step (kvstream.engine.graphs)
        # reads them. One tensor (positions, every layer's slots, the length), so a decode step
        # fills it with one host->device copy instead of ~10 small kernels
        w = MAX_N_Q
        self._step = torch.zeros(w + n_layers * w + 1, dtype=torch.int64, device=self.device)
        self._pos, self._len = self._step[:w], self._step[-1:]
        self._slots = self._step[w:-1].view(n_layers, w)
        # host staging for it, two buffers in turn: a step writes one while the previous step's
        # copy may still read the other; an event per buffer says when its copy has read it
        self._stage = [torch.empty(self._step.shape, dtype=torch.int64, pin_memory=self.copier.cuda) for _ in range(2)]
        self._staged = [torch.cuda.Event() for _ in range(2)] if self.copier.cuda else None
        self._n_staged = 0
        self._layout_version = self._plan_version = 0
        self._plan_sig = None  # the streamed pages' rounds (and grouping) that the round keys are for
        self._wrap = False  # this decode step streams its first round: it copies the next step's at its end
        self._primed = None  # the plan_key (layout and plan) whose first round ring half 0 holds, copied by the last step's end
        # CUDA: the compute buffers of the phase's passes, and (both_slabs) of the decode-width ones
        self._pools: tuple[SlabPool | None, SlabPool | None] = (None, None)
        self._pools_at = None  # (arena address, slab bytes) the pools were made for
        self.relayout()

    def set_phase(self, phase: str) -> None:
        """Switch phase (prefill -> decode): the slab shrinks to the decode peak and the pool
        takes the bytes back; resident pages are re-laid from the host store."""
        if phase != self.phase:
            self.phase = phase
            self.wait_write_backs()
            self.arena.release_layout()
            self.relayout()

    def rearrange(self, change):
        """Re-lay the arena around a change of its pinned region: ``change()`` pins or releases
        (a draft's re-enable or eject) while no layout holds the bytes; the pool then takes what
        is free and resident pages are re-uploaded from the host store. Returns ``change()``."""
        self.wait_write_backs()
        self.arena.release_layout()
        out = change()
        self.relayout()
        return out

    def __del__(self):
        # a write-back may still be filling the pinned host store, which torch's host allocator
        # cannot see (a raw 2-D copy): let it land before that memory can be handed out again
        copier = getattr(self, "copier", None)
        if copier is not None and copier.cuda:
            copier.stream.synchronize()
        clock = getattr(self, "clock", None)
        if clock is not None:  # its unread passes and it point at each other: read them, which ends that
            clock.flush()
        for pool in getattr(self, "_pools", ()):
            if pool is not None:
                pool.pool = None  # its segments go before the arena's bytes can be reused

    def _pool_for(self, n: int) -> SlabPool | None:
        """The pool of a pass of ``n`` tokens (CUDA): the phase's slab, or with ``both_slabs`` the
        decode slab for decode widths."""
        phase, steps = self._pools
        return steps if steps is not None and n <= MAX_N_Q else phase

    @property
    def slab_pool(self) -> SlabPool | None:
        """Where the pass in progress (between ``begin`` and ``commit``) takes its device buffers."""
        return self._pool_for(self._n)

    def recycles(self, n: int) -> bool:
        """A pass of ``n`` tokens starts on an empty pool: a prefill slab's, or a ``both_slabs``
        cache's catch-up slab (their sizes grow with the prefix, see ``SlabPool.recycle``), which
        no captured graph can keep."""
        pool = self._pool_for(n)
        return pool is not None and pool is self._pools[0] and (self.phase == "prefill" or self.both_slabs)

    def compute(self):
        """A forward pass's device buffers come from the slab (CUDA)."""
        if self.recycles(self._n):
            self._pools[0].recycle()
        return super().compute()

    def close_slab(self) -> None:
        """Give the slab's compute buffers back (the slab moves or shrinks at a re-layout); the
        next layout makes new pools."""
        for pool in self._pools:
            if pool is not None:
                pool.close()
        self._pools, self._pools_at = (None, None), None

    def _slab_bytes(self) -> int:
        return both_slabs_bytes(self.slabs) if self.both_slabs else self.slabs[self.phase]

    def wait_write_backs(self) -> None:
        """Work on the compute stream from now on runs after every write-back issued so far:
        call it before the arena's bytes change hands (a re-layout, an eject), since the
        write-backs read the arena asynchronously."""
        self.copier.wait()

    def move_to(self, arena: Arena) -> None:
        """Live in ``arena`` from now on (a draft's KV re-pinned); the pages come back from the
        host store, which holds every committed row. The same bytes as before (a re-enable pins
        the draft KV where it was) keep the layout and its tensors: the captured steps stay valid."""
        if arena.device != self.device:
            raise ValueError(f"cannot move a cache on {self.device} to an arena on {arena.device}")
        if (arena.buf.data_ptr(), arena.nbytes) == (self.arena.buf.data_ptr(), self.arena.nbytes):
            self.copier.wait()  # the host copies of the pages were written on the copy stream
            self._upload([p for p in self.slot if p * PAGE_TOKENS < self.length])  # those holding committed rows
            return
        self.arena = arena
        self.relayout()

    # ---- layout and residency ------------------------------------------------------------

    def relayout(self) -> Layout:
        """(Re)build the arena layout: at a phase switch, or when the pinned region changed."""
        # resident mode holds every page; streaming needs the pages one verify batch can write
        min_pages = self.max_pages if self.mode == "resident" else min(self.max_pages, 2)
        slab_bytes = self._slab_bytes()
        if self._pools_at != (self.arena.buf.data_ptr(), slab_bytes):
            self.close_slab()  # the slab moves or shrinks: its buffers go before pages take its bytes
        self.ring_pages = self.ring_request if self.ring_request is not None else self._auto_ring(slab_bytes)
        try:
            self.layout = self.arena.lay_out(slab_bytes, self.ring_pages, self.k_fmt.page_bytes,
                                             self.v_fmt.page_bytes, self.n_layers * min_pages)
        except ArenaTooSmall as e:
            raise ArenaTooSmall(f"cache.mode={self.mode}, {self.max_tokens} tokens x {self.n_layers} layers "
                                f"({self.k_fmt.kv_type.name}/{self.v_fmt.kv_type.name}): {e}") from None
        self.capacity = min(self.layout.pool_pages // self.n_layers, self.max_pages)  # pages per layer
        if self._pools == (None, None) and self.device.type == "cuda":
            pool = lambda at, n, name: SlabPool(self.arena.view(at, (n,), torch.uint8), name) if n else None
            self._pools_at = (self.arena.buf.data_ptr(), slab_bytes)
            if self.both_slabs:
                steps = self.slabs["decode"]
                self._pools = (pool(0, self.slabs["prefill"], "catch-up slab"),
                               pool(slab_bytes - steps, steps, "step slab"))
            else:
                self._pools = (pool(0, slab_bytes, f"{self.phase} slab"), None)
        self.kspace, self.vspace = self.arena.pages(self.layout)
        self.slot: dict[int, int] = {}  # resident logical page -> index in [0, capacity)
        self.tables_host = torch.zeros((self.n_layers, self.max_pages), dtype=torch.int32)
        self.tables = torch.zeros_like(self.tables_host, device=self.device)
        self._layout_version += 1
        self.rounds: list[tuple[int, int, list[int]]] = []  # (first page, end page, streamed pages)
        self._n_pages = 0
        self._plan(-(-self.length // PAGE_TOKENS), upload_below=-(-self.length // PAGE_TOKENS))
        return self.layout

    def _auto_ring(self, slab_bytes: int, extra_pinned_bytes: int = 0) -> int:
        """The smallest ring whose halves each hold every page a layer streams at full context,
        given the most resident pages per layer that then fit: one attention call per layer.
        The ring is shared by all layers, so it costs ring / n_layers resident pages per layer,
        while every extra round costs launches and a merge. Bytes left over that cannot hold
        another resident page in every layer widen the halves, up to ``RING_HALF_BYTES`` (and
        half the layers' streamed pages): layers streaming a few pages then share copies, at
        no cost in resident pages."""
        pair = self.k_fmt.page_bytes + self.v_fmt.page_bytes
        total = ArenaPlan(slab_bytes, 0, pair, self.arena.pinned_bytes + extra_pinned_bytes).pool_pages(
            self.arena.nbytes)  # page pairs that fit at most, ring and pool together
        P, L = self.max_pages, self.n_layers
        for c in range(P, 1, -1):  # most resident pages first
            S = P - c
            if L * c + 2 * max(1, S) <= total:
                widest = max(1, S, min(-(-RING_HALF_BYTES // pair), -(-L // 2) * S))
                return 2 * min(widest, (total - L * c) // 2)
        return 2  # too small for even 2 resident pages: lay_out reports the numbers

    def capacity_if_pinned(self, extra_pinned_bytes: int) -> int:
        """Pages per layer this phase's layout would hold with ``extra_pinned_bytes`` more (or
        fewer) pinned: the layout's own arithmetic, an automatic ring re-sized as well."""
        slab, extra = self.layout.slab, extra_pinned_bytes
        ring = self.ring_request if self.ring_request is not None else self._auto_ring(slab, extra)
        plan = ArenaPlan(slab, ring, self.layout.pair, self.arena.pinned_bytes + extra)
        return plan.capacity(self.arena.nbytes, self.n_layers, self.max_pages)

    def _pool_slot(self, layer, j):  # ints, or int tensors (every layer at once)
        return self.ring_pages + layer * self.capacity + j

    def _page_rows(self, p: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(host view, pool rows) of resident page ``p`` of every layer, for K and for V: the
        pool holds layer l's copy ``capacity`` slots after layer l - 1's, so both sides are one
        strided 2-D view (one copy each way)."""
        j, last, cap = self._pool_slot(0, self.slot[p]), self.n_layers - 1, self.capacity
        return ((self.host.k[:, p], self.kspace[j:j + last * cap + 1:cap]),
                (self.host.v[:, p], self.vspace[j:j + last * cap + 1:cap]))

    def _upload(self, pages) -> None:
        """Resident pages ``pages`` of every layer from the host store (after ``copier.wait``)."""
        for p in pages:
            for host, rows in self._page_rows(p):
                self.copier.upload(rows, host)
            self.stats.h2d_bytes += self.n_layers * self.layout.pair

    def _plan(self, n_pages: int, upload_below: int, writing: range = range(0)) -> None:
        """Make the policy's resident set for ``n_pages`` pages current; pages entering it that
        hold committed rows (``< upload_below``) are uploaded from the host store. Pages being
        written (``writing``) are resident whatever the policy says: the store kernel and the
        write-back address them in the pool; they displace the policy's last other pages."""
        want = list(self.residency.resident(n_pages, self.capacity))
        if len(want) > self.capacity or any(not 0 <= p < n_pages for p in want):
            raise ValueError(f"residency policy returned {len(want)} pages for capacity {self.capacity}")
        if any(p not in want for p in writing):
            others = [p for p in want if p not in writing]
            want = others[:self.capacity - len(writing)] + list(writing)
        keep = set(want)
        for p in [p for p in self.slot if p not in keep]:
            del self.slot[p]
        free = sorted(set(range(self.capacity)) - set(self.slot.values()))
        uploads = []
        self.copier.wait()  # the host copies of those pages were written on the copy stream
        for p in want:
            if p not in self.slot:
                self.slot[p] = free.pop(0)
                if p < upload_below:
                    uploads.append(p)
        self._upload(uploads)
        # rounds: contiguous page runs with at most half the ring of streamed pages each
        half = max(1, self.ring_pages // 2)
        self.rounds, start, streamed = [], 0, []
        for p in range(n_pages):
            if p not in self.slot:
                if len(streamed) == half:
                    self.rounds.append((start, p, streamed))
                    start, streamed = p, []
                streamed.append(p)
        self.rounds.append((start, n_pages, streamed))
        streamed = len(self.rounds[0][2])
        self.group = group_size(self.n_layers, half // streamed) if len(self.rounds) == 1 and streamed else 1
        # a captured step depends on the plan only through its copies, round keys and split counts:
        # all set by the streamed pages (and their grouping). The last round runs to the sequence's
        # end, its splits sized to the table's, so a new page that leaves the streamed pages as they
        # were (nothing streamed, or a residency step) keeps the graphs, in one round or several
        sig = (tuple((a, tuple(pages)) for a, _, pages in self.rounds), self.group)
        if sig != self._plan_sig:
            keys = [(a * PAGE_TOKENS, b * PAGE_TOKENS if i < len(self.rounds) - 1 else None)
                    for i, (a, b, _) in enumerate(self.rounds)]
            if self.ops.triton:  # as device scalars, made once per plan rather than per layer and round
                flat = torch.tensor([k if k is not None else 0 for ab in keys for k in ab], device=self.device)
                keys = [(flat[2 * i:2 * i + 1], None if e is None else flat[2 * i + 1:2 * i + 2])
                        for i, (_, e) in enumerate(keys)]
            self.round_keys = keys  # kept with the plan: its captured steps read these tensors
            self._plan_sig = sig
            self._plan_version += 1  # new key tensors: a plan that comes back (A, B, A) is new to the graphs
        # the page tables, a column per page for all layers at once (per-element writes from
        # Python took 5-20 ms per plan at 28 layers x 128 pages: results/capture)
        layers = torch.arange(self.n_layers, dtype=torch.int32)[:, None]  # _half and _pool_slot take it whole
        for r, (_, _, pages) in enumerate(self.rounds):
            if pages:
                base = self._half(layers, r) * half + (layers % self.group) * len(pages)  # a group's layers side by side
                self.tables_host[:, pages] = base + torch.arange(len(pages), dtype=torch.int32)
        if self.slot:
            pages, slots = zip(*self.slot.items())
            self.tables_host[:, list(pages)] = self._pool_slot(layers, torch.tensor(slots, dtype=torch.int32))
        self.tables.copy_(self.tables_host)
        self._n_pages = n_pages

    def _half(self, layer, r: int):  # layer: an int, or an int tensor
        return ((layer // self.group) * len(self.rounds) + r) % 2  # consecutive copies alternate halves

    # ---- the cache interface ------------------------------------------------------------

    def begin(self, n: int) -> torch.Tensor:
        if self.length + n > self.max_tokens:
            raise ContextOverflow(f"context of {self.length + n} tokens exceeds the cache's {self.max_tokens} "
                                  f"(host store sized for {self.max_pages} pages per layer)")
        if self.phase == "decode" and n > self.verify_width:
            raise ValueError(f"a decode batch of {n} tokens is wider than the reserved verify width "
                             f"{self.verify_width} (1 + the most draft tokens); reserve more at cache creation")
        self.stats = StepStats()
        first, n_pages = self.length // PAGE_TOKENS, -(-(self.length + n) // PAGE_TOKENS)
        if n_pages - first > self.capacity:
            raise ArenaTooSmall(f"a batch of {n} tokens at position {self.length} writes {n_pages - first} pages "
                                f"per layer but only {self.capacity} fit in the pool; use smaller prefill chunks "
                                f"or a larger arena")
        self.clock.open_pass()  # past the gates: a pass that is refused does not open
        touched = range(first, n_pages)
        if n_pages != self._n_pages or any(p not in self.slot for p in touched):
            self._plan(n_pages, upload_below=-(-self.length // PAGE_TOKENS), writing=touched)
        self._n = n
        if n <= MAX_N_Q:  # decode widths: computed on the host, one copy into the static buffers
            pos, slots = self._stage_step(n)
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
            self.stats.h2d_bytes += len(self.rounds[0][2]) * self.group * self.layout.pair  # its first group
        self._primed = None  # known again once this step has run (commit): one failing midway leaves it unknown
        # the length as the kernels read it: a device scalar on CUDA (no per-layer fill)
        self.seq_len = self._len if self.ops.triton else self.length + n
        s = self.rounds
        self.stats.streamed_pages = sum(len(r[2]) for r in s)
        self.stats.h2d_bytes += self.stats.streamed_pages * self.n_layers * self.layout.pair  # this step's ring copies
        self.stats.resident_pages = n_pages - self.stats.streamed_pages
        self.stats.rounds = len(s)
        return self.pos

    def _stage_step(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and slots of a decode step from the host's page tables, written into the
        static buffers by one copy from a pinned staging buffer (no allocation per step)."""
        w, i = MAX_N_Q, self._n_staged % 2
        self._n_staged += 1
        stage = self._stage[i]
        if self._staged:
            self._staged[i].synchronize()  # recorded two steps ago: done long since, in practice
        pos = torch.arange(self.length, self.length + n)
        stage[:n] = pos
        stage[w:-1].view(self.n_layers, w)[:, :n] = \
            self.tables_host[:, pos // PAGE_TOKENS].long() * PAGE_TOKENS + pos % PAGE_TOKENS
        stage[-1] = self.length + n
        self._step.copy_(stage, non_blocking=True)
        if self._staged:
            self._staged[i].record()
        return self._pos[:n], self._slots[:, :n]

    def start_step(self) -> None:
        """The device side of a step begins (the model calls it before layer 0): the first
        round's copies, unless the step before made them. Part of a captured step, so its copies
        replay with it; the ring-half events are recorded here first, so every wait inside the
        step refers to this step."""
        self.copier.reset()
        if not self._wrap:  # else the last step's end (or begin) copied it, and the compute stream waited
            self._prefetch(0, 0)

    def end_step(self) -> None:
        """The device side of a step ends (after the LM head): the compute stream waits for the
        next step's first round, copied meanwhile, so a captured step ends joined and the next
        step (a graph replay or eager) reads ring half 0 without a wait."""
        if self._wrap:
            self.copier.wait(0)

    def plan_key(self) -> tuple:
        """What a captured step depends on besides the static buffers: layout, plan and whether
        the waits are stamped (a graph keeps the stamps it was captured with)."""
        return (self._layout_version, self._plan_version, self.clock.enabled)

    def ring_copies(self, layer: int, r: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(ring rows, host rows, ring half) of round ``r`` of the layer group that starts at
        ``layer``: per run of streamed pages, one 2-D copy for K and one for V, a row per layer."""
        pages = self.rounds[r][2]
        if not pages:
            return []
        h, half, S = self._half(layer, r), max(1, self.ring_pages // 2), len(pages)
        n, out, i = min(self.group, self.n_layers - layer), [], 0
        for p, m in copy_runs(pages):
            for ring, host in ((self.kspace, self.host.k), (self.vspace, self.host.v)):
                rows = ring[h * half + i:h * half + (n - 1) * S + i + m]  # layer j's run at row j * S
                dst = rows.as_strided((n, m * ring.shape[1]), (S * ring.shape[1], 1), rows.storage_offset())
                out.append((dst, host[layer:layer + n, p:p + m].flatten(1), h))
            i += m
        return out

    def _prefetch(self, layer: int, r: int) -> None:
        if layer >= self.n_layers:
            if self._wrap:  # the next step's first round, under this step's tail
                self._prefetch(0, 0)
            return
        for dst, src, h in self.ring_copies(layer, r):
            self.copier.copy(dst, src, h)

    def _next_copy(self, layer: int, r: int) -> None:
        """After the first layer of a group read its ring half: the next round's (or group's)
        copy, into the other half, whose last reader has finished."""
        if layer % self.group == 0:
            self._prefetch(*((layer, r + 1) if r + 1 < len(self.rounds) else (layer + self.group, 0)))

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], k_new / v_new [n, KVH, D] -> attention output [n, H, D] in q's dtype."""
        table, slots = self.tables[layer], self.slots[layer]
        self.ops.store(self.kspace, k_new.contiguous(), slots, self.k_fmt)
        self.ops.store(self.vspace, v_new.contiguous(), slots, self.v_fmt)
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
                out = self.ops.attention(q, self.kspace, self.vspace, table, self.seq_len, self.k_fmt, self.v_fmt)
            else:
                start, end = self.round_keys[r]
                out = self.ops.attention_round(state, q, self.kspace, self.vspace, table, self.seq_len, self.k_fmt,
                                               self.v_fmt, start, end, first=r == 0, last=r == len(self.rounds) - 1)
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
        """The new rows become history; their pages go back to the host store (one 2-D copy
        per page for K and one for V)."""
        first, end = self.length // PAGE_TOKENS, -(-(self.length + self._n) // PAGE_TOKENS)
        for p in range(first, end):  # every written page is resident (begin)
            for host, rows in self._page_rows(p):
                self.copier.write_back(host, rows)
        self.stats.d2h_bytes += self.n_layers * (end - first) * self.layout.pair
        self._primed = self.plan_key() if self._wrap else None  # this step's end copied its first round
        self.clock.close_pass(self.stats)
        super().commit()

    def forget_ring(self) -> None:
        """The ring was written outside the cache (a benchmark's copies): the next decode step
        copies its first round again."""
        self._primed = None
