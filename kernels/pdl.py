"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the kernel
before it in the stream still runs; ``gdc_wait`` then blocks until that kernel has finished and its
writes are visible, and ``gdc_launch_dependents`` lets the kernel after it start in turn. Inside a
CUDA graph the launches' gaps shrink to the dependents' wait (``kernels/gemv.py``: ~1.3 us a kernel
boundary in a chain of the 1.5B's layer kernels, results/kernels/gemv). The instructions exist from
sm_90 on: elsewhere (and on CPU) the flag turns into ordinary launches without them."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A dependent kernel's first step: wait for the kernel before, let the one after start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch as programmatic dependents (CUDA, sm_90+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def kwargs(pdl: bool, device: torch.device) -> dict:
    """A Triton launch's keywords: the kernel's ``PDL`` constexpr and, when on, ``launch_pdl``."""
    on = pdl and supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
