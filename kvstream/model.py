"""Qwen2 / Qwen3 dense forward pass in plain torch, attending through a KV-cache object.

One sequence, tokens [n] -> logits. Qwen2 has QKV biases; Qwen3 has per-head RMSNorm on q and
k (before RoPE) and no biases. RoPE is the NEOX layout llama.cpp uses for both archs (the two
halves of each head rotate together), which is HF's ``rotate_half``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGUFReader

from .cache import ContiguousCache
from .loader import ModelConfig, load_weights, open_gguf, read_config


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # the variance in fp32 whatever the compute dtype, as HF and llama.cpp do
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D]; cos/sin [n, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Qwen:
    """Weights of a Qwen2/Qwen3 model and its forward pass."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        w = weights
        self.embed = w["token_embd.weight"]
        self.out_norm = w["output_norm.weight"]
        self.lm_head = self.embed if cfg.tied_output else w["output.weight"]
        self.layers = [
            Layer(
                attn_norm=w[f"blk.{i}.attn_norm.weight"],
                wq=w[f"blk.{i}.attn_q.weight"], wk=w[f"blk.{i}.attn_k.weight"], wv=w[f"blk.{i}.attn_v.weight"],
                wo=w[f"blk.{i}.attn_output.weight"],
                bq=w.get(f"blk.{i}.attn_q.bias"), bk=w.get(f"blk.{i}.attn_k.bias"), bv=w.get(f"blk.{i}.attn_v.bias"),
                q_norm=w.get(f"blk.{i}.attn_q_norm.weight"), k_norm=w.get(f"blk.{i}.attn_k_norm.weight"),
                ffn_norm=w[f"blk.{i}.ffn_norm.weight"],
                w_gate=w[f"blk.{i}.ffn_gate.weight"], w_up=w[f"blk.{i}.ffn_up.weight"], w_down=w[f"blk.{i}.ffn_down.weight"],
            )
            for i in range(cfg.n_layers)
        ]
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.embed.device) / d))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, tokens: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor:
        """tokens [n] (int64, on the model's device) -> logits [n, vocab] or [1, vocab] (the last).

        The cache stores the n new K/V rows; positions continue from its current length.
        """
        cfg = self.cfg
        n = tokens.shape[0]
        pos = cache.begin(n)
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().to(self.dtype)[:, None, :]
        sin = freqs.sin().to(self.dtype)[:, None, :]
        x = F.embedding(tokens, self.embed)
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, cfg.rms_eps)
            q = F.linear(h, L.wq, L.bq).view(n, cfg.n_heads, cfg.head_dim)
            k = F.linear(h, L.wk, L.bk).view(n, cfg.n_kv_heads, cfg.head_dim)
            v = F.linear(h, L.wv, L.bv).view(n, cfg.n_kv_heads, cfg.head_dim)
            if L.q_norm is not None:
                q = rms_norm(q, L.q_norm, cfg.rms_eps)
                k = rms_norm(k, L.k_norm, cfg.rms_eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = cache.attend(i, q, k, v).reshape(n, cfg.n_heads * cfg.head_dim)
            x = x + F.linear(a, L.wo)
            h = rms_norm(x, L.ffn_norm, cfg.rms_eps)
            x = x + F.linear(F.silu(F.linear(h, L.w_gate)) * F.linear(h, L.w_up), L.w_down)
        cache.commit()
        if not all_logits:
            x = x[-1:]
        return F.linear(rms_norm(x, self.out_norm, cfg.rms_eps), self.lm_head).float()

    __call__ = forward

    def new_cache(self, max_tokens: int):
        c = self.cfg
        return ContiguousCache(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, self.dtype, self.device)


def load_model(gguf, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Qwen:
    """Load a GGUF (a path, or an open ``GGUFReader``) into a :class:`Qwen` on ``device`` in ``dtype``."""
    reader = gguf if isinstance(gguf, GGUFReader) else open_gguf(gguf)
    cfg = read_config(reader)
    return Qwen(cfg, load_weights(reader, cfg, dtype, device))
