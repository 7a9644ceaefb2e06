"""The same model and command on CUDA (skipped without a CUDA device)."""

from __future__ import annotations

import io

import pytest
import torch

from kvstream.cli.generate import run
from kvstream.generate import generate
from kvstream.model import load_model
from kvstream.sampling import Sampler, SamplingParams
from test_cli import cfg_for
from tiny_gguf import TinySpec, write_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = TinySpec(arch="qwen2", hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, n_layers=3)
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "m.gguf", spec)


def test_cuda_logits_match_cpu(tiny):
    cpu, gpu = load_model(tiny, torch.float32, "cpu"), load_model(tiny, torch.float32, "cuda")
    ids = torch.randint(0, cpu.cfg.vocab_size, (40,))
    with torch.inference_mode():
        a = cpu(ids, cpu.new_cache(64), all_logits=True)
        b = gpu(ids.cuda(), gpu.new_cache(64), all_logits=True).cpu()
    # fp32 on both, but cuBLAS may use TF32-free but differently blocked sums: ulps of |logit|
    assert (a - b).abs().max() <= 1e-3 * a.abs().max()


def test_cuda_bf16_greedy_runs_and_is_deterministic(tiny):
    m = load_model(tiny, torch.bfloat16, "cuda")
    runs = [generate(m, m.new_cache(64), [1, 2, 3, 4], 16, Sampler(SamplingParams(), "cuda")).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) <= 16


def test_generate_command_on_cuda(tiny):
    out = io.StringIO()
    run(cfg_for(f"model.source={tiny}", "hardware=h200", "max_new_tokens=8", "sampling.temperature=0.7"), out)
    assert "decode" in out.getvalue().splitlines()[-1]


def test_cuda_streaming_matches_resident(tmp_path):
    """The Triton kernels and the copy stream: one ring round is bit-identical to resident mode."""
    import test_paged_cache as t

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = t.run(m, t.paged(m, "resident"), toks)
    # 6 of 8 pages resident in decode (the measured CUDA prefill slab needs the room 4 would leave)
    one = t.run(m, t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 8), ring=8), toks)
    many = t.run(m, t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 2), ring=2), toks)
    assert torch.equal(one, ref)
    # several rounds: partials merged in another order (fp32 softmax sums)
    assert (many - ref).abs().max() <= 1e-3 * ref.abs().max()
