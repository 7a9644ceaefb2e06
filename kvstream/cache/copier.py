"""Host <-> device copies for a paged cache: ring copies and write-backs on a side stream, with
one event pair per ring half (CUDA); plain synchronous copies elsewhere."""

from __future__ import annotations

import torch

from kvstream.cache.cudart import copy_rows, memcpy_2d
from kvstream.cache.streams import copy_stream
from kvstream.cache.wait_clock import WaitClock


class Copier:
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

    def write_back(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Arena rows -> strided host views, each (dst, src) a plain copy (off CUDA; on CUDA
        ``write_back_rows``)."""
        with self.clock.timing():
            for dst, src in pairs:
                dst.copy_(src)

    def write_back_rows(self, copies: list[tuple[int, int, int, int, int, int]]) -> None:
        """Arena rows -> strided host views, each a ``cudart.rows_of`` tuple (one 2-D copy, no views
        to make), after the compute stream's writes to them; asynchronous, so the host does not wait
        for the step. The source is the arena itself: nothing is freed under the copies."""
        self.stream.wait_stream(torch.cuda.current_stream(self.index))
        for rows in copies:
            memcpy_2d(rows, self.stream)

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
