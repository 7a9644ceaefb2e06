"""Host-authoritative KV: every page of every layer in (pinned, on CUDA) host memory.

Pages have the device layout (``kernels.formats``), so moving one is a plain copy. The store
is sized once for ``max_pages`` pages per layer; rows past the sequence length are stale bytes
that attention never reads, so a rollback is only a shorter length.
"""

from __future__ import annotations

import torch

from kernels.formats import PageFormat


class HostStore:
    def __init__(self, n_layers: int, max_pages: int, k_fmt: PageFormat, v_fmt: PageFormat, pin: bool):
        self.k_fmt, self.v_fmt = k_fmt, v_fmt
        self.max_pages = max_pages
        # pinned memory makes host->device copies asynchronous and ~7x faster (GPU.md)
        self.k = torch.empty((n_layers, max_pages, k_fmt.page_bytes), dtype=torch.uint8, pin_memory=pin)
        self.v = torch.empty((n_layers, max_pages, v_fmt.page_bytes), dtype=torch.uint8, pin_memory=pin)

    @property
    def nbytes(self) -> int:
        return self.k.numel() + self.v.numel()
