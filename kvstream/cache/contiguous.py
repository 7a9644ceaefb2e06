"""The KV-cache interface the model attends through, and the contiguous cache.

The model calls, for one forward pass over ``n`` new tokens::

    pos = cache.begin(n)                    # positions [n] of the new tokens (device tensor)
    out = cache.attend(layer, q, k, v)      # per layer: store k/v rows, attend causally
    out = cache.attend_rope(layer, qk, v, rope)  # the same, q and k side by side before RoPE
    cache.commit()                          # the n rows become part of the history
    cache.set_phase("decode")               # after prefill: re-lay memory for decoding

Paged, quantized and streamed caches implement the same three calls, so the model never
changes between cache modes. ``truncate(length)`` rolls back rejected speculative tokens.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.formats import PAGE_TOKENS

from kvstream.telemetry import StepStats


class ContextOverflow(ValueError):
    """More tokens than the cache was sized for."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] at the last n of the L positions of k / v [L, KVH, D] -> [n, H, D]: each
    query sees the whole prefix and the new rows up to its own. The lower-right causal bias is
    no tensor, so CUDA's flash backend runs it with GQA as is; a boolean mask would send SDPA
    to a backend that first copies K and V once per query head (~190 MiB at 32K for the 1.5B)."""
    n, L = q.shape[0], k.shape[0]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=causal_lower_right(n, L) if n > 1 else None, enable_gqa=True)
    return out[0].transpose(0, 1)


class CacheBase:
    """What every cache shares: the committed length, the pending batch, rollback."""

    length: int = 0
    _n: int = 0  # tokens of the forward pass in progress
    slab_pool = None  # where a forward pass's device buffers come from (kvstream.cache.slab_pool); None: torch's

    def compute(self):
        """The scope of a forward pass's device buffers: a paged cache on CUDA puts them in its
        arena's slab; elsewhere torch's allocator as usual."""
        return contextlib.nullcontext() if self.slab_pool is None else self.slab_pool.scope()

    def recycles(self, n: int) -> bool:
        """A pass of ``n`` tokens starts on an empty pool, which no captured graph can keep."""
        return False

    def set_phase(self, phase: str) -> None:
        """Re-lay memory for a phase ("prefill", "decode"); nothing to do without an arena."""

    def start_step(self) -> None:
        """The device side of a forward pass begins (a streaming cache starts its copies)."""

    def end_step(self) -> None:
        """The device side of a forward pass ends (a streaming cache joins its last copies)."""

    def attend_rope(self, layer: int, qk: torch.Tensor, v: torch.Tensor, rope, q8: bool = False):
        """``attend`` for q and k heads side by side, not yet rotated (qk [n, H + KVH, D]; ``rope``:
        ``kvstream.model.layer_ops.Rope``): one RoPE over both, then ``attend``. A paged cache
        fuses the rotation into its store. ``q8``: (out, its rows' q8_0 blocks or None), the blocks
        (``reference.q8_rows``' layout) where the attention writes them anyway (a paged decode pass's
        merge), for the output projection's ``xq``; None here: the projection makes its own."""
        h = v.shape[1]
        qk = rope(qk)
        out = self.attend(layer, qk[:, :-h], qk[:, -h:], v)
        return (out, None) if q8 else out

    def commit(self) -> None:
        self.length += self._n
        self._n = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length


class ContiguousCache(CacheBase):
    """All layers' K/V in one dense tensor per K and V, attention with torch SDPA."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: str | torch.device):
        shape = (n_layers, max_tokens, n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.length = 0
        self._n = 0
        self.stats = StepStats()

    def begin(self, n: int) -> torch.Tensor:
        if self.length + n > self.max_tokens:
            raise ContextOverflow(f"context of {self.length + n} tokens exceeds the cache's {self.max_tokens}")
        self._n = n
        pages = -(-(self.length + n) // PAGE_TOKENS)
        self.stats = StepStats(resident_pages=pages, rounds=1)
        return torch.arange(self.length, self.length + n, device=self.k.device)

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], k_new / v_new [n, KVH, D] -> attention output [n, H, D]."""
        lo, hi = self.length, self.length + self._n
        self.k[layer, lo:hi] = k_new
        self.v[layer, lo:hi] = v_new
        return causal_attention(q, self.k[layer, :hi], self.v[layer, :hi])

