"""Static step buffers of a paged cache, for captured decode steps (kvstream.engine.graphs).

One device tensor holds a step's positions, every layer's slots and the length after each row,
written in place by ``begin`` with one host -> device copy from a pinned staging buffer; a
captured step reads it, so its graph stays valid while positions and slots change. A drafter
may stage its next pass early (``stage_ahead``; ``stage_ahead_on_device`` where only the device
knows its next length yet), while the device still works on a round; a greedy step stages its
successor inside its own graph (``stage_next_on_device``). The page tables and round keys of a
new plan reach the device the same way (``PinnedUpload``): a copy from pageable memory would
make the host wait for the device's queued steps at every page opening."""

from __future__ import annotations

import numpy as np
import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS


class PinnedUpload:
    """Host -> device writes of one device tensor that do not make the host wait: the host fills
    one of ``buffers`` pinned buffers in turn (``stage``), ``send`` queues its copy; an event per
    buffer says when its copy has read it (long done, in practice, when the buffer comes round
    again: more buffers where several writes are queued within one step). Off CUDA: one buffer,
    copied at once."""

    def __init__(self, dst: torch.Tensor, buffers: int = 2):
        self.dst, self.cuda, self.i = dst, dst.device.type == "cuda", 0
        self.bufs = [torch.empty(dst.shape, dtype=dst.dtype, pin_memory=self.cuda) for _ in range(buffers if self.cuda else 1)]
        self.done = [torch.cuda.Event() for _ in self.bufs] if self.cuda else None

    def stage(self) -> torch.Tensor:
        """The next host buffer, free to fill."""
        self.i = (self.i + 1) % len(self.bufs)
        if self.done:
            self.done[self.i].synchronize()
        return self.bufs[self.i]

    def send(self) -> None:
        """Queue the staged buffer's copy into the device tensor (stream-ordered)."""
        self.dst.copy_(self.bufs[self.i], non_blocking=self.cuda)
        if self.done:
            self.done[self.i].record()


class StepStaging:
    """PagedCache's staging part: ``_step`` (device), its views ``_pos`` / ``_slots`` / ``_lens``
    (``_len``: a prefill chunk's length), written through a ``PinnedUpload``."""

    def _init_step_buffers(self, n_layers: int) -> None:
        # static step buffers, written in place by begin: a captured step (kvstream.engine.graphs)
        # reads them. One tensor (positions, every layer's slots, a prefill chunk's length, the
        # length after each row: a decode pass's and a ``sub_pass``'s), so a decode step fills it
        # with one host->device copy instead of ~10 small kernels
        w, e = MAX_N_Q, MAX_N_Q * (1 + n_layers)
        self._step = torch.zeros(e + 1 + w, dtype=torch.int64, device=self.device)
        self._pos, self._len, self._lens = self._step[:w], self._step[e:e + 1], self._step[e + 1:]
        self._slots = self._step[w:e].view(n_layers, w)
        self._step_upload = PinnedUpload(self._step)
        self._ahead = None  # (length, rows, page tables' version) that stage_ahead staged
        self._device_ahead = None  # (rows, page tables' version) that stage_ahead_on_device staged

    def stage_ahead(self, n: int) -> None:
        """Stage a decode pass of up to ``n`` rows at the current length now, before its
        ``begin``: the host does it while the device is busy with a round, off the path from the
        round's readback to the next launch (``MTPDraft.prepare``). Positions and slots are a
        function of the length and the page tables only, so a ``begin(m)``, m <= n, at that length
        with the same tables (no plan since: a page opening re-plans) stages nothing; any other
        begin stages as usual."""
        if 0 < n <= MAX_N_Q and self.length + n <= self.max_tokens:
            self._stage_step(n)
            self._ahead, self._device_ahead = (self.length, n, self._tables_version), None

    def stage_ahead_on_device(self, length: torch.Tensor, most: int, n: int, offset: int = 0) -> None:
        """``stage_ahead`` at a length the device holds (``length`` + ``offset``; ``length`` int64 [1],
        the sum at most ``most``) and the host does not know yet (a draft model's next length hangs on
        the verify's accepted count): the positions, slots and lengths from the device's page tables
        by one launch (``kernels.stage``), queued behind the round. A ``begin`` uses them once
        ``claim_staged`` has told the length, with no plan since."""
        self._ahead = self._device_ahead = None
        if 0 < n <= MAX_N_Q and most + n <= self.max_tokens:
            self.ops.stage_rows(self._pos, self._slots, self._lens, self.tables, length, offset, n)
            self._device_ahead = (n, self._tables_version)

    def staged_ahead(self, n: int) -> bool:
        """Whether ``stage_ahead`` left a pass of ``n`` rows at the current length that a ``begin(n)``
        would use (no plan since)."""
        ahead = self._ahead
        return ahead is not None and ahead[0] == self.length and n <= ahead[1] and ahead[2] == self._tables_version

    def restage_rows_on_device(self, lo: int, base: torch.Tensor, offset: int, m: int) -> None:
        """Rows [lo, lo + m) of the pass ``stage_ahead`` staged, rewritten at ``base`` + ``offset``.. by
        one launch, the rest of that staging kept: a drafter's chain launched before the round's
        readback feeds the verify's rows at known positions and drafts after the accepted ones, at
        positions only the device knows (``MTPDraft.propose_ahead``). ``base``: int64 [1] on the
        device. A ``begin`` that re-plans stages the whole pass again from the host: the caller
        launches only where ``replans`` says it does not."""
        if m > 0:
            self.ops.stage_rows(self._pos[lo:], self._slots[:, lo:], self._lens[lo:], self.tables, base, offset, m)

    def claim_staged(self, length: int) -> None:
        """The length ``stage_ahead_on_device`` staged at, now read back: a ``begin`` there stages nothing."""
        if self._device_ahead is not None:
            self._ahead, self._device_ahead = (length, *self._device_ahead), None

    def stage_next_on_device(self) -> None:
        """Device work at the end of a one-row decode pass (a greedy step's graph,
        ``GraphedModel.next_token``): the next one-row pass, at the length after this one, staged
        from the device's page tables, so its replay needs no copy from the host first. The host
        takes it with ``claim_next`` after the commit."""
        self.ops.stage_rows(self._pos, self._slots, self._lens, self.tables, self._lens[:1], 0, 1)

    def claim_next(self) -> None:
        """After a one-row pass that ran ``stage_next_on_device``, and its commit: a ``begin(1)`` at
        the new length with no plan since (a page opening re-plans, and stages again) stages nothing."""
        if self.length + 1 <= self.max_tokens:
            self._ahead, self._device_ahead = (self.length, 1, self._tables_version), None

    @property
    def step_buffer(self) -> torch.Tensor:
        """The static buffer (positions, slots, lengths) captured steps read: a capture's eager run
        that stages ahead into it must put it back."""
        return self._step

    def _staged(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``begin``'s staging of a decode pass of ``n`` rows: what ``stage_ahead`` left, if it holds."""
        staged, self._ahead, self._device_ahead = self.staged_ahead(n), None, None
        return (self._pos[:n], self._slots[:, :n]) if staged else self._stage_step(n)

    def _stage_step(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and slots of a decode step from the host's page tables, written into the
        static buffers by one copy from a pinned staging buffer (no allocation per step)."""
        # in numpy, not torch ops on these few numbers: a begin took 18 against 43 us in a tight loop on
        # the 2-core dev CPU, but on the H200's host only 0.131 against 0.138 ms (results/round/profile)
        w, e, stage = MAX_N_Q, MAX_N_Q * (1 + self.n_layers), self._step_upload.stage().numpy()
        pos = np.arange(self.length, self.length + n)
        stage[:n] = pos
        stage[w:e].reshape(self.n_layers, w)[:, :n] = \
            self.tables_host.numpy()[:, pos // PAGE_TOKENS].astype(np.int64) * PAGE_TOKENS + pos % PAGE_TOKENS
        stage[e + 1:e + 1 + n] = pos + 1  # the length after each row: the pass's (its last) and a sub-pass's
        self._step_upload.send()
        return self._pos[:n], self._slots[:, :n]

    def sub_pass(self, lo: int, m: int) -> torch.Tensor:
        """Rows [lo, lo + m) of the staged decode pass (``begin(n)``) as a pass of their own: the
        next ``attend`` calls store those rows, and their queries see the keys up to them. A
        drafting chain's steps (feed, then one row per drafted token) thus share one ``begin``
        and one captured graph (``kvstream.speculators.mtp``). Returns the rows' positions."""
        if not (0 <= lo and 0 < m and lo + m <= self._n <= MAX_N_Q):
            raise ValueError(f"rows [{lo}, {lo + m}) are not in the staged pass of {self._n} rows")
        self.pos, self.slots = self._pos[lo:lo + m], self._slots[:, lo:lo + m]
        # (off CUDA the value: the rows' positions are the staged ones, which may not follow the length)
        self.seq_len = self._lens[lo + m - 1:lo + m] if self.ops.triton else int(self._lens[lo + m - 1])
        return self.pos

    def layout_key(self) -> tuple:
        """What every captured step depends on: the layout (its tensors' addresses) and whether
        the waits are stamped (a graph keeps the stamps it was captured with)."""
        return (self._layout_version, self.clock.enabled)

    def plan_key(self) -> tuple:
        """``layout_key`` and the plan: which rows the ring copies move, and the round keys."""
        return self.layout_key() + (self._plan_version,)
