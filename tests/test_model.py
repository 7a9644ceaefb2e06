"""The torch forward pass against HF transformers loading the same GGUF."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kvstream.engine.generate import generate, prefill
from kvstream.model.qwen import load_model
from kvstream.model.sampling import Sampler, SamplingParams
from tiny_gguf import TinySpec, write_tiny_model

transformers = pytest.importorskip("transformers")

CASES = {
    "qwen2-f32-gqa2": TinySpec(arch="qwen2", hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96),
    "qwen2-hd64-gqa7-tied-q8q4f16": TinySpec(arch="qwen2", hidden=448, n_heads=7, n_kv_heads=1, head_dim=64,
                                             ffn=128, tied=True, types=(QT.Q8_0, QT.Q4_0, QT.F16)),
    "qwen2-hd64-gqa1-kquants": TinySpec(arch="qwen2", hidden=256, n_heads=4, n_kv_heads=4, head_dim=64,
                                        ffn=512, types=(QT.Q4_K, QT.Q6_K, QT.Q8_0)),
    # transformers' GGUF loader assumes head_dim 128 for qwen3; hidden != heads x head_dim on purpose
    "qwen3-hd128-kquants": TinySpec(arch="qwen3", hidden=256, n_heads=4, n_kv_heads=2, head_dim=128,
                                    ffn=512, types=(QT.Q6_K, QT.Q4_K, QT.F16)),
    "qwen3-hd128-gqa1-tied": TinySpec(arch="qwen3", hidden=192, n_heads=2, n_kv_heads=2, head_dim=128,
                                      ffn=256, tied=True, types=(QT.Q8_0, QT.F32)),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    path = write_tiny_model(d / "m.gguf", CASES[request.param])
    ours = load_model(path, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=torch.float32).eval()
    return ours, hf


def test_logits_match_transformers(pair):
    ours, hf = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (27,))
    cache = ours.new_cache(64)
    with torch.inference_mode():
        # chunked prefill (chunks of 7, last one partial), then single-token decode steps
        got = [ours(ids[lo:lo + 7], cache, all_logits=True) for lo in range(0, 21, 7)]
        got += [ours(ids[i:i + 1], cache, all_logits=True) for i in range(21, 27)]
        got = torch.cat(got)
        ref = hf(ids[None]).logits[0]
    # Same dequantized fp32 weights on both sides; only the summation order differs (SDPA vs HF's
    # eager attention, matmul blocking for different row counts): a few fp32 ulps of |logit| ~ 10.
    err = (got - ref).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item()), err


def test_greedy_32_tokens_match_transformers(pair):
    ours, hf = pair
    prompt = torch.randint(0, ours.cfg.vocab_size, (9,)).tolist()
    out = generate(ours, ours.new_cache(64), prompt, 32, Sampler(SamplingParams(temperature=0)), prefill_chunk=4)
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(32):  # independent reference: full recomputation, no cache
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out.tokens == seq[len(prompt):]


def test_cache_overflow_is_a_clear_error(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="exceeds the cache's 8"):
        prefill(ours, ours.new_cache(8), list(range(9)), chunk=4)


@pytest.mark.real_model
def test_real_qwen05_greedy_64_matches_transformers(qwen05_path, qwen05_reader):
    ours = load_model(qwen05_reader, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        qwen05_path.parent, gguf_file=qwen05_path.name, dtype=torch.float32).eval()
    from kvstream.model.tokenizer import Tokenizer

    prompt = Tokenizer.from_gguf(qwen05_reader).encode("def quicksort(a):\n    \"\"\"Sort a list of numbers.\"\"\"\n")
    mine = generate(ours, ours.new_cache(len(prompt) + 64), prompt, 64, Sampler(SamplingParams(temperature=0)),
                    keep_logits=True)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ref_tokens = ref.sequences[0, len(prompt):].tolist()
    n = min(len(mine.logits), len(ref.logits))
    dmax = max((a - b[0]).abs().max().item() for a, b in zip(mine.logits[:n], ref.logits[:n]))
    print(f"real 0.5B fp32: greedy {len(mine.tokens)} tokens, max |dlogit| vs transformers = {dmax:.3g}")
    assert mine.tokens == ref_tokens[:len(mine.tokens)] and len(mine.tokens) == 64
    # fp32 both sides, same dequantized weights; HF's cache path sums in another order
    assert dmax < 1e-3
