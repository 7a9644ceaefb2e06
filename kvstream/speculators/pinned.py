"""What the speculators pinned in the target's arena (the draft model, the MTP head) share: a
resident KV cache over a region pinned there, made at the first pin and moved back at a
re-enable, and the give-back at an eject."""

from __future__ import annotations

import torch

from kvstream.cache.arena import Arena
from kvstream.cache.paged import PagedCache


def pin_kv(spec, arena: Arena, nbytes: int, before: int, **cache) -> int:
    """``spec.cache`` over ``nbytes`` pinned in ``arena`` (``cache``: the PagedCache's shape and
    slabs); marks ``spec`` pinned and enabled; returns the bytes pinned since ``before``."""
    kv = arena.pin(f"{spec.name}.kv", (nbytes,), torch.uint8)
    if spec.cache is None:
        spec.cache = PagedCache(mode="resident", arena=Arena.over(kv), ring_pages=0, **cache)
    else:  # the same bytes as before (a re-enable pins from the same mark): its layout stays
        spec.cache.move_to(Arena.over(kv))
    spec.pinned_bytes = arena.pinned_bytes - before
    spec.enabled = True
    return spec.pinned_bytes


def unpin(spec, arena: Arena) -> int:
    """Give ``spec``'s pins back to ``arena`` (its KV stays on the host); returns the bytes freed."""
    if spec.cache is not None:
        spec.cache.wait_write_backs()  # its write-backs still read the bytes being given back
    spec.enabled = False
    return arena.reset(spec._mark)
