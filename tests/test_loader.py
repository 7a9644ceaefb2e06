"""GGUF loading: the typed config, and a clear error for each kind of bad file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

from kvstream.model.loader import GGUFError, load_weights, open_gguf, read_config
from kvstream.model.qwen import load_model
from tiny_gguf import TinySpec, write_tiny_model
from tiny_vocab import add_tiny_vocab


def test_config_from_metadata(tmp_path):
    spec = TinySpec(arch="qwen3", hidden=192, n_heads=6, n_kv_heads=1, head_dim=32, ffn=80, n_layers=3,
                    tied=True, rope_base=5e5, context_length=777)
    cfg = read_config(open_gguf(write_tiny_model(tmp_path / "m.gguf", spec)))
    assert (cfg.arch, cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn) == \
           ("qwen3", 3, 192, 6, 1, 32, 80)
    assert (cfg.rope_base, cfg.context_length, cfg.tied_output, cfg.qk_norm, cfg.qkv_bias) == \
           (5e5, 777, True, True, False)
    assert cfg.vocab_size == 357 and cfg.rms_eps == pytest.approx(1e-6)


def test_real_qwen05_config(qwen05_reader):
    cfg = read_config(qwen05_reader)
    assert (cfg.arch, cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
           ("qwen2", 24, 896, 14, 2, 64)


def test_unknown_architecture(tmp_path):
    w = GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    add_tiny_vocab(w)
    w.add_tensor("token_embd.weight", np.ones((357, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match="unsupported architecture 'llama'; kvstream runs qwen2, qwen3"):
        read_config(open_gguf(tmp_path / "llama.gguf"))


def test_missing_tensor(tmp_path):
    drop_v = lambda name, x: None if name == "blk.1.attn_v.weight" else x
    path = write_tiny_model(tmp_path / "m.gguf", tweak=drop_v)
    with pytest.raises(GGUFError, match=r"missing tensor 'blk.1.attn_v.weight'"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path):
    as_int = lambda name, x: (x * 100).astype(np.int32) if name == "blk.0.ffn_up.weight" else x
    path = write_tiny_model(tmp_path / "m.gguf", tweak=as_int)
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_up.weight' has unsupported type I32; supported: .*Q4_K"):
        load_model(path)


def test_wrong_shape(tmp_path):
    short = lambda name, x: x[:-1] if name == "blk.0.attn_k.weight" else x
    path = write_tiny_model(tmp_path / "m.gguf", tweak=short)
    with pytest.raises(GGUFError, match=r"'blk.0.attn_k.weight' has shape \(31, 64\), expected \(32, 64\)"):
        load_model(path)


def test_truncated_file(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    # the gguf reader itself fails on most truncations; open_gguf names the cause either way
    with pytest.raises(GGUFError, match=r"m.gguf: not a readable GGUF file, truncated or corrupt \(\d+ bytes"):
        open_gguf(path)


def test_garbage_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF but not really" * 3)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        open_gguf(tmp_path / "x.gguf")


def test_weights_land_in_dtype_and_device(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", TinySpec(types=(QT.Q8_0, QT.F16)))
    reader = open_gguf(path)
    w = load_weights(reader, read_config(reader), torch.bfloat16, "cpu")
    assert all(t.dtype == torch.bfloat16 for t in w.values())
