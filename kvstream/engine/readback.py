"""A small device result's copy to the host, started at once and waited for when it is read:
the host then waits for that result only, not for the work queued after it (how decoding runs
one step ahead of the host, ``generate`` and the draft model)."""

from __future__ import annotations

import torch


class Readback:
    def __init__(self, device: torch.device, shape: tuple[int, ...], dtype: torch.dtype):
        self.cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=self.cuda)
        self.done = torch.cuda.Event() if self.cuda else None

    def start(self, value: torch.Tensor) -> None:
        """Copy ``value`` (on the device, this shape) out once the work queued so far made it."""
        self.host.copy_(value, non_blocking=self.cuda)
        if self.cuda:
            self.done.record()

    def read(self) -> torch.Tensor:
        """The value, on the host (this object's buffer: read it before the next ``start``)."""
        if self.cuda:
            self.done.synchronize()
        return self.host
