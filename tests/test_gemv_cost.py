"""experiments/gemv_cost.py on CPU with a tiny GGUF: there ``model.gemv`` changes nothing, so the
two arms must agree exactly, and the greedy tokens must equal transformers'; bad input is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments import gemv_cost
from tiny_gguf import TinySpec, write_tiny_model

# paged pages need head_dim 64 or 128; transformers' qwen2 GGUF loader takes head_dim = hidden / heads
SPEC = TinySpec(arch="qwen2", hidden=128, n_heads=2, n_kv_heads=1, head_dim=64, ffn=128, n_layers=2,
                context_length=1024)
SMALL = ["--device", "cpu", "--dtype", "float32", "--prompt-tokens", "64", "--tokens", "8", "--new-tokens", "8"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gemv_cost") / "m.gguf", SPEC)


def quality(tiny, out: Path, *more: str) -> pd.Series:
    gemv_cost.main(["--model", str(tiny), *SMALL, "--out", str(out), *more])
    df = pd.read_csv(out / "quality.csv")
    assert len(df) == 1
    return df.iloc[0]


def test_cpu_arms_are_identical(tiny, tmp_path):
    row = quality(tiny, tmp_path)  # default cache: paged, q8_0 K / q4_0 V
    assert (row.cache, row.type_k, row.type_v, row.prompt_tokens, row.tokens) == ("resident", "q8_0", "q4_0", 64, 8)
    # the same code runs in both arms on CPU: exact, no tolerance
    assert row.kld_mean == 0 and row.kld_max == 0
    assert row.identical_logits == 1.0 and row.same_top1 == 1.0
    assert row.ppl_on == row.ppl_off and row.ppl_ratio == 1.0 and 1 < row.ppl_off < float("inf")
    assert pd.isna(row.first_diff_on_off) and pd.isna(row.first_diff_off_hf) and pd.isna(row.first_diff_on_hf)
    assert row.command.startswith("python") and isinstance(row.commit, str)


def test_verify_batch_passes(tiny, tmp_path):
    """``--width 3``: the 8 forced tokens in passes of 3, 3 and 2 rows (a verify batch's shape), every
    row's logits compared (on CPU both arms still run one code: exact)."""
    row = quality(tiny, tmp_path, "--width", "3")
    assert row.width == 3 and row.kld_max == 0 and row.identical_logits == 1.0 and 1 < row.ppl_off < float("inf")


def test_int8_decode_rows_against_the_same_blocks_multiplied_exactly(tiny, tmp_path):
    """``--weights q8_0_int8``: on the CPU the gemv arm's decode rows run the int8 kernel's arithmetic
    (x rounded through q8_0 blocks), the other arm multiplies the same blocks exactly: the logits differ,
    a little (x's rounding is ~1/254 of its blocks' largest value). Verify-width passes (3 rows) never take
    the int8 path: exact there."""
    row = quality(tiny, tmp_path, "--weights", "q8_0_int8")
    assert (row.weights_off, row.weights_on) == ("q8_0", "q8_0_int8")
    assert 0 < row.kld_mean < 0.01 and row.identical_logits == 0.0 and 1 < row.ppl_on < float("inf")
    wide = quality(tiny, tmp_path, "--weights", "q8_0_int8", "--width", "3")
    assert wide.kld_max == 0 and wide.identical_logits == 1.0


def test_greedy_matches_transformers(tiny, tmp_path):
    pytest.importorskip("transformers")
    # dense fp32 KV (a quantized cache differs from transformers' by itself); same dequantized fp32
    # weights, only the summation order differs: a tiny model's argmax is far from ties over 8 tokens
    row = quality(tiny, tmp_path, "--cache", "contiguous", "--transformers")
    assert pd.isna(row.type_k) and bool(row.transformers)
    assert pd.isna(row.first_diff_off_hf) and pd.isna(row.first_diff_on_hf) and pd.isna(row.first_diff_on_off)


BAD = [  # (arguments, what the one line says)
    (["--model", "/nowhere/m.gguf"], "neither a registered name"),
    (["--tokens", "0"], "--tokens=0: give a number of tokens >= 1"),
    (["--new-tokens", "-2"], "--new-tokens=-2: give a number of tokens >= 1"),
    (["--prompt-tokens", "1000", "--tokens", "100"], "exceed the model's context of 1024"),
    (["--cache", "dense"], "cache.mode='dense'; choose one of"),
    (["--width", "17"], "--width=17: a decode pass of 1 to 16 tokens"),
]


@pytest.mark.parametrize("args,says", BAD)
def test_bad_input_is_one_line(tiny, tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as e:
        gemv_cost.main(["--model", str(tiny), "--out", str(tmp_path / "out"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("gemv_cost: error: ") and says in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_cuda_asked_for_but_absent_through_the_entry_point(tiny, tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "experiments.gemv_cost", "--model", str(tiny), "--device", "cuda"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stdout + p.stderr
    assert p.returncode == 2 and p.stderr.strip() == (
        "gemv_cost: error: --device cuda, but this torch build sees no CUDA device: use --device cpu")
    assert list(tmp_path.iterdir()) == []
