"""An MTP head as a GGUF of its own, and the loader that refuses a head made for another target.

Architecture ``kvstream-mtp``. Tensors (llama.cpp's NextN / MTP names for the head's own parts,
its usual block names for the one decoder block; torch shapes as [rows, cols]):

    blk.0.nextn.eh_proj.weight   [d, 2d]   input columns: [enorm(embed(token)); hnorm(h)]
    blk.0.nextn.enorm.weight     [d]       norm of the token embedding
    blk.0.nextn.hnorm.weight     [d]       norm of the target's pre-norm hidden state
    blk.0.attn_norm.weight       [d]
    blk.0.attn_{q,k,v}.weight    [H*D | KVH*D, d], blk.0.attn_{q,k,v}.bias
    blk.0.attn_output.weight     [d, H*D]
    blk.0.ffn_norm.weight        [d]
    blk.0.ffn_{gate,up}.weight   [ffn, d], blk.0.ffn_down.weight [d, ffn]
    nextn.d2t                    [N] int32  draft-vocabulary row -> target token id (only when truncated)
    blk.0.nextn.fc.weight        [d, F*d]  fuses the F target streams it reads (F > 1, EAGLE-3)

The embedding, final norm and LM head are not stored: they are the target's. Metadata
(``kvstream-mtp.``): ``target_sha256``, ``vocab_size``, ``embedding_length``, ``head_count``,
``head_count_kv``, ``key_length``, ``feed_forward_length``, ``draft_vocab_size`` (0: the full
vocabulary), ``feature_layers`` (the target blocks whose entering residual streams it reads,
``Qwen.body``'s ``hidden``; absent in older heads: the last block's output), and what the
training app records as ``train.*``: ``command``, ``corpus``, ``tokens_seen``, ``steps``, ``seed``. Norms and biases are stored F32, matrices in ``out_type``
(f32 | f16 | bf16). (An empty string is written as "-": gguf's writer drops empty strings.)
"""

from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, dequantize, quantize

from kvstream.model.loader import GGUFError, open_gguf
from kvstream.model.mtp import MTPHead
from kvstream.model.qwen import Qwen
from kvstream.model.registry import sha256_file

ARCH = "kvstream-mtp"
OUT_TYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16}


class HeadMismatch(ValueError):
    """A head trained for another target model or vocabulary."""


def head_tensors(head: MTPHead) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> float32 CPU tensor (the fused q/k/v and gate/up split back apart)."""
    c, p = head.cfg, "blk.0."
    split = [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]
    t = {p + "nextn.eh_proj.weight": head.eh_proj, p + "nextn.enorm.weight": head.enorm,
         p + "nextn.hnorm.weight": head.hnorm, p + "attn_norm.weight": head.attn_norm,
         p + "attn_output.weight": head.wo, p + "ffn_norm.weight": head.ffn_norm, p + "ffn_down.weight": head.w_down}
    t |= {p + f"attn_{n}.weight": w for n, w in zip("qkv", head.wqkv.split(split))}
    t |= {p + f"attn_{n}.bias": b for n, b in zip("qkv", head.bqkv.split(split))}
    t |= {p + "ffn_gate.weight": head.w_gate_up[:head.ffn], p + "ffn_up.weight": head.w_gate_up[head.ffn:]}
    if head.fc is not None:
        t[p + "nextn.fc.weight"] = head.fc
    return {name: w.detach().float().cpu() for name, w in t.items()}


def write_head(path: str | os.PathLike, head: MTPHead, target_sha256: str, train: dict[str, int | str],
               out_type: str = "f16") -> str:
    """Write ``head`` to ``path`` with ``train`` as its ``train.*`` keys (ints as uint64, the rest as
    strings); returns the file's sha256."""
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type={out_type!r}; choose one of {', '.join(OUT_TYPES)}")
    c, k = head.cfg, ARCH + "."
    w = GGUFWriter(os.fspath(path), ARCH)
    for key, val in (("vocab_size", c.vocab_size), ("embedding_length", c.hidden), ("head_count", c.n_heads),
                     ("head_count_kv", c.n_kv_heads), ("key_length", c.head_dim), ("feed_forward_length", head.ffn),
                     ("draft_vocab_size", 0 if head.d2t is None else head.draft_vocab)):
        w.add_uint32(k + key, val)
    w.add_string(k + "target_sha256", target_sha256)
    w.add_array(k + "feature_layers", list(head.features))
    for key, val in train.items():
        w.add_uint64(k + "train." + key, val) if isinstance(val, int) else w.add_string(k + "train." + key, str(val) or "-")
    for name, t in head_tensors(head).items():
        a, qt = t.numpy(), OUT_TYPES[out_type] if t.dim() == 2 else QT.F32
        w.add_tensor(name, a) if qt == QT.F32 else w.add_tensor(name, quantize(a, qt), raw_dtype=qt)
    if head.d2t is not None:
        w.add_tensor("nextn.d2t", head.d2t.cpu().numpy().astype(np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sha256_file(path)


def read_metadata(reader) -> dict:
    """The ``kvstream-mtp.*`` keys, without the prefix."""
    return {key[len(ARCH) + 1:]: f.contents() for key, f in reader.fields.items() if key.startswith(ARCH + ".")}


def load_head(path: str | os.PathLike, target: Qwen, target_sha256: str,
              dtype: torch.dtype | None = None) -> tuple[MTPHead, dict]:
    """The head stored at ``path`` on ``target`` (on its device, in ``dtype``, default the target's),
    and its metadata. Refuses a head whose vocabulary or target sha256 differs from ``target``'s."""
    reader = open_gguf(path)
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch != ARCH:
        raise GGUFError(f"{path}: general.architecture is {arch!r}, not an MTP head ({ARCH!r})")
    meta = read_metadata(reader)
    if meta["vocab_size"] != target.cfg.vocab_size:
        raise HeadMismatch(f"{path}: the head was trained for a vocabulary of {meta['vocab_size']} tokens, "
                           f"the target has {target.cfg.vocab_size}")
    if meta["target_sha256"] != target_sha256:
        raise HeadMismatch(f"{path}: the head was trained for the target with sha256 {meta['target_sha256']}, "
                           f"the given target's sha256 is {target_sha256}")
    by_name = {t.name: t for t in reader.tensors}
    d2t = torch.from_numpy(np.array(by_name["nextn.d2t"].data)) if "nextn.d2t" in by_name else None
    taps = meta.get("feature_layers")  # absent in heads written before it: the last block's output
    head = MTPHead(target, meta["feed_forward_length"], d2t, features=None if taps is None else tuple(int(i) for i in taps))
    missing = [name for name in head_tensors(head) if name not in by_name]
    if missing:
        raise GGUFError(f"{path}: the head's tensors {missing} are missing (feature_layers {taps})")
    stored = {name: torch.from_numpy(np.array(dequantize(by_name[name].data, by_name[name].tensor_type),
                                              dtype=np.float32)) for name in head_tensors(head)}
    p = "blk.0."
    state = {"eh_proj": stored[p + "nextn.eh_proj.weight"], "enorm": stored[p + "nextn.enorm.weight"],
             "hnorm": stored[p + "nextn.hnorm.weight"], "attn_norm": stored[p + "attn_norm.weight"],
             "wqkv": torch.cat([stored[p + f"attn_{n}.weight"] for n in "qkv"]),
             "bqkv": torch.cat([stored[p + f"attn_{n}.bias"] for n in "qkv"]),
             "wo": stored[p + "attn_output.weight"], "ffn_norm": stored[p + "ffn_norm.weight"],
             "w_gate_up": torch.cat([stored[p + "ffn_gate.weight"], stored[p + "ffn_up.weight"]]),
             "w_down": stored[p + "ffn_down.weight"]}
    if head.fc is not None:
        state["fc"] = stored[p + "nextn.fc.weight"]
    head.load_state_dict(state)
    return head.to(device=target.device, dtype=dtype or target.dtype), meta
