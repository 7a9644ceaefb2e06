"""Ring streaming of a paged cache: which host rows each round's copies move into which ring
half, and when the copy stream runs them.

A round's streamed pages are copied host -> ring (one 2-D copy per run of pages, K and V),
into the ring half its previous reader has released; the next round's copy is issued as soon
as the current one has been read, into the other half. When the most pages a layer can stream
in the cache's layout (``max_pages - capacity``) fill at most half a ring half, a *group* of
layers shares one copy (a row per layer): every copy has a fixed cost of a few microseconds,
which small sets otherwise spend more time on than on their bytes (``experiments/bench_copies.py``).
The group is fixed by the layout, not by the pages streamed now, and a grouped copy moves as many
pages per layer as the half holds for that group (``half // group``, at least the streamed
ones): its shape then holds while pages open, so a captured step keeps it (a graph's 2-D copy
cannot be re-pointed; its 1-D ones can: ``kvstream.engine.graph_copies``). A layout that can
stream more than half a ring half per layer copies each layer on its own, with 1-D copies.
A decode step that streams its first round copies the next step's first round (of its first
group) at its end, under its last group and the LM head, so copy-bound steps keep the copy
engine busy from one step into the next; ``begin`` copies it again when the plan changed in
between."""

from __future__ import annotations

import torch


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


class RingStreaming:
    """PagedCache's streaming part. Reads the plan (``rounds``, ``group``, ``ring_pages``), the page
    spaces (``kspace``, ``vspace``) and the host store; runs its copies through ``copier``."""

    def _half(self, layer, r: int):  # layer: an int, or an int tensor
        return ((layer // self.group) * len(self.rounds) + r) % 2  # consecutive copies alternate halves

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

    def _pitch(self, r: int) -> int:
        """Ring slots between two layers' pages in a round's ring half: the streamed pages, or
        for a group's one run ``half // group`` (the pages past the streamed ones are resident,
        their ring copy unread), so a grouped copy keeps its shape while pages open."""
        pages, half = self.rounds[r][2], max(1, self.ring_pages // 2)
        if self.group > 1 and len(copy_runs(pages)) == 1 and pages[0] + half // self.group <= self.max_pages:
            return half // self.group
        return len(pages)

    def _runs(self, layer: int, r: int) -> list[tuple[int, int, int, int, int, int]]:
        """(first ring slot, first host page, layers, pages, ring pitch, ring half) of each copy of
        round ``r`` of the layer group that starts at ``layer`` (K and V alike): one per run of
        streamed pages, a row per layer, layer j's run at ring row j * pitch."""
        pages = self.rounds[r][2]
        if not pages:
            return []
        h, half, S = self._half(layer, r), max(1, self.ring_pages // 2), self._pitch(r)
        n, out, i = min(self.group, self.n_layers - layer), [], 0
        for p, m in copy_runs(pages) if S == len(pages) else [(pages[0], S)]:
            out.append((h * half + i, p, n, m, S, h))
            i += m
        return out

    def _sides(self):
        return (self.kspace, self.host.k), (self.vspace, self.host.v)

    def ring_copies(self, layer: int, r: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(ring rows, host rows, ring half) of round ``r`` of the layer group that starts at
        ``layer``: per run of streamed pages, one 2-D copy for K and one for V, a row per layer."""
        out = []
        for slot, p, n, m, S, h in self._runs(layer, r):
            for ring, host in self._sides():
                rows = ring[slot:slot + (n - 1) * S + m]
                dst = rows.as_strided((n, m * ring.shape[1]), (S * ring.shape[1], 1), rows.storage_offset())
                out.append((dst, host[layer:layer + n, p:p + m].flatten(1), h))
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

    def forget_ring(self) -> None:
        """The ring was written outside the cache (a benchmark's copies): the next decode step
        copies its first round again."""
        self._primed = None

    def copy_order(self) -> list[tuple[int, int]]:
        """(group's first layer, round) of every ring copy a decode step issues, in issue order:
        ``start_step``'s, then ``_next_copy``'s after each group's first layer reads a round."""
        seq = [] if self._wrap else [(0, 0)]
        for layer in range(0, self.n_layers, self.group):
            for r in range(len(self.rounds)):
                nxt = (layer, r + 1) if r + 1 < len(self.rounds) else (layer + self.group, 0)
                if nxt[0] < self.n_layers or self._wrap:
                    seq.append(nxt if nxt[0] < self.n_layers else (0, 0))
        return seq

    def step_copies(self) -> list[tuple[int, int, int, int, int, int]]:
        """Every copy a decode step of the current plan issues, in issue order, as ``rows_of``
        tuples (a captured step's memcpy nodes, ``kvstream.engine.graph_copies``): from the
        addresses, without making the views (~10 us each, a hundred per step)."""
        out = []
        sides = [(ring.data_ptr(), ring.shape[1], host.data_ptr(), host.shape[1]) for ring, host in self._sides()]
        for layer, r in self.copy_order():
            for slot, p, n, m, S, _ in self._runs(layer, r):
                for ring, pb, host, P in sides:  # (one row: pitches = width, as rows_of says)
                    dp, sp = (S * pb, P * pb) if n > 1 else (m * pb, m * pb)
                    out.append((ring + slot * pb, dp, host + (layer * P + p) * pb, sp, m * pb, n))
        return out

    def step_plan(self) -> tuple[tuple, list[tuple[int, ...]]]:
        """(shape, copies) of a decode step of the current plan (after ``begin``), made once per
        plan. ``copies``: ``step_copies``. ``shape``: what a captured step cannot change in place:
        the rounds and which of them stream, the grouping and the wrap (its kernels, waits and
        ring halves), the number of copies, and each 2-D copy whole (a graph's 2-D copy cannot be
        re-pointed, its 1-D ones can)."""
        key = self.plan_key() + (self._wrap,)
        if self._step_plan[0] != key:
            copies = self.step_copies()
            shape = (tuple(bool(pages) for _, _, pages in self.rounds), self.group, self._wrap,
                     tuple(c if c[-1] > 1 else None for c in copies))
            self._step_plan = (key, shape, copies)
        return self._step_plan[1:]
