"""Host-authoritative KV: every page of every layer in (pinned, on CUDA) host memory.

Pages have the device layout (``kernels.formats``), so moving one is a plain copy. The store
is sized once for ``max_pages`` pages per layer; rows past the sequence length are stale bytes
that attention never reads, so a rollback is only a shorter length.
"""

from __future__ import annotations

import torch

from kernels.formats import PageFormat

from kvstream.cache.arena import MIB


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostMemoryTooSmall(MemoryError):
    """The host cannot hold (or pin) the KV store a run asks for."""


class HostStore:
    def __init__(self, n_layers: int, max_pages: int, k_fmt: PageFormat, v_fmt: PageFormat, pin: bool):
        self.k_fmt, self.v_fmt = k_fmt, v_fmt
        self.max_pages = max_pages
        need, free = n_layers * max_pages * (k_fmt.page_bytes + v_fmt.page_bytes), available_host_bytes()
        if free is not None and need > free:  # pinned pages cannot swap: refuse rather than be killed
            raise HostMemoryTooSmall(f"the host store needs {need / MIB:.0f} MiB ({n_layers} layers x {max_pages} pages x "
                              f"{(k_fmt.page_bytes + v_fmt.page_bytes) / 1024:.0f} KiB of K+V) but the host has "
                              f"{free / MIB:.0f} MiB available: lower the context (max tokens) or use smaller page types")
        # pinned memory makes host->device copies asynchronous and ~7x faster (GPU.md)
        try:
            self.k = torch.empty((n_layers, max_pages, k_fmt.page_bytes), dtype=torch.uint8, pin_memory=pin)
            self.v = torch.empty((n_layers, max_pages, v_fmt.page_bytes), dtype=torch.uint8, pin_memory=pin)
        except (RuntimeError, MemoryError) as e:  # the pinned-memory limit can sit below MemAvailable
            raise HostMemoryTooSmall(f"the host store of {need / MIB:.0f} MiB ({n_layers} layers x {max_pages} pages) "
                                     f"could not be {'pinned' if pin else 'allocated'}: {str(e).splitlines()[0]}; "
                                     "lower the context (max tokens) or use smaller page types") from None

    @property
    def nbytes(self) -> int:
        return self.k.numel() + self.v.numel()
