"""Config -> KV cache: the contiguous cache, or a paged cache in a phase arena."""

from __future__ import annotations

import torch

from kernels.formats import PAGE_TOKENS, PageFormat
from policies.residency import RESIDENCY

from .arena import ALIGN, MIB, Arena
from .cache import ContiguousCache
from .config import ArenaConfig, CacheConfig
from .paged_cache import PagedCache


def reserve_slab(model, n_tokens: int) -> int:
    """Bytes of compute buffers one forward pass of ``n_tokens`` needs (the phase's peak).

    On CUDA a reserve pass measures it: one forward through a scratch cache, peak allocated
    bytes above the baseline. Elsewhere (no allocator statistics) it is the sum of the largest
    live activations of one layer plus the logits, from the shapes."""
    c = model.cfg
    if model.device.type == "cuda":
        scratch = ContiguousCache(c.n_layers, c.n_kv_heads, c.head_dim, n_tokens, model.dtype, model.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.inference_mode():
            model(torch.zeros(n_tokens, dtype=torch.long, device=model.device), scratch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    width = 3 * c.hidden + (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 3 * c.ffn
    return n_tokens * width * model.dtype.itemsize + c.vocab_size * 4  # logits of the last token


def paged_bytes(cfg, type_k: str, type_v: str, max_tokens: int, slab: int, ring_pages: int = 0) -> int:
    """Arena bytes a paged cache of ``max_tokens`` tokens needs with every page resident."""
    pair = (PageFormat(type_k, cfg.n_kv_heads, cfg.head_dim).page_bytes
            + PageFormat(type_v, cfg.n_kv_heads, cfg.head_dim).page_bytes)
    pages = cfg.n_layers * -(-max_tokens // PAGE_TOKENS) + ring_pages
    return slab + pages * pair + 4 * ALIGN


def make_cache(cache: CacheConfig, arena: ArenaConfig, model, max_tokens: int, prefill_chunk: int,
               verify_width: int = 1, pinned_bytes: int = 0):
    """The cache ``cache.mode`` names for ``max_tokens`` tokens. The phases' compute slabs are
    reserved for ``prefill_chunk`` tokens (prefill) and ``verify_width`` tokens (decode: 1 +
    the most draft tokens a verify batch carries). ``arena.mib=auto`` leaves room for
    ``pinned_bytes`` more in the pinned region (a draft)."""
    c = model.cfg
    if cache.mode == "contiguous":
        return ContiguousCache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, model.dtype, model.device)
    if max_tokens > c.context_length:
        raise ValueError(f"context of {max_tokens} tokens exceeds the model's {c.context_length}")
    if cache.residency not in RESIDENCY:
        raise ValueError(f"cache.residency={cache.residency!r}; choose one of {', '.join(RESIDENCY)}")
    ring = None if str(cache.ring_pages) == "auto" else int(cache.ring_pages)
    slabs = {"prefill": reserve_slab(model, prefill_chunk), "decode": reserve_slab(model, verify_width)}
    slab = max(slabs.values())
    if arena.mib == "auto":  # room for every page of the context: nothing needs to stream
        ring_pages = (ring or 2) if cache.mode == "stream" else 0
        nbytes = paged_bytes(c, cache.type_k, cache.type_v, max_tokens, slab, ring_pages) + pinned_bytes + ALIGN
    else:
        try:
            nbytes = int(float(arena.mib) * MIB)
        except ValueError:
            raise ValueError(f"arena.mib={arena.mib!r}: give a number of MiB or auto") from None
    return PagedCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_tokens=max_tokens,
                      type_k=cache.type_k, type_v=cache.type_v, mode=cache.mode, arena=Arena(nbytes, model.device),
                      ring_pages=ring, slabs=slabs, verify_width=verify_width, residency=RESIDENCY[cache.residency]())
