"""The device's CUDA streams: the one capture stream, and copy streams that are never it."""

from __future__ import annotations

import torch

_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one capture stream of a device, shared by every GraphedModel (a target's and its
    draft's): a stream's first matmul gives it a cuBLAS workspace for good (32 MiB on the H200),
    outside any arena, so each extra stream would cost that much beyond it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(index)
    return _SIDE[index]


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream for a cache's copies that is not the capture stream. ``torch.cuda.Stream()`` hands
    out a pool of 32 streams in turn, so after enough caches (each reserve pass makes some) a copy
    stream came round to the capture stream: copies issued there were captured in line with the
    step's kernels, which then ran one after the other (bench_stream's ninth arm, 64K with 134
    pages streamed: 10.4 ms a step and a wait of 0.07 ms by the telemetry; alone, 7.8 ms)."""
    side = side_stream(device).cuda_stream
    while (stream := torch.cuda.Stream(device)).cuda_stream == side:
        pass
    return stream
