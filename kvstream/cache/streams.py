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
    out a pool of 32 streams in turn, so after enough caches (each reserve pass makes some) a new
    stream can be the capture stream itself: copies issued there would be captured in line with
    the step's kernels and run one after the other instead of overlapping them."""
    side = side_stream(device).cuda_stream
    while (stream := torch.cuda.Stream(device)).cuda_stream == side:
        pass
    return stream
