"""Transfer wait per forward pass: how long the compute stream waited for, or itself ran,
host <-> device copies (ring copies it waits on, pages entering the resident set, write-backs a
new plan waits for). DESIGN.md's step-time split is target / draft / transfer wait.

CUDA: a step's compute stream runs behind the host, inside a captured graph, so no host timer
sees its waits, and an event baked into the graph is re-recorded by the next replay, which the
host has queued before it could read the event. Instead ``kernels.stamp`` adds each wait's length
in device time to a counter in device memory (a one-thread launch before the wait and one after);
each pass's end copies the running total into a pinned slot, two in turn. A pass's wait is its
total less the previous pass's, read once its copy has landed: when its slot comes round again,
two passes later, or when asked (``StepStats.wait_s``). A step that captures its graph runs its
body twice (warm-up, then replay): both waits count, as both run times count in its step time.
On the H200 a stamp pair costs ~1 us and each wait's value includes that much, and timing took
0-4% of a streaming step's rate (results/stream/wait_telemetry/README.md): it changes what it
measures, so on CUDA it is opt-in (``cache.time_waits``); untimed passes report None.

CPU: copies are synchronous, so a pass's wait is its copies' own time (``perf_counter_ns``),
which costs nothing to read: always timed.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from .telemetry import StepStats


class WaitClock:
    def __init__(self, device: torch.device, enabled: bool = False):
        """``enabled``: stamp the waits on CUDA (CPU: always timed)."""
        self.cuda = device.type == "cuda"
        self.enabled = enabled or not self.cuda  # may be switched between captures (bench_stream)
        self._cpu_ns = 0  # CPU: the pass's copy time so far
        self.in_pass = False  # only a pass's transfers count (not a re-layout's, between passes)
        if self.cuda:
            from kernels.stamp import stamp  # CUDA only: the kernel needs the GPU's timer

            self._stamp = stamp
            self.acc = torch.zeros(1, dtype=torch.int64, device=device)  # sum over waits of (after - before), ns
            self.slots = torch.zeros(2, dtype=torch.int64, pin_memory=True)
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            self.pending: deque[tuple[int, StepStats]] = deque()  # (slot, pass) not read yet, oldest first
            self.total = 0  # the counter as last read
            self.passes = 0

    def open_pass(self) -> None:
        """A forward pass begins: transfers count from here to ``close_pass``."""
        self.in_pass, self._cpu_ns = True, 0

    @contextlib.contextmanager
    def timing(self):
        """Around a wait or a copy on the compute stream: its length joins the pass's wait."""
        if not (self.enabled and self.in_pass):
            yield
        elif self.cuda:
            self._stamp(self.acc, -1)
            yield
            self._stamp(self.acc, 1)
        else:
            t = time.perf_counter_ns()
            yield
            self._cpu_ns += time.perf_counter_ns() - t

    def close_pass(self, stats: StepStats) -> None:
        """The pass whose telemetry is ``stats`` has ended (its device work is queued)."""
        self.in_pass = False
        if not self.enabled:
            stats.wait_ns = None
        elif not self.cuda:
            stats.wait_ns, self._cpu_ns = self._cpu_ns, 0
        else:
            while len(self.pending) >= 2:  # the slot this pass takes still holds an unread total
                self._read_one()
            i = self.passes % 2
            self.passes += 1
            self.slots[i:i + 1].copy_(self.acc, non_blocking=True)
            self.events[i].record()
            stats.wait_ns, stats.clock = None, self
            self.pending.append((i, stats))

    def resolve(self, stats: StepStats) -> None:
        """Read the totals of the passes up to ``stats`` (waiting for their copies to land)."""
        while stats.clock is self and self.pending:
            self._read_one()

    def _read_one(self) -> None:
        i, s = self.pending.popleft()
        self.events[i].synchronize()
        value = int(self.slots[i])
        s.wait_ns, s.clock, self.total = value - self.total, None, value
