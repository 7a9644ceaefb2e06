"""Transfer wait per forward pass: how long the compute stream waited for, or itself ran,
host <-> device copies (ring copies it waits on, pages entering the resident set, write-backs a
new plan waits for). DESIGN.md's step-time split is target / draft / transfer wait. Every pass
is timed, prefill chunks too; records are per decode step.

CUDA: a step's compute stream runs behind the host, inside a captured graph, so no host timer
sees its waits, and an event baked into the graph is re-recorded by the next replay, which the
host has queued before it could read the event. Instead ``kernels.stamp`` adds each wait's length
in device time to a counter in device memory (a one-thread launch before the wait and one after),
zeroed as the pass opens; its end copies the counter into a pinned slot (``SLOTS`` in turn), read
once the copy has landed: when the slot comes round again or when asked (``StepStats.wait_s``).
- Inside a graph a stamp pair costs ~1 us, and each wait's value includes that much. In an eager
  pass the stamps are launched from Python: a wait the device has caught up on then reads the
  launch's host time (tens of us).
- A step that captures its graph runs its body twice (warm-up, then replay): both waits count, as
  both run times count in its step time.
- Timing took 0-4% of a streaming step's rate on the H200 (results/stream/wait_telemetry): it
  changes what it measures, so on CUDA it is opt-in (``cache.time_waits``); untimed passes report
  None. A captured step keeps the stamps it was captured with, so switching ``enabled`` changes
  the cache's plan key (new graphs).
- Write-backs run on the copy stream: a pass waits for one only where a new plan must.

CPU: copies are synchronous, so a pass's wait is its copies' own time (``perf_counter_ns``), its
own write-backs included; reading the host's clock costs nothing: always timed.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from kvstream.telemetry import StepStats


SLOTS = 4  # pinned slots in turn: the host reads a pass's wait at the latest SLOTS passes later


class WaitClock:
    def __init__(self, device: torch.device, enabled: bool = False):
        """``enabled``: stamp the waits on CUDA (CPU: always timed)."""
        self.cuda = device.type == "cuda"
        self.device = device
        self.enabled = enabled or not self.cuda  # may be switched between passes (bench_stream)
        self._cpu_ns = 0  # CPU: the pass's copy time so far
        # a pass is open and timed (``enabled`` as it opened): only a pass's transfers count, not a
        # re-layout's between passes
        self._timed = False
        self.pending: deque[tuple[int, StepStats]] = deque()  # CUDA: (slot, pass) not read yet, oldest first
        self.passes = 0
        self.acc = None  # CUDA: the pass's sum over waits of (after - before), ns; made when first timed

    def _buffers(self) -> None:
        from kernels.stamp import stamp  # CUDA only: the kernel needs the GPU's timer

        self._stamp = stamp
        self.acc = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.slots = torch.zeros(SLOTS, dtype=torch.int64, pin_memory=True)
        self.events = [torch.cuda.Event() for _ in range(SLOTS)]

    def open_pass(self) -> None:
        """A forward pass begins: transfers count from here to ``close_pass``."""
        self._cpu_ns, self._timed = 0, self.enabled
        if self.cuda and self._timed:
            if self.acc is None:
                self._buffers()
            self.acc.zero_()  # stream-ordered after the last pass's copy of it

    @contextlib.contextmanager
    def timing(self):
        """Around a wait or a copy on the compute stream: its length joins the pass's wait."""
        if not self._timed:
            yield
        elif self.cuda:
            self._stamp(self.acc, -1)
            try:
                yield
            finally:  # a half pair would leave -globaltimer in the counter
                self._stamp(self.acc, 1)
        else:
            t = time.perf_counter_ns()
            try:
                yield
            finally:
                self._cpu_ns += time.perf_counter_ns() - t

    def close_pass(self, stats: StepStats) -> None:
        """The pass whose telemetry is ``stats`` has ended (its device work is queued)."""
        timed, self._timed = self._timed, False
        if not timed:
            stats.wait_ns = None
        elif not self.cuda:
            stats.wait_ns, self._cpu_ns = self._cpu_ns, 0
        else:
            while len(self.pending) >= SLOTS:  # the slot this pass takes still holds an unread wait
                self._read_one()
            i = self.passes % SLOTS
            self.passes += 1
            self.slots[i:i + 1].copy_(self.acc, non_blocking=True)
            self.events[i].record()
            stats.wait_ns, stats.clock = None, self
            self.pending.append((i, stats))

    def resolve(self, stats: StepStats) -> None:
        """Read the waits of the passes up to ``stats`` (waiting for their copies to land)."""
        while stats.clock is self and self.pending:
            self._read_one()

    def flush(self) -> None:
        """Read every pass's wait (a cache being dropped: its records keep their numbers)."""
        while self.pending:
            self._read_one()

    def _read_one(self) -> None:
        i, s = self.pending.popleft()
        self.events[i].synchronize()
        s.wait_ns, s.clock = int(self.slots[i]), None
