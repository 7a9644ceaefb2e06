"""YaRN rope scaling: the config and GGUF keys, logits against transformers past the original
context (contiguous and paged caches), and the context limit it sets."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import rope_inv_freq
from kvstream.cache.factory import make_cache
from kvstream.config import ArenaConfig, CacheConfig, ModelSource
from kvstream.eval.perplexity import check_run
from kvstream.model.loader import Yarn, open_gguf, read_config
from kvstream.model.qwen import load_model
from tiny_gguf import TinySpec, write_tiny_model

transformers = pytest.importorskip("transformers")

ORIG, FACTOR, SEQ = 64, 4.0, 200  # positions 64..199 lie past the original context
CASES = {
    "qwen2-hd64": TinySpec(arch="qwen2", hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=96,
                           rope_base=1e6, context_length=ORIG, yarn=(FACTOR, ORIG)),
    # transformers' GGUF loader assumes head_dim 128 for qwen3
    "qwen3-hd128": TinySpec(arch="qwen3", hidden=128, n_heads=2, n_kv_heads=1, head_dim=128, ffn=96,
                            context_length=ORIG, yarn=(FACTOR, ORIG)),
}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    """(ours, transformers' with the same rope_scaling, ours with model.rope_scaling=none)."""
    d, spec = tmp_path_factory.mktemp(request.param), CASES[request.param]
    path = write_tiny_model(d / "m.gguf", spec)
    scaling = {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIG,
               "rope_theta": spec.rope_base}
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file="m.gguf", dtype=torch.float32,
                                                           rope_parameters=scaling).eval()
    return load_model(path), hf, load_model(path, rope_scaling="none")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 357, (SEQ,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def hf_logits(models, ids):
    with torch.inference_mode():
        return models[1](ids[None]).logits[0]


def run(model, cache, ids) -> torch.Tensor:
    """Chunked prefill to position 150 (chunks of 50), then single-token decode steps."""
    with torch.inference_mode():
        got = [model(ids[lo:lo + 50], cache, all_logits=True) for lo in range(0, 150, 50)]
        if hasattr(cache, "set_phase"):
            cache.set_phase("decode")
        got += [model(ids[i:i + 1], cache, all_logits=True) for i in range(150, SEQ)]
    return torch.cat(got)


@pytest.mark.parametrize("d, base", [(64, 1e6), (128, 1e6), (64, 1e4)])
def test_inv_freq_is_transformers_bit_for_bit(d, base):
    cfg = transformers.Qwen2Config(hidden_size=2 * d, num_attention_heads=2, head_dim=d, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": base})
    ref, ref_scale = transformers.modeling_rope_utils._compute_yarn_parameters(cfg)
    inv_freq, scale = rope_inv_freq(d, base, factor=4.0, orig_ctx=32768)
    assert torch.equal(inv_freq, ref) and scale == ref_scale


def test_logits_match_transformers_past_the_original_context(models, ids, hf_logits):
    ours, _, plain = models
    assert ours.cfg.yarn == Yarn(FACTOR, ORIG) and ours.cfg.context_length == FACTOR * ORIG
    got = run(ours, ours.new_cache(SEQ), ids)
    # Same dequantized fp32 weights, inv_freq and cos/sin scale bit for bit on both sides; only the
    # summation order differs (SDPA vs HF's eager attention, matmul blocking): fp32 ulps of |logit|.
    err = (got - hf_logits).abs().max().item()
    print(f"YaRN fp32, contiguous cache: max |dlogit| vs transformers {err:.3g}")
    assert err <= 1e-5 * max(1.0, hf_logits.abs().max().item()), err
    # and YaRN is really on: the unscaled model is far from transformers' YaRN model
    assert (run(plain, plain.new_cache(SEQ), ids) - hf_logits).abs().max() > 1000 * err


def test_logits_through_a_resident_paged_cache(models, ids, hf_logits):
    ours = models[0]
    cache = make_cache(CacheConfig(mode="resident", type_k="f16", type_v="f16"), ArenaConfig(), ours, SEQ, 50,
                       all_logits=True)
    err = (run(ours, cache, ids) - hf_logits).abs().max().item()
    print(f"YaRN fp32, resident f16 pages: max |dlogit| vs transformers {err:.3g}")
    # K and V are stored as f16 (relative rounding 2^-11 ~ 5e-4 per element): through two layers
    # that moves logits of |logit| ~ 4 by ~1e-3 (measured 0.9e-3)
    assert err <= 5e-3, err


def test_gguf_keys_and_overrides(tmp_path):
    yarn_file = read_config(open_gguf(write_tiny_model(tmp_path / "y.gguf", CASES["qwen2-hd64"])),
                            rope_factor=2.0)
    assert yarn_file.yarn == Yarn(2.0, ORIG) and yarn_file.context_length == 128  # the factor overridden
    reader = open_gguf(write_tiny_model(tmp_path / "p.gguf", TinySpec(context_length=512)))
    assert read_config(reader).yarn is None and read_config(reader).context_length == 512
    cfg = read_config(reader, rope_scaling="yarn", rope_factor=4.0)  # the original context: context_length
    assert cfg.yarn == Yarn(4.0, 512) and cfg.context_length == 2048
    assert read_config(reader, rope_scaling="yarn", rope_factor=4.0, yarn_orig_ctx=100).context_length == 400
    past = read_config(reader, rope_scaling="none", max_context=2048)  # plain rope past its 512, on purpose
    assert past.yarn is None and past.context_length == 2048 and past.context_limit == "2048 tokens (model.max_context)"
    with pytest.raises(ValueError, match="has no qwen2.rope.scaling.factor: give model.rope_factor"):
        read_config(reader, rope_scaling="yarn")
    with pytest.raises(ValueError, match="model.rope_factor=4.0 .* add model.rope_scaling=yarn"):
        read_config(reader, rope_factor=4.0)


@pytest.mark.parametrize("kw, message", [
    (dict(rope_factor=0.5), r"model.rope_factor=0.5: give a factor >= 1"),
    (dict(rope_scaling="linear"), r"model.rope_scaling='linear'; choose one of none, yarn"),
    (dict(yarn_orig_ctx=0), r"model.yarn_orig_ctx=0: give the model's original context in tokens"),
    (dict(rope_scaling="none", rope_factor=4.0), r"model.rope_factor=4.0 .* not to model.rope_scaling=none"),
    (dict(max_context=0), r"model.max_context=0: give a context in tokens, >= 1, or null"),
])
def test_config_is_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        ModelSource(**kw)


def test_context_beyond_factor_times_original_is_an_error(models):
    ours, _, plain = models
    limit = r"256 tokens \(YaRN: factor 4 x original 64\)"
    with pytest.raises(ValueError, match=rf"context of 257 tokens .* exceeds the model's {limit}"):
        make_cache(CacheConfig(), ArenaConfig(), ours, 257, 50)
    with pytest.raises(ValueError, match=rf"ctx=257 exceeds the model's context length of {limit}"):
        check_run(torch.zeros(1, 257, dtype=torch.long), ours.cfg)
    with pytest.raises(ValueError, match=r"context of 65 tokens .* 64 tokens \(model.rope_scaling=yarn extends it\)"):
        make_cache(CacheConfig(), ArenaConfig(), plain, 65, 50)


def test_a_draft_follows_the_targets_rope_overrides(tmp_path):
    """A draft reads the target's positions: with model.rope_scaling=yarn its host weights load
    with the same YaRN (no override: the draft's own GGUF's rope)."""
    from kvstream.engine.runner import DraftHosts
    from kvstream.model.tokenizer import Tokenizer

    path = write_tiny_model(tmp_path / "d.gguf", TinySpec(context_length=512))
    tok, hosts = Tokenizer.from_gguf(open_gguf(path)), DraftHosts()
    rope = dict(rope_scaling="yarn", rope_factor=4.0, yarn_orig_ctx=None)
    yarn = hosts.get_host(str(path), tok, torch.float32, "cpu", rope)
    plain = hosts.get_host(str(path), tok, torch.float32, "cpu", dict(rope_scaling=None, rope_factor=None,
                                                                       yarn_orig_ctx=None))
    assert yarn.cfg.yarn == Yarn(4.0, 512) and yarn.cfg.context_length == 2048
    assert plain.cfg.yarn is None and plain.cfg.context_length == 512 and len(hosts) == 2
