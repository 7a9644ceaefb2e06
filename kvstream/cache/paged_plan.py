"""The residency plan of a paged cache: which logical pages stay resident in the pool, the page
tables that point every layer's pages at their pool or ring slot, and the streaming rounds.

Resident page ``p`` of layer ``l`` sits at slot ``ring_pages + l * capacity + j`` of the page
space (``j``: its pool slot); a streamed page at its place in its round's ring half. The plan
is rebuilt only when residency changes (once per 256 tokens in steady decode)."""

from __future__ import annotations

import torch

from kernels.formats import PAGE_TOKENS

from kvstream.cache.paged_ring import group_size


class ResidencyPlan:
    """PagedCache's plan part: ``slot`` (resident page -> pool slot), ``rounds`` (first page, end
    page, streamed pages), ``group`` (layers per ring copy), ``round_keys`` and the page tables."""

    def _pool_slot(self, layer, j):  # ints, or int tensors (every layer at once)
        return self.ring_pages + layer * self.capacity + j

    def _page_rows(self, p: int, lo: int = 0, hi: int = PAGE_TOKENS) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host view, pool rows) of token rows [lo, hi) of resident page ``p`` of every layer, K's
        then V's: the pool holds layer l's copy ``capacity`` slots after layer l - 1's, so each run
        of bytes the rows occupy in a page (``PageFormat.row_spans``: the whole page, or a run per
        head and section) is one strided 2-D view on both sides (one copy each way)."""
        j, last, cap = self._pool_slot(0, self.slot[p]), self.n_layers - 1, self.capacity
        return [(host[:, p, a:a + w], pool[j:j + last * cap + 1:cap, a:a + w])
                for host, pool, fmt in ((self.host.k, self.kspace, self.k_fmt), (self.host.v, self.vspace, self.v_fmt))
                for a, w in fmt.row_spans(lo, hi)]

    def _row_copies(self, p: int, lo: int, hi: int) -> list[tuple[int, int, int, int, int, int]]:
        """``_page_rows(p, lo, hi)``'s copies as ``cudart.rows_of`` gives them (host -> pool order:
        (host, host pitch, pool, pool pitch, width, rows)), computed from the base addresses: a
        decode step's commit makes no views (6 against 52 us for a row of a 28-layer cache on the dev
        CPU, the views and ``rows_of`` included)."""
        j, cap, n = self._pool_slot(0, self.slot[p]), self.capacity, self.n_layers
        out = []
        for host, pool, fmt in ((self.host.k, self.kspace, self.k_fmt), (self.host.v, self.vspace, self.v_fmt)):
            h, s = host.data_ptr() + p * host.stride(1), pool.data_ptr() + j * pool.stride(0)
            hp, sp = host.stride(0), cap * pool.stride(0)
            for a, w in fmt.row_spans(lo, hi):
                out.append((h + a, hp, s + a, sp, w, n) if n > 1 else (h + a, w, s + a, w, w, 1))
        return out

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
        # layers per ring copy, from the most pages one round can stream for this layout (not from
        # the pages streamed now): it holds while pages open, so a captured step keeps its shape
        # (a grouped copy's pitch is then at least every streamed count this layout can reach)
        most = min(half, self.max_pages - self.capacity)
        self.group = group_size(self.n_layers, half // most) if len(self.rounds) == 1 and self.rounds[0][2] else 1
        # a captured step reads the plan through its copies (re-pointed in place), the round keys
        # (written in place) and the page tables (read in place); the last round runs to the
        # sequence's end, its splits sized to the table's. A new page that leaves the streamed
        # pages as they were (nothing streamed, or a residency step) changes none of them
        sig = (tuple((a, tuple(pages)) for a, _, pages in self.rounds), self.group)
        if sig != self._plan_sig:
            keys = [(a * PAGE_TOKENS, b * PAGE_TOKENS if i < len(self.rounds) - 1 else None)
                    for i, (a, b, _) in enumerate(self.rounds)]
            if self.ops.triton:  # device scalars, written in place: captured steps read round i's at one address
                stage = self._keys_upload.stage()
                stage[:2 * len(keys)] = torch.tensor([k if k is not None else 0 for ab in keys for k in ab])
                self._keys_upload.send()
                keys = [(self._keys[2 * i:2 * i + 1], None if e is None else self._keys[2 * i + 1:2 * i + 2])
                        for i, (_, e) in enumerate(keys)]
            self.round_keys = keys
            self._ring_bytes = sum(self.n_layers * self._pitch(r) * self.layout.pair
                                   for r, (_, _, pages) in enumerate(self.rounds) if pages)
            self._plan_sig = sig
            self._plan_version += 1  # other copies: a captured step re-points its copy nodes
        # the page tables, a column per page for all layers at once (per-element writes from
        # Python took 5-20 ms per plan at 28 layers x 128 pages: results/capture)
        layers = torch.arange(self.n_layers, dtype=torch.int32)[:, None]  # _half and _pool_slot take it whole
        for r, (_, _, pages) in enumerate(self.rounds):
            if pages:
                base = self._half(layers, r) * half + (layers % self.group) * self._pitch(r)  # a group's layers side by side
                self.tables_host[:, pages] = base + torch.arange(len(pages), dtype=torch.int32)
        if self.slot:
            pages, slots = zip(*self.slot.items())
            self.tables_host[:, list(pages)] = self._pool_slot(layers, torch.tensor(slots, dtype=torch.int32))
        self._tables_upload.stage().copy_(self.tables_host)
        self._tables_upload.send()
        self._tables_version += 1  # slots staged before this (``stage_ahead``) may be stale
        self._n_pages = n_pages
