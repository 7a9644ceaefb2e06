"""Tiny random-weight Qwen2 / Qwen3 models written as real GGUF files with ``gguf.GGUFWriter``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, RopeScalingType, quantize
from gguf.constants import GGML_QUANT_SIZES

from tiny_vocab import add_tiny_vocab, tiny_vocab


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen2"
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 96
    n_layers: int = 2
    tied: bool = False
    types: tuple[QT, ...] = (QT.F32,)  # cycled over the 2-D weight tensors
    context_length: int = 512
    rope_base: float = 10000.0
    yarn: tuple[float, int] | None = None  # (factor, original context): {arch}.rope.scaling.* keys
    seed: int = 0


def _k_quant_bytes(rng: np.random.Generator, rows: int, cols: int, qtype: QT, std: float) -> np.ndarray:
    """Random but well-formed K-quant blocks (the gguf package cannot quantize K types):
    random quants and sub-scales, with the fp16 super-block scales set so values have about ``std``."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == QT.Q4_K:  # d, dmin (fp16) first; |value| <= 63 * 15 * d
        raw[:, 0:4] = np.array([std / 300, std / 300], dtype=np.float16).view(np.uint8)
    elif qtype == QT.Q6_K:  # d (fp16) last; |value| <= 128 * 32 * d
        raw[:, -2:] = np.array([std / 1500], dtype=np.float16).view(np.uint8)
    else:
        raise ValueError(f"no random block writer for {qtype.name}")
    return raw.reshape(rows, cols // block * size)


def _add(w: GGUFWriter, rng, name: str, x: np.ndarray, qtype: QT, tweak=None) -> None:
    if tweak is not None:
        x = tweak(name, x)
        if x is None:
            return
        if x.dtype != np.float32:  # a tweak that changes the dtype writes the array as it is
            w.add_tensor(name, x)
            return
    if x.ndim == 1 or qtype == QT.F32:
        w.add_tensor(name, x.astype(np.float32))
    elif qtype == QT.F16:
        w.add_tensor(name, x.astype(np.float16))
    elif qtype in (QT.Q4_K, QT.Q6_K):
        w.add_tensor(name, _k_quant_bytes(rng, *x.shape, qtype, float(x.std())), raw_dtype=qtype)
    else:
        w.add_tensor(name, quantize(x.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_model(path: str | Path, spec: TinySpec = TinySpec(), tweak=None) -> Path:
    """Write a random-weight model with the tiny byte-level BPE vocabulary; returns the path.

    ``tweak(name, array)`` may replace a tensor before it is written (None drops it), to make
    broken files for error tests."""
    s = spec
    rng = np.random.default_rng(s.seed)
    vocab = len(tiny_vocab()[0])
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    w = GGUFWriter(str(path), s.arch)
    add = lambda name, x, qtype: _add(w, rng, name, x, qtype, tweak)
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    if s.yarn is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.yarn[0])
        w.add_rope_scaling_orig_ctx_len(s.yarn[1])
    w.add_layer_norm_rms_eps(1e-6)
    add_tiny_vocab(w)

    cycle = itertools.cycle(s.types)
    mat = lambda rows, cols: (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    bias = lambda n: (0.1 * rng.standard_normal(n)).astype(np.float32)

    add("token_embd.weight", rng.standard_normal((vocab, s.hidden)).astype(np.float32), next(cycle))
    add("output_norm.weight", norm(s.hidden), QT.F32)
    if not s.tied:
        add("output.weight", mat(vocab, s.hidden), next(cycle))
    for i in range(s.n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(s.hidden), QT.F32)
        add(p + "attn_q.weight", mat(q, s.hidden), next(cycle))
        add(p + "attn_k.weight", mat(kv, s.hidden), next(cycle))
        add(p + "attn_v.weight", mat(kv, s.hidden), next(cycle))
        if s.arch == "qwen2":
            for n, d in (("q", q), ("k", kv), ("v", kv)):
                add(p + f"attn_{n}.bias", bias(d), QT.F32)
        else:
            add(p + "attn_q_norm.weight", norm(s.head_dim), QT.F32)
            add(p + "attn_k_norm.weight", norm(s.head_dim), QT.F32)
        add(p + "attn_output.weight", mat(s.hidden, q), next(cycle))
        add(p + "ffn_norm.weight", norm(s.hidden), QT.F32)
        add(p + "ffn_gate.weight", mat(s.ffn, s.hidden), next(cycle))
        add(p + "ffn_up.weight", mat(s.ffn, s.hidden), next(cycle))
        add(p + "ffn_down.weight", mat(s.hidden, s.ffn), next(cycle))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
