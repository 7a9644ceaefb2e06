"""Qwen2 / Qwen3 dense forward pass in plain torch, attending through a KV-cache object.

One sequence, tokens [n] -> logits. Qwen2 has QKV biases; Qwen3 has per-head RMSNorm on q and
k (before RoPE) and no biases. RoPE is the NEOX layout llama.cpp uses for both archs (the two
halves of each head rotate together), which is HF's ``rotate_half``; with YaRN (``cfg.yarn``)
its frequencies are blended and cos/sin scaled as transformers does (``kernels/rope.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Callable

import torch
from gguf import GGUFReader

from kernels.reference import rms_norm, rope_inv_freq

from kvstream.cache.contiguous import ContiguousCache
from kvstream.model.layer_ops import LayerOps
from kvstream.model.loader import ModelConfig, load_weights, open_gguf, read_config
from kvstream.model import weights
from kvstream.model.weights import MATRICES, WEIGHT_FORMATS, Q8, embedding, flat, linear, swiglu, unflat


def features(n_layers: int, hidden: bool | tuple[int, ...]) -> tuple[int, ...]:
    """The blocks whose entering residual streams ``body(hidden=...)`` returns: () for False, the
    stream after the last block (index ``n_layers``) for True, else ``hidden`` itself, checked."""
    if hidden is False or hidden is None:
        return ()
    if hidden is True:
        return (n_layers,)
    taps = tuple(int(i) for i in hidden)
    if not taps or any(not 0 <= i <= n_layers for i in taps) or len(set(taps)) != len(taps):
        raise ValueError(f"hidden features {list(hidden)}: distinct block indices in 0..{n_layers} "
                         f"(the stream entering that block; {n_layers}: after the last)")
    return taps


def eagle3_features(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high features as SGLang and vLLM tap them: the streams entering
    blocks 2, n / 2 and n - 3."""
    return (2, n_layers // 2, n_layers - 3)


@dataclass
class Layer:
    """One block's weights. Q/K/V and gate/up are stored fused (one matmul each instead of three
    and two): at batch 1 every matmul is a pass over its weights, and fewer, larger passes stream
    memory better on CPU and launch fewer kernels on GPU."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor          # [(H + 2 KVH) * D, hidden]
    bqkv: torch.Tensor | None   # qwen2 only
    wo: torch.Tensor
    q_norm: torch.Tensor | None  # qwen3 only
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor     # [2 * ffn, hidden]
    w_down: torch.Tensor

    @classmethod
    def from_weights(cls, w: dict[str, torch.Tensor], i: int) -> "Layer":
        p = f"blk.{i}."
        biases = [w.get(p + f"attn_{n}.bias") for n in "qkv"]
        return cls(
            attn_norm=w[p + "attn_norm.weight"],
            wqkv=torch.cat([w.pop(p + f"attn_{n}.weight") for n in "qkv"]),
            bqkv=torch.cat(biases) if biases[0] is not None else None,
            wo=w[p + "attn_output.weight"],
            q_norm=w.get(p + "attn_q_norm.weight"), k_norm=w.get(p + "attn_k_norm.weight"),
            ffn_norm=w[p + "ffn_norm.weight"],
            w_gate_up=torch.cat([w.pop(p + "ffn_gate.weight"), w.pop(p + "ffn_up.weight")]),
            w_down=w[p + "ffn_down.weight"],
        )


class Qwen:
    """Weights of a Qwen2/Qwen3 model and its forward pass. ``weight_format`` q8_0 (or q8_0_int8:
    ``kvstream/model/weights.py``) holds the matrices (``weights.MATRICES``) in q8_0 blocks, quantized from ``weights``' values, and the
    rest in ``dtype`` (default: the weights' dtype), which is also the activations' dtype.
    ``gemv``: on CUDA the layers' dense matrices take passes of 1-16 rows through ``kernels/gemv.py``
    and ``gemv_mma.py``, q8_0 matrices (the LM head too) single rows through ``kernels/q8_gemv.py``
    (``weights.decode_matmul``; gate/up with SwiGLU in the epilogue), and the pass's Triton kernels
    launch as programmatic dependents (``model.gemv``)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], weight_format: str = "dense",
                 dtype: torch.dtype | None = None, gemv: bool = False):
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {weight_format!r}: one of {', '.join(WEIGHT_FORMATS)}")
        self.gemv = gemv
        self.cfg = cfg
        w = dict(weights)  # fusing pops the parts from this copy; the caller's dict keeps them until we return
        self.embed = w["token_embd.weight"]
        self._dtype = dtype or self.embed.dtype
        self.out_norm = w["output_norm.weight"]
        self.lm_head = self.embed if cfg.tied_output else w["output.weight"]
        self.layers = [Layer.from_weights(w, i) for i in range(cfg.n_layers)]
        if weight_format != "dense" or self._dtype != self.embed.dtype:
            self._convert(weight_format)
        self.ops = LayerOps(self.embed.device, gemv)
        yarn = asdict(cfg.yarn) if cfg.yarn else {}
        self.inv_freq, self.rope_scale = rope_inv_freq(cfg.head_dim, cfg.rope_base, self.embed.device, **yarn)

    def _convert(self, weight_format: str) -> None:
        """Every weight to the compute dtype, the matrices to q8_0 blocks unless the format is dense (the source
        tensors stay alive until the constructor returns: ``load_model`` converts on the host)."""
        done = {}  # a tied LM head is converted once, with the embedding

        def conv(name, t):
            if t is None:
                return None
            if id(t) not in done:
                done[id(t)] = (Q8.of(t, weight_format == "q8_0_int8") if weight_format != "dense" and name in MATRICES
                               else t.to(self._dtype))
            return done[id(t)]

        self.embed, self.lm_head = conv("embed", self.embed), conv("lm_head", self.lm_head)
        self.out_norm = conv("out_norm", self.out_norm)
        self.layers = [replace(L, **{f.name: conv(f.name, getattr(L, f.name)) for f in fields(L)}) for L in self.layers]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (and the dense weights')."""
        return self._dtype

    def forward(self, tokens: torch.Tensor, cache, all_logits: bool = False, hidden: bool | tuple[int, ...] = False):
        """tokens [n] (int64, on the model's device) -> logits [n, vocab] or [1, vocab] (the last);
        with ``hidden``, (logits, h): h the rows' residual stream before the final norm, or at the
        blocks ``hidden`` names (``body``).

        The cache stores the n new K/V rows; positions continue from its current length.
        """
        pos = cache.begin(tokens.shape[0])
        with cache.compute():
            out = self.body(tokens, pos, cache, all_logits, hidden)
            pooled = cache.slab_pool is not None  # (the pool of this pass: asked before the commit)
        cache.commit()
        # a slab's buffers are the phase's: the caller keeps its own copy of the outputs
        if not pooled:
            return out
        return tuple(t.clone() for t in out) if hidden else out.clone()

    def body(self, tokens: torch.Tensor, pos: torch.Tensor, cache, all_logits: bool = False,
             hidden: bool | tuple[int, ...] = False):
        """The device side of ``forward`` between ``cache.begin`` and ``cache.commit``: no host
        decisions, no host syncs, so a decode step can be captured as a CUDA graph. ``hidden``:
        return ``(logits, h)`` with h every row's residual stream before the final norm (an MTP
        head's input), the logits the last row's unless ``all_logits``. A tuple of block indices
        instead: h the residual streams entering those blocks, side by side ([n, len x hidden];
        index ``n_layers``: after the last block, what True gives; EAGLE-3's low / middle / high
        features: ``features``)."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_eps
        n = tokens.shape[0]
        taps = features(cfg.n_layers, hidden)
        tapped = {}
        cache.start_step()
        rope = ops.rope(pos, self.inv_freq, self.dtype, self.rope_scale)
        x, delta = embedding(tokens, self.embed, self.dtype), None
        H, D = cfg.n_heads, cfg.head_dim
        qk_width = (H + cfg.n_kv_heads) * D
        # a q8_0_int8 decode row: each norm, a paged cache's attention merge and gate/up's SwiGLU write their
        # rows' q8_0 blocks once for the matmuls after them (their programs would otherwise each quantize x;
        # weights.int8_row)
        q8 = weights.int8_row(tokens, self.layers[0].wqkv, self.gemv)
        for i, L in enumerate(self.layers):
            x, h, hq = ops.add_rms_norm(x, L.attn_norm, eps, delta, q8=q8)  # the previous block's residual add too
            if i in taps:  # the stream entering block i
                tapped[i] = x
            qkv = linear(h, L.wqkv, L.bqkv, self.gemv, hq)
            # q and k heads side by side: one RoPE over both, which a paged cache fuses into its store
            qk = qkv[:, :qk_width].view(n, -1, D)
            v = qkv[:, qk_width:].view(n, cfg.n_kv_heads, D)
            if L.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :H], L.q_norm, eps), rms_norm(qk[:, H:], L.k_norm, eps)), 1)
            # (its q8_0 blocks too, where the attention's merge writes them for the output projection)
            a, aq = cache.attend_rope(i, qk, v, rope, q8=True) if q8 else (cache.attend_rope(i, qk, v, rope), None)
            x, h, hq = ops.add_rms_norm(x, L.ffn_norm, eps, linear(a.reshape(n, H * D), L.wo, None, self.gemv, aq),
                                        q8=q8)
            g, gq = swiglu(h, L.w_gate_up, ops.silu_mul, self.gemv, hq)
            delta = linear(g, L.w_down, None, self.gemv, gq)
        if not all_logits and not hidden:
            x, delta = x[-1:], delta[-1:]
        x, h, hq = ops.add_rms_norm(x, self.out_norm, eps, delta, q8=q8)
        tapped[cfg.n_layers] = x
        # a q8_0 head's row takes q8_gemv (exact 80, int8 63 us; q8_linear 80); a dense head stays with cuBLAS
        # (kernels/gemv.py read it in 112 against 130 us alone, results/kernels/q8_gemv/int8: not yet run in a step)
        logits = linear(h if all_logits else h[-1:], self.lm_head, None, self.gemv and isinstance(self.lm_head, Q8),
                        hq).float()
        cache.end_step()
        if not taps:
            return logits
        return logits, tapped[taps[0]] if len(taps) == 1 else torch.cat([tapped[i] for i in taps], -1)

    __call__ = forward

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every weight tensor by name (a tied output head appears once, as the embedding; a q8_0
        weight as its quants ``NAME.q`` and scales ``NAME.d``)."""
        out = flat("embed", self.embed) | flat("out_norm", self.out_norm)
        if self.lm_head is not self.embed:
            out |= flat("lm_head", self.lm_head)
        for i, L in enumerate(self.layers):
            for f in fields(L):
                if getattr(L, f.name) is not None:
                    out |= flat(f"{i}.{f.name}", getattr(L, f.name))
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def map_tensors(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> "Qwen":
        """A copy whose every weight is ``fn(name, tensor)`` (same config, shapes and ties):
        how a draft's weights move into arena views and back."""
        new = {name: fn(name, t) for name, t in self.tensors().items()}
        other = object.__new__(Qwen)
        other.__dict__.update(self.__dict__)
        other.embed, other.out_norm = unflat("embed", self.embed, new), unflat("out_norm", self.out_norm, new)
        other.lm_head = other.embed if self.lm_head is self.embed else unflat("lm_head", self.lm_head, new)
        other.layers = [replace(L, **{f.name: unflat(f"{i}.{f.name}", getattr(L, f.name), new)
                                      for f in fields(L) if getattr(L, f.name) is not None})
                        for i, L in enumerate(self.layers)]
        other.inv_freq = self.inv_freq.to(other.embed.device)
        other._dtype = other.out_norm.dtype  # the activations' dtype follows the (always dense) norms
        other.ops = LayerOps(other.embed.device, self.gemv)
        return other

    def new_cache(self, max_tokens: int):
        c = self.cfg
        return ContiguousCache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, self.dtype, self.device)


def load_model(gguf, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               weights: str = "dense", gemv: bool = False, **rope) -> Qwen:
    """Load a GGUF (a path, or an open ``GGUFReader``) into a :class:`Qwen` on ``device`` in ``dtype``,
    its matrices in q8_0 blocks with ``weights="q8_0"`` or ``"q8_0_int8"`` (quantized from the file's values in fp32);
    ``rope`` (rope_scaling, rope_factor, yarn_orig_ctx, max_context) overrides the file's rope
    scaling (``read_config``); ``gemv``: see :class:`Qwen`."""
    reader = gguf if isinstance(gguf, GGUFReader) else open_gguf(gguf)
    cfg = read_config(reader, **rope)
    if weights == "dense":
        return Qwen(cfg, load_weights(reader, cfg, dtype, device), gemv=gemv)
    # quantized on the host, so the device never holds the fp32 source weights (4x the bf16 model)
    host = Qwen(cfg, load_weights(reader, cfg, torch.float32, "cpu"), weights, dtype, gemv)
    return host if torch.device(device).type == "cpu" else host.map_tensors(lambda _, t: t.to(device))
