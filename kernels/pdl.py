"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the kernel
before it in the stream still runs; ``gdc_wait`` then blocks until that kernel has finished and its
writes are visible, and ``gdc_launch_dependents`` lets the kernel after it start in turn. Inside a
CUDA graph the launches' gaps shrink to the dependents' wait (``kernels/gemv.py``: ~1.3 us a kernel
boundary in a chain of the 1.5B's layer kernels, results/kernels/gemv). Both instructions are
no-ops when the launch was an ordinary one."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """A dependent kernel's first step: wait for the kernel before, let the one after start."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch(pdl: bool) -> dict:
    """A Triton launch's keywords for a programmatic dependent launch (or none)."""
    return {"launch_pdl": True} if pdl else {}
