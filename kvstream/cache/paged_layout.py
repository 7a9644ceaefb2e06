"""Arena layout of a paged cache: its slab, ring and resident pool in the phase arena, re-laid at
a phase switch or when the pinned region changes (a draft's eject or re-enable), and the
compute slab pools of its passes (CUDA)."""

from __future__ import annotations

import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS

from kvstream.cache.arena import Arena, ArenaPlan, ArenaTooSmall, Layout, both_slabs_bytes
from kvstream.cache.paged_staging import PinnedUpload
from kvstream.cache.slab_pool import SlabPool

# an automatic ring's halves grow up to this much into bytes no resident page can use: on the
# H200 a host -> device copy costs ~2.8 us besides its bytes (55 GB/s pinned), so one layer's
# few streamed pages per copy reach only 36-80% of the pinned rate, several layers' together
# most of it (results/stream/copy_ways.csv)
RING_HALF_BYTES = 4 * 2**20


class ArenaLayout:
    """PagedCache's layout part: ``layout``, ``capacity`` (resident pages per layer), ``ring_pages``,
    the page spaces ``kspace`` / ``vspace`` and the slab pools."""

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

    def keep_graph(self, graph: torch.cuda.CUDAGraph, owner: dict) -> None:
        """``graph`` was captured into this cache's slab by ``owner``, the dict in which its owner keeps its
        graphs and their output buffers (also the slab's): ``drop_graphs`` empties that dict, then releases the
        graph, before the slab goes. A graph or a buffer outliving its pool aborts the process, and a garbage
        collection may free the cache before the graph's owner."""
        self.slab_graphs.append((graph, owner))

    def forget_graphs(self, owner: dict) -> None:
        """``owner`` freed its graphs itself."""
        self.slab_graphs = [(g, o) for g, o in self.slab_graphs if o is not owner]

    def drop_graphs(self) -> None:
        """Release every graph captured into the slab, their owners' entries (output buffers) first: an
        owner then captures anew (owners drop them at a re-layout too, before anything replays)."""
        if self.slab_graphs:
            torch.cuda.synchronize(self.device)  # none may be running while its executable goes
            for owner in {id(o): o for _, o in self.slab_graphs}.values():
                owner.clear()
            for g, _ in self.slab_graphs:
                g.reset()
            self.slab_graphs = []

    def close_slab(self) -> None:
        """Give the slab's compute buffers back (the slab moves or shrinks at a re-layout); the
        next layout makes new pools."""
        self.drop_graphs()
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
        self._tables_upload = PinnedUpload(self.tables)
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
