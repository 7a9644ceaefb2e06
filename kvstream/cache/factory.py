"""Config -> KV cache: the contiguous cache, or a paged cache in a phase arena."""

from __future__ import annotations

import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS
from policies.residency import RESIDENCY

from kvstream.cache.arena import MIB, Arena, ArenaPlan, pair_bytes
from kvstream.cache.contiguous import ContiguousCache
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.model.qwen import features
from kvstream.cache.paged import PagedCache
from kvstream.cache.slab_pool import SlabPool


class _OneLayer(PagedCache):
    """Every layer attends through layer 0: a reserve pass's buffers without every layer's pages."""

    def attend(self, layer, q, k_new, v_new):
        return super().attend(0, q, k_new, v_new)

    def attend_rope(self, layer, qk, v, rope, q8=False):
        return super().attend_rope(0, qk, v, rope, q8)


def _scratch_cache(model, n: int, max_tokens: int, type_k: str, type_v: str, ring_pages: int | None,
                   rotate: bool = False) -> PagedCache:
    """A one-layer paged cache like the real one, at the end of its context: with an explicit
    ring, as few resident pages as a batch allows (the most streaming rounds, whose attention
    partials all live until they merge); ``rotate``: its pages in the Hadamard basis, whose decode
    passes rotate and store apart (``PagedCache.attend_rope``), as the real one's do."""
    c = model.cfg
    pages = -(-max_tokens // PAGE_TOKENS)
    stream = bool(ring_pages)
    resident = min(pages, max(2, -(-n // PAGE_TOKENS) + 1)) if stream else pages
    plan = ArenaPlan(0, ring_pages or 0, pair_bytes(type_k, type_v, c.n_kv_heads, c.head_dim))
    cache = _OneLayer(n_layers=1, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_tokens=max_tokens,
                      type_k=type_k, type_v=type_v, mode="stream" if stream else "resident",
                      arena=Arena(plan.bytes(resident), model.device),
                      ring_pages=ring_pages if stream else 0, slabs={"prefill": 0, "decode": 0},
                      verify_width=n, rotate=rotate)
    cache.length = max_tokens - n  # rows are never initialised: only the buffers are measured
    if n <= MAX_N_Q:
        cache.set_phase("decode")
    return cache


def reserve_slab(model, n_tokens: int, *, max_tokens: int | None = None, type_k: str = "q8_0",
                 type_v: str = "q4_0", ring_pages: int | None = None, all_logits: bool = False,
                 step_logits: tuple[bool, ...] = (False, True), hidden=False, rotate: bool = False) -> int:
    """Bytes of compute buffers one forward pass of ``n_tokens`` needs (the phase's peak);
    ``hidden``: with the hidden states it returns beside the logits (``Qwen.body``: an MTP head's);
    ``rotate``: through a cache whose pages are rotated (``cache.rotate``).

    On CUDA reserve passes measure it: the real forward pass through a one-layer scratch paged
    cache of the same page types and ring (``None``: automatic, one round) near the end of a
    ``max_tokens`` context, in a measuring pool: the segment bytes torch's allocator takes,
    its rounding included: what the slab pool will be asked for. A decode width
    (``n_tokens <= MAX_N_Q``) stands for every width up to it, with each ``all_logits`` value of
    ``step_logits``, their outputs kept. Elsewhere (the slab is bookkeeping there) it is the sum
    of the largest live activations of one layer plus the last logits, from the shapes."""
    c = model.cfg
    if model.device.type == "cuda":
        max_tokens = max(max_tokens or n_tokens, n_tokens)
        scratch = _scratch_cache(model, n_tokens, max_tokens, type_k, type_v, ring_pages, rotate)
        if n_tokens > MAX_N_Q:
            # a prefill pass's sizes grow with the prefix, but not monotonically in segments (torch
            # gives a 1-10 MiB block a 20 MiB segment, a larger one its size): one pass, on an
            # empty pool as in the real prefill, where each chunk of a prompt read from the start ends
            ends = sorted({*range(n_tokens, max_tokens + 1, n_tokens), max_tokens})
            passes = [[(n_tokens, end, all_logits)] for end in ends]
        else:
            # decode: every width a captured step may have, both logits kinds, in one pool; each
            # output stays alive as a captured graph keeps its own
            passes = [[(w, max_tokens, every) for w in range(1, n_tokens + 1) for every in step_logits]]
        peak = 0
        for batch in passes:
            meter, outs = SlabPool(name="reserve pass"), []
            with torch.inference_mode(), meter.scope():
                for n, end, every in batch:
                    scratch.length = end - n
                    pos = scratch.begin(n)
                    outs.append(model.body(torch.zeros(n, dtype=torch.long, device=model.device), pos, scratch, every,
                                           hidden))
                    scratch.commit()
            del outs
            torch.cuda.synchronize()
            meter.close(collect=False)
            peak = max(peak, meter.peak)
        return peak
    width = 3 * c.hidden + (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 3 * c.ffn
    width += 2 * len(features(c.n_layers, hidden)) * c.hidden  # the tapped streams and their concatenation
    return n_tokens * width * model.dtype.itemsize + c.vocab_size * 4  # logits of the last token


def paged_bytes(cfg, type_k: str, type_v: str, max_tokens: int, slab: int, ring_pages: int = 0,
                pinned: int = 0) -> int:
    """Arena bytes a paged cache of ``max_tokens`` tokens needs with every page resident
    (``ArenaPlan.bytes``), besides ``pinned`` bytes pinned."""
    plan = ArenaPlan(slab, ring_pages, pair_bytes(type_k, type_v, cfg.n_kv_heads, cfg.head_dim), pinned)
    return plan.bytes(cfg.n_layers * -(-max_tokens // PAGE_TOKENS))


def phase_slabs(cache: CacheConfig, model, max_tokens: int, prefill_chunk: int, verify_width: int = 1,
                all_logits: bool = False, hidden=False) -> dict[str, int]:
    """The compute slab of each phase (``reserve_slab``) for a cache of ``max_tokens`` tokens."""
    ring = cache.ring_slots
    return slabs_for(model, prefill_chunk, verify_width, max_tokens=max_tokens, type_k=cache.type_k,
                     type_v=cache.type_v, ring_pages=ring if cache.mode == "stream" else 0, all_logits=all_logits,
                     hidden=hidden, rotate=cache.rotate)


def slabs_for(model, prefill_chunk: int, verify_width: int, *, max_tokens: int, type_k: str, type_v: str,
              ring_pages: int | None = 0, all_logits: bool = False,
              step_logits: tuple[bool, ...] = (False, True), hidden=False, rotate: bool = False) -> dict[str, int]:
    """{"prefill": slab of ``prefill_chunk``-token passes, "decode": of passes up to
    ``verify_width`` tokens (``reserve_slab``)}, through a paged cache of these page types and ring;
    ``hidden``: passes that also return those hidden states (an MTP head reads them)."""
    kv = dict(max_tokens=max_tokens, type_k=type_k, type_v=type_v, ring_pages=ring_pages, hidden=hidden, rotate=rotate)
    slabs = {"prefill": reserve_slab(model, min(prefill_chunk, max_tokens), all_logits=all_logits, **kv),
             "decode": reserve_slab(model, min(verify_width, max_tokens), step_logits=step_logits, **kv)}
    if model.device.type == "cuda":
        # prefill: a last partial chunk ends between the measured ends: one large segment more;
        # decode: a small segment for what a graph capture allocates beyond the eager passes
        slabs["prefill"] += 20 * MIB
        slabs["decode"] += 2 * MIB
    return slabs


def make_cache(cache: CacheConfig, arena: ArenaConfig, model, max_tokens: int, prefill_chunk: int,
               verify_width: int = 1, pinned_bytes: int = 0, all_logits: bool = False,
               slabs: dict[str, int] | None = None, hidden=False):
    """The cache ``cache.mode`` names for ``max_tokens`` tokens. The phases' compute slabs are
    reserved for ``prefill_chunk`` tokens (prefill; ``all_logits``: with every token's logits,
    as perplexity asks) and ``verify_width`` tokens (decode: 1 + the most draft tokens a verify
    batch carries), unless ``slabs`` gives them (``phase_slabs``, already measured).
    ``arena.mib=auto`` leaves room for ``pinned_bytes`` more in the pinned region (a draft)."""
    c = model.cfg
    cache.check()
    if max_tokens > c.context_length:  # every mode: RoPE past the trained context is not this model any more
        raise ValueError(f"context of {max_tokens} tokens (the prompt and the new tokens) "
                         f"exceeds the model's {c.context_limit}")
    if cache.mode == "contiguous":
        return ContiguousCache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, model.dtype, model.device)
    ring = cache.ring_slots
    slabs = slabs or phase_slabs(cache, model, max_tokens, prefill_chunk, verify_width, all_logits, hidden)
    slab = max(slabs.values())
    if arena.mib == "auto":  # room for every page of the context: nothing needs to stream
        ring_pages = (ring or 2) if cache.mode == "stream" else 0
        nbytes = paged_bytes(c, cache.type_k, cache.type_v, max_tokens, slab, ring_pages, pinned_bytes)
    else:
        try:
            nbytes = int(float(arena.mib) * MIB)
        except ValueError:
            raise ValueError(f"arena.mib={arena.mib!r}: give a number of MiB or auto") from None
    return PagedCache(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_tokens=max_tokens,
                      type_k=cache.type_k, type_v=cache.type_v, mode=cache.mode, arena=Arena(nbytes, model.device),
                      ring_pages=ring, slabs=slabs, verify_width=verify_width, time_waits=cache.time_waits,
                      rotate=cache.rotate, pdl=getattr(model, "gemv", False),
                      residency=RESIDENCY[cache.residency](step=int(cache.residency_step)))
