"""Read a Qwen2 / Qwen3 GGUF with the ``gguf`` package: a typed config and dequantized weights."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, dequantize

SUPPORTED_ARCHS = ("qwen2", "qwen3")
# Types the gguf package dequantizes and that Qwen GGUFs actually ship.
SUPPORTED_TENSOR_TYPES = frozenset(
    {QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
     QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
)


class GGUFError(ValueError):
    """A GGUF file that kvstream cannot use; the message names the file and the cause."""


ROPE_SCALINGS = ("none", "yarn")


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling (Peng et al. 2023, arXiv:2309.00071) with the constants transformers'
    ``_compute_yarn_parameters`` and llama.cpp default to: frequency bands that turn more than
    ``beta_fast`` times over the original context keep their frequency, bands turning fewer than
    ``beta_slow`` times are interpolated (divided by ``factor``), a linear ramp blends those
    between; cos and sin are scaled by 0.1 ln(factor) + 1 (so q.k by its square). The fields are
    ``kernels.reference.rope_inv_freq``'s arguments."""

    factor: float
    orig_ctx: int  # tokens the model was trained at
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    context_length: int  # the most tokens a run may hold: the GGUF's, with YaRN factor x original, or max_context
    tied_output: bool
    yarn: Yarn | None = None
    context_overridden: bool = False  # context_length is model.max_context's, not the rope's own limit

    @property
    def context_limit(self) -> str:
        """The context limit in words, for errors: ``131072 tokens (YaRN: factor 4 x original 32768)``."""
        if self.context_overridden:
            return f"{self.context_length} tokens (model.max_context)"
        if self.yarn is None:
            return f"{self.context_length} tokens (model.rope_scaling=yarn extends it)"
        return f"{self.context_length} tokens (YaRN: factor {self.yarn.factor:g} x original {self.yarn.orig_ctx})"

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Open a GGUF, turning the reader's low-level failures into a :class:`GGUFError`."""
    path = Path(path)
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/IndexError on corrupt files
        raise GGUFError(f"{path}: not a readable GGUF file, truncated or corrupt ({size} bytes; "
                        f"{type(e).__name__}: {e})") from e
    return reader


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise GGUFError(f"missing metadata key {key!r}")
        return default
    return f.contents()


def _rope_scaling(reader: GGUFReader, arch: str, scaling: str | None, factor: float | None,
                  orig_ctx: int | None) -> tuple[Yarn | None, int]:
    """(YaRN or None, the context limit) from the GGUF's ``{arch}.rope.scaling.*`` keys, each
    argument that is not None overriding its key (``model.rope_scaling`` / ``rope_factor`` /
    ``yarn_orig_ctx``). The original context defaults to ``{arch}.context_length``."""
    key = f"{arch}.rope.scaling."
    scaling = scaling or _field(reader, key + "type", "none")
    if scaling not in ROPE_SCALINGS:
        raise GGUFError(f"{key}type={scaling!r}: kvstream runs {' or '.join(ROPE_SCALINGS)} "
                        f"(model.rope_scaling overrides the file's)")
    orig = orig_ctx or int(_field(reader, key + "original_context_length", _field(reader, f"{arch}.context_length")))
    if scaling == "none":
        if factor is not None or orig_ctx is not None:
            raise ValueError(f"model.rope_factor={factor} / model.yarn_orig_ctx={orig_ctx} apply to YaRN, but the "
                             f"GGUF's rope is not scaled: add model.rope_scaling=yarn")
        return None, orig
    if factor is None:
        if key + "factor" not in reader.fields:
            raise GGUFError(f"YaRN needs a factor and the GGUF has no {key}factor: give model.rope_factor")
        factor = float(_field(reader, key + "factor"))
        if factor < 1:
            raise GGUFError(f"{key}factor={factor}: a YaRN factor must be >= 1 (model.rope_factor overrides it)")
    return Yarn(factor, orig), int(factor * orig)


def read_config(reader: GGUFReader, rope_scaling: str | None = None, rope_factor: float | None = None,
                yarn_orig_ctx: int | None = None, max_context: int | None = None) -> ModelConfig:
    """The model's config from the GGUF's metadata; the rope arguments, when given, override the
    file's rope scaling (``_rope_scaling``), and ``max_context`` the context limit that gives."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported architecture {arch!r}; kvstream runs {', '.join(SUPPORTED_ARCHS)}")
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_heads))
    if n_heads % n_kv:
        raise GGUFError(f"head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError("missing tensor 'token_embd.weight'")
    yarn, context = _rope_scaling(reader, arch, rope_scaling, rope_factor, yarn_orig_ctx)
    return ModelConfig(
        arch=arch,
        n_layers=int(_field(reader, f"{arch}.block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn=int(_field(reader, f"{arch}.feed_forward_length")),
        vocab_size=int(vocab or embd.shape[1]),
        rope_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=max_context or context,
        tied_output="output.weight" not in names,
        yarn=yarn,
        context_overridden=max_context is not None,
    )


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> torch shape (rows, cols) that the forward pass needs."""
    q, kv, d = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.hidden
    shapes = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,),
            p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d),
            p + "attn_output.weight": (d, q),
            p + "ffn_gate.weight": (cfg.ffn, d), p + "ffn_up.weight": (cfg.ffn, d), p + "ffn_down.weight": (d, cfg.ffn),
        }
        if cfg.qkv_bias:
            shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)}
    return shapes


SKELETON = "kvstream.skeleton"  # metadata key of a GGUF that has a model's metadata but no weights


def is_skeleton(reader: GGUFReader) -> bool:
    return bool(_field(reader, SKELETON, False))


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random weights of the shapes ``cfg`` needs (matrices scaled by 1/sqrt(fan-in)):
    timing runs at a model's real shapes without its weights (GPU.md)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.randn(shape, generator=g, device=device, dtype=dtype) / (shape[-1] ** 0.5 if len(shape) > 1 else 1)
            for name, shape in expected_tensors(cfg).items()}


def load_weights(reader: GGUFReader, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Dequantize every tensor the model needs (gguf's reference dequantizers) to ``dtype`` on
    ``device``; a skeleton GGUF (``experiments/skeleton_gguf.py``) gets seeded random weights."""
    if is_skeleton(reader):
        return random_weights(cfg, dtype, device)
    by_name = {t.name: t for t in reader.tensors}
    out = {}
    for name, shape in expected_tensors(cfg).items():
        t = by_name.get(name)
        if t is None:
            raise GGUFError(f"missing tensor {name!r} (architecture {cfg.arch}, {cfg.n_layers} layers)")
        if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(f"tensor {name!r} has unsupported type {t.tensor_type.name}; supported: "
                            f"{', '.join(sorted(x.name for x in SUPPORTED_TENSOR_TYPES))}")
        arr = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: F32 tensors are read-only memmaps
        if tuple(arr.shape) != shape:
            raise GGUFError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
        out[name] = torch.from_numpy(arr).to(device=device, dtype=dtype)
    return out
