"""The page operations the caches use: Triton kernels on CUDA, their plain-torch references
elsewhere (DESIGN.md: on CPU the references take the kernels' place)."""

from __future__ import annotations

import torch

from kernels import reference
from kernels.formats import PageFormat


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester-Walsh-Hadamard matrix [n, n] (n a power of two; symmetric, its
    own inverse), as llama.cpp's ``ggml_gen_hadamard`` builds it."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Walsh-Hadamard matrix needs a power-of-two size, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / n ** 0.5).float()


def _blocks(out: torch.Tensor, q8_out: tuple | None) -> torch.Tensor:
    """out, its rows' q8_0 blocks written into ``q8_out`` (``reference.q8_rows``) where given."""
    if q8_out is not None:
        for dst, src in zip(q8_out, reference.q8_rows(out.reshape(out.shape[0], -1))):
            dst.copy_(src)
    return out


class KVOps:
    """store (alone or after RoPE) / gather / attention (in one call or in rounds) for one device.
    ``pdl``: a decode pass's kernels (RoPE + store, attention, merge) launch as programmatic
    dependents of the kernel before them (CUDA, ``kernels/pdl.py``; with ``model.gemv``)."""

    def __init__(self, device: torch.device, pdl: bool = False):
        self.triton = device.type == "cuda"
        self.pdl = pdl and self.triton
        if self.triton:
            from kernels import decode_attention, gather, rope_store, stage, store

            self._store, self._gather, self._rope_store = store.store, gather.gather, rope_store.rope_store
            self._stage_rows = stage.stage_rows
            self._attn, self._round_state = decode_attention.decode_attention, decode_attention.round_state

    def store(self, pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fmt: PageFormat) -> None:
        (self._store if self.triton else reference.store)(pool, rows, slots, fmt)

    def rope_store(self, qk: torch.Tensor, v: torch.Tensor, rope, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   slots: torch.Tensor, k_fmt: PageFormat, v_fmt: PageFormat) -> torch.Tensor:
        """RoPE over qk [n, H + KVH, D] (``rope``: ``kvstream.model.layer_ops.Rope``), its K heads and
        v stored at ``slots``: one launch on CUDA (``kernels.rope_store``); returns the rotated q."""
        if self.triton:
            return self._rope_store(qk, v, rope.pos, rope.inv_freq, k_pool, v_pool, slots, k_fmt, v_fmt, rope.scale,
                                    pdl=self.pdl)
        return reference.rope_store(qk, v, *rope.cos_sin, k_pool, v_pool, slots, k_fmt, v_fmt)

    def stage_rows(self, pos, slots, lens, tables, base: torch.Tensor, offset: int, n: int) -> None:
        """A pass's positions, slots and lengths from a start on the device (``kernels.stage``)."""
        (self._stage_rows if self.triton else reference.stage_rows)(pos, slots, lens, tables, base, offset, n)

    def gather(self, pool, page_ids, n_tokens: int, fmt: PageFormat, dtype) -> torch.Tensor:
        return (self._gather if self.triton else reference.gather)(pool, page_ids, n_tokens, fmt, dtype)

    def round_state(self, q: torch.Tensor, k_fmt: PageFormat, table: torch.Tensor):
        """The state of one ``attention`` call over ``table``'s keys read in rounds: Triton, the
        partials rows of that call's splits (sized from shapes alone, so a step allocates the same
        bytes whatever its plan, and the reserve pass that sizes the compute slab measured them);
        elsewhere a list the rounds' K/V fill."""
        return self._round_state(q, table, k_fmt) if self.triton else []

    def attention_round(self, state, q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt, key_start, key_end,
                        first: bool, last: bool, q8_out: tuple | None = None) -> torch.Tensor | None:
        """One round of ``attention``: keys [key_start, key_end) (page-aligned; rounds in increasing
        order, the last to the end). The last round returns the output, bit-identical to
        ``attention`` over every key (the kernel: that call's splits, each carried across the rounds
        in ``state``; the reference: the rounds' K/V side by side, then the same computation). ``q8_out``:
        as ``attention``'s, written by the last round."""
        if self.triton:
            res = self._attn(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt, key_start=key_start,
                             key_end=key_end, partials=state, carry=not first, return_partials=not last, pdl=self.pdl,
                             q8_out=q8_out if last else None)
            return res if last else None
        state.append(reference.range_kv(k_pool, v_pool, table, seq_len, k_fmt, v_fmt, key_start, key_end))
        if not last:
            return None
        kv = tuple(torch.cat(x) for x in zip(*state))
        return _blocks(reference.finalize(reference.decode_attention_partials(q, k_pool, v_pool, table, seq_len, k_fmt,
                                                                              v_fmt, kv=kv)).to(q.dtype), q8_out)

    def attention(self, q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt, q8_out: tuple | None = None) -> torch.Tensor:
        """One pass over every key: out [n_q, n_heads, D] in q's dtype. ``q8_out``: (quants int8 [n_q,
        n_heads * D], scales fp16 [n_q, n_heads * D / 32]) to write out's rows' q8_0 blocks into (the
        output projection's ``xq``; on CUDA by the attention's merge)."""
        if self.triton:
            return self._attn(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt, pdl=self.pdl, q8_out=q8_out)
        return _blocks(reference.decode_attention(q, k_pool, v_pool, table, seq_len, k_fmt, v_fmt).to(q.dtype),
                       q8_out)
