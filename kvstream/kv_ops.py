"""The page operations the caches use: Triton kernels on CUDA, their plain-torch references
elsewhere (DESIGN.md: on CPU the references take the kernels' place)."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.formats import PageFormat
from kernels.reference import Partials


class KVOps:
    """store / gather / attention-partials / merge for one device."""

    def __init__(self, device: torch.device):
        self.triton = device.type == "cuda"
        if self.triton:
            from kernels import decode_attention, gather, store

            self._store, self._gather = store.store, gather.gather
            self._attn, self._merge = decode_attention.decode_attention, decode_attention.merge
            self._splits, self._max_splits = decode_attention.splits_for, decode_attention.max_splits

    def store(self, pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fmt: PageFormat) -> None:
        (self._store if self.triton else reference.store)(pool, rows, slots, fmt)

    def gather(self, pool, page_ids, n_tokens: int, fmt: PageFormat, dtype) -> torch.Tensor:
        return (self._gather if self.triton else reference.gather)(pool, page_ids, n_tokens, fmt, dtype)

    def partials_buffer(self, q: torch.Tensor, k_fmt: PageFormat, n_pages: int, calls: int) -> Partials | None:
        """Triton: one buffer for the partials of ``calls`` calls over ``n_pages`` pages (the most
        any plan of them takes), filled call after call and merged without a copy. Its size comes
        from shapes alone, so a step allocates the same bytes whatever its plan, and the reserve
        pass that sizes the compute slab measured them. None elsewhere."""
        if not self.triton:
            return None
        n_q, n_heads, d = q.shape
        rows = self._max_splits(n_q, n_heads, k_fmt.n_kv_heads, n_pages, calls, q.device)
        f32 = dict(dtype=torch.float32, device=q.device)
        return Partials(torch.empty(rows, n_q, n_heads, **f32), torch.empty(rows, n_q, n_heads, **f32),
                        torch.empty(rows, n_q, n_heads, d, **f32))

    def partials(self, q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt, key_start=None, key_end=None,
                 max_keys: int | None = None, into: Partials | None = None):
        """The kernel's partials over keys [key_start, key_end); ``max_keys`` (a bound on that
        range, known on the host) sizes the split count to it instead of to the whole table;
        ``into`` (Triton): a buffer whose first rows take them (a view of it is returned)."""
        if self.triton:
            n_splits = None if max_keys is None else self._splits(q.shape[0], q.shape[1], k_fmt.n_kv_heads,
                                                                  max_keys, q.device)
            return self._attn(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt, key_start=key_start,
                              key_end=key_end, return_partials=True, n_splits=n_splits, partials=into)
        return reference.decode_attention_partials(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt,
                                                   key_start=key_start, key_end=key_end)

    def attention(self, q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt) -> torch.Tensor:
        """One pass over every key: out [n_q, n_heads, D] in q's dtype."""
        if self.triton:
            return self._attn(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt)
        return reference.decode_attention(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt).to(q.dtype)

    def merge(self, parts, dtype: torch.dtype) -> torch.Tensor:
        if self.triton:
            return self._merge(*parts, dtype=dtype)
        return reference.finalize(reference.merge_partials(*parts)).to(dtype)
