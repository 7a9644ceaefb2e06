"""Static step buffers of a paged cache, for captured decode steps (kvstream.engine.graphs).

One device tensor holds a step's positions, every layer's slots and the length, written in
place by ``begin`` with one host -> device copy from a pinned staging buffer; a captured step
reads it, so its graph stays valid while positions and slots change."""

from __future__ import annotations

import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS


class StepStaging:
    """PagedCache's staging part: ``_step`` (device), its views ``_pos`` / ``_slots`` / ``_len``,
    and two pinned host buffers used in turn."""

    def _init_step_buffers(self, n_layers: int) -> None:
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

    def layout_key(self) -> tuple:
        """What every captured step depends on: the layout (its tensors' addresses) and whether
        the waits are stamped (a graph keeps the stamps it was captured with)."""
        return (self._layout_version, self.clock.enabled)

    def plan_key(self) -> tuple:
        """``layout_key`` and the plan: which rows the ring copies move, and the round keys."""
        return self.layout_key() + (self._plan_version,)
