"""The perplexity / KL-divergence tool against plain full-forward computations on tiny GGUFs."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module

from kvstream.cli.ppl import PplConfig, run
from kvstream.config import to_typed
from kvstream.model.qwen import load_model
from kvstream.eval.perplexity import LogprobFile, LogprobFileError, perplexity, split_chunks, stdlib_text
from tiny_gguf import TinySpec, write_tiny_model

# head_dim 64 (what the paged kernels support), GQA 2
SPEC = TinySpec(hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn=128, context_length=256)
CTX = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl")
    return write_tiny_model(d / "a.gguf", SPEC), write_tiny_model(d / "b.gguf", TinySpec(**{**SPEC.__dict__, "seed": 1}))


@pytest.fixture(scope="module")
def models(files):
    return load_model(files[0]), load_model(files[1])


@pytest.fixture(scope="module")
def chunks(models):
    vocab = models[0].cfg.vocab_size
    tokens = torch.randint(0, vocab, (3 * CTX + 5,), generator=torch.Generator().manual_seed(1)).tolist()
    return split_chunks(tokens, CTX)


def full_logprobs(model, chunks: torch.Tensor) -> torch.Tensor:
    """fp64 log-softmax of one plain full forward per chunk, scored rows only: [n, ctx/2 - 1, vocab]."""
    ctx = chunks.shape[1]
    with torch.inference_mode():
        out = [model(c, model.new_cache(ctx), all_logits=True)[ctx // 2:ctx - 1] for c in chunks]
    return torch.log_softmax(torch.stack(out).double(), dim=-1)


def nll_of(lp: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    ctx = chunks.shape[1]
    return -lp.gather(2, chunks[:, ctx // 2 + 1:, None])[..., 0].flatten()


@pytest.mark.parametrize("batch", [CTX, 7])
def test_ppl_is_exp_mean_nll_of_a_plain_forward(models, chunks, batch):
    model = models[0]
    sizes = []
    make_cache = lambda n: sizes.append(n) or model.new_cache(n)
    res = perplexity(model, chunks, batch=batch, make_cache=make_cache, progress=False)
    assert sizes == [CTX] * 3  # a fresh cache per chunk
    nll = nll_of(full_logprobs(model, chunks), chunks).numpy()
    assert res.stats["n_scored"] == len(nll) == 3 * (CTX // 2 - 1)
    # the tool's log_softmax is fp32, the reference's fp64: ~1e-7 on each NLL (|NLL| ~ 6); sub-batches
    # of 7 also change the fp32 matmul / SDPA blocking: ~1e-6 relative on the logits
    tol = 1e-7 if batch == CTX else 1e-5
    assert res.ppl == pytest.approx(math.exp(nll.mean()), rel=tol)
    # the same formula on NLLs that differ by the blocking above (1e-5): the std carries it, 1e-4 covers it
    assert res.stats["ppl_err"] == pytest.approx(res.ppl * nll.std() / math.sqrt(len(nll) - 1), rel=1e-4)


@pytest.mark.parametrize("fmt", ["uint16", "float32"])
def test_compare_against_itself_is_exactly_zero(models, chunks, tmp_path, fmt):
    path = tmp_path / "base.lp"
    base = perplexity(models[0], chunks, batch=CTX, save_logits=path, logits_format=fmt, progress=False)
    assert not (tmp_path / "base.lp.tmp").exists()
    res = perplexity(models[0], chunks, batch=CTX, compare_logits=path, progress=False)
    k = res.stats["kld"]
    assert (res.kld.kld == 0).all() and k["kld_mean"] == k["kld_max"] == 0.0
    assert k["same_top1"] == 1.0 and k["ppl_base"] == base.ppl and k["ppl_ratio"] == 1.0
    # another batch changes the fp32 blocking (last bits of the log-probs): the codec's floor
    res = perplexity(models[0], chunks, batch=16, compare_logits=path, progress=False)
    assert abs(res.kld.kld).max() < 1e-8 and res.stats["kld"]["same_top1"] == 1.0


@pytest.mark.parametrize("fmt", ["uint16", "float32"])
@pytest.mark.parametrize("other", ["seed1", "bf16"])
def test_kld_against_another_model_matches_an_independent_computation(files, models, chunks, tmp_path, fmt, other):
    path = tmp_path / "base.lp"
    perplexity(models[0], chunks, batch=CTX, save_logits=path, logits_format=fmt, progress=False)
    q = models[1] if other == "seed1" else load_model(files[0], torch.bfloat16)
    res = perplexity(q, chunks, batch=CTX, compare_logits=path, progress=False)
    lb, lq = full_logprobs(models[0], chunks), full_logprobs(q, chunks)
    kld = (lb.exp() * (lb - lq)).sum(-1).flatten().numpy()
    top1 = (lb.argmax(-1) == lq.argmax(-1)).flatten().numpy()
    k = res.stats["kld"]
    assert kld.mean() > (0.1 if other == "seed1" else 1e-6) and k["kld_mean"] > 0
    # float32 files hold the fp32 log-probs, the reference takes fp64 log_softmax of the fp32 logits:
    # fp32 rounding of |lp| ~ 6 is ~4e-7, against lp differences of ~3e-3 (bf16): ~1e-5 relative.
    # uint16 files round lp to 4.9e-4 on both sides: a second-order error ~(4.9e-4)^2/12 = 2e-8.
    atol = 1e-9 if fmt == "float32" else 2e-7
    np.testing.assert_allclose(res.kld.kld, kld, rtol=1e-4, atol=atol)
    assert k["kld_mean"] == pytest.approx(kld.mean(), rel=1e-4, abs=atol / 10)
    assert k["kld_max"] == pytest.approx(kld.max(), rel=1e-4, abs=atol)
    assert k["kld_median"] == pytest.approx(np.median(kld), rel=1e-4, abs=atol)
    if fmt == "float32":  # rounding to uint16 may break near-ties of the argmax
        assert k["same_top1"] == top1.mean()
    nll_b, nll_q = nll_of(lb, chunks).numpy(), nll_of(lq, chunks).numpy()
    # the tool's log-probs and the reference's differ by the rounding above (~1e-5 relative at most):
    # a PPL (exp of their mean) moves by less
    assert k["ppl_base"] == pytest.approx(math.exp(nll_b.mean()), rel=1e-5)
    assert k["ppl_ratio"] == pytest.approx(math.exp(nll_q.mean() - nll_b.mean()), rel=1e-5)


def test_mismatches_are_refused_with_the_numbers(models, chunks, tmp_path):
    path = tmp_path / "base.lp"
    perplexity(models[0], chunks[:2], batch=CTX, save_logits=path, progress=False)
    m = models[0]
    with pytest.raises(LogprobFileError, match=r"ctx=64, this run has ctx=32: use ctx=64"):
        perplexity(m, chunks.view(-1, 32), compare_logits=path, progress=False)
    with pytest.raises(LogprobFileError, match=r"this run has 3 chunks, .* holds 2: use n_chunks<=2"):
        perplexity(m, chunks, compare_logits=path, progress=False)
    other = chunks[:2].clone()
    other[1, 5] = (other[1, 5] + 1) % m.cfg.vocab_size
    with pytest.raises(LogprobFileError, match=r"1 of 128 differ, the first at chunk 1, position 5 \(base id \d+"):
        perplexity(m, other, compare_logits=path, progress=False)
    perplexity(m, chunks[:1], compare_logits=path, progress=False)  # a prefix of the base is fine
    bad = tmp_path / "cut.lp"
    bad.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(LogprobFileError, match=r"bytes, but its header .* needs \d+: truncated"):
        perplexity(m, chunks[:2], compare_logits=bad, progress=False)
    bad.write_bytes(b"hello")
    with pytest.raises(LogprobFileError, match="not a kvstream log-prob file"):
        LogprobFile(bad)
    with pytest.raises(ValueError, match="exclusive"):
        perplexity(m, chunks, save_logits=tmp_path / "x", compare_logits=path, progress=False)


def test_text_and_context_errors(models):
    with pytest.raises(ValueError, match=r"the text has 50 tokens; one chunk needs ctx=64"):
        split_chunks(list(range(50)), 64)
    with pytest.raises(ValueError, match=r"n_chunks=4, but the text's 200 tokens hold 3 chunk\(s\) of ctx=64"):
        split_chunks(list(range(200)), 64, 4)
    with pytest.raises(ValueError, match=r"ctx=512 exceeds the model's context length of 256 tokens"):
        perplexity(models[0], split_chunks(list(range(600)), 512), progress=False)
    assert split_chunks(list(range(10, 140)), 64, bos_id=3)[:, 0].tolist() == [3, 3]


def test_builtin_text_is_stdlib_source():
    text = stdlib_text()
    assert text == stdlib_text() and len(text) > 100_000 and "def dedent(text):" in text


def cfg_for(*overrides: str) -> PplConfig:
    with initialize_config_module("conf", version_base=None):
        return to_typed(compose("ppl", overrides=list(overrides)), PplConfig)


def test_run_saves_compares_and_writes_json(files, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(stdlib_text()[1000:20_000])
    lp, js = tmp_path / "b.lp", tmp_path / "out.jsonl"
    common = [f"text_file={text}", "ctx=64", "progress=false", f"out_json={js}"]
    out = io.StringIO()
    base = run(cfg_for(f"model.source={files[0]}", "n_chunks=3", f"save_logits={lp}", *common), out)
    assert f"PPL         {base['ppl']:.4f} +/- " in out.getvalue() and "saved" in out.getvalue()
    out = io.StringIO()
    row = run(cfg_for(f"model.source={files[1]}", f"compare_logits={lp}", *common), out)  # n_chunks: the base's
    assert row["n_chunks"] == 3 and row["kld"]["ppl_base"] == pytest.approx(base["ppl"], rel=1e-6)
    for label in ("KLD mean", "KLD 99.9%", "KLD median", "same top-1", "PPL/base"):
        assert label in out.getvalue()
    rows = [json.loads(x) for x in js.read_text().splitlines()]
    assert [r["ppl"] for r in rows] == [base["ppl"], row["ppl"]] and rows[1]["config"]["compare_logits"] == str(lp)
    with pytest.raises(LogprobFileError, match=r"tokens differ .* 0, position 0 .* computed on text '.*t.txt'"):
        run(cfg_for(f"model.source={files[0]}", f"compare_logits={lp}", "ctx=64", "progress=false"), io.StringIO())


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_config_composes(model):
    cfg = cfg_for(f"model={model}")
    assert cfg.model.source == model and cfg.ctx == 512 and cfg.n_chunks is None and cfg.logits_format == "uint16"


def test_typed_config_rejects_bad_values(tmp_path):
    with pytest.raises(Exception, match="ctx must be >= 3"):
        cfg_for("ctx=2")
    with pytest.raises(Exception, match="logits_format='int8'"):
        cfg_for("logits_format=int8")
    with pytest.raises(Exception, match="exclusive"):
        cfg_for("save_logits=a", "compare_logits=b")
    with pytest.raises(FileNotFoundError, match="text_file=.*nope.txt: no such file"):
        run(cfg_for(f"text_file={tmp_path / 'nope.txt'}"), io.StringIO())


def test_command_line(files):
    r = subprocess.run([sys.executable, "-m", "kvstream.cli.ppl", f"model.source={files[0]}", "ctx=64", "n_chunks=2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "chunks      2 x 64 tokens" in r.stdout and "PPL " in r.stdout and "stdlib:" in r.stdout
    assert "ppl: 100%" in r.stderr  # the progress bar


def test_quantized_and_streamed_caches_against_the_contiguous_base(tmp_path):
    """The quantization cost (q8_0/q4_0 vs the dense cache) is a small KLD; streaming with one
    ring round reads the same bytes as resident mode, so its KLD against resident is exactly 0."""
    from kvstream.cache.factory import reserve_slab
    from kvstream.cache.arena import ArenaPlan
    from test_paged_cache import SPEC, pair_bytes

    path = write_tiny_model(tmp_path / "long.gguf", SPEC)  # head_dim 64, 4096-token context
    common = ["ctx=600", "batch=100", "n_chunks=2", "progress=false", f"model.source={path}"]
    base, res = tmp_path / "dense.lp", tmp_path / "resident.lp"
    run(cfg_for(*common, f"save_logits={base}"), io.StringIO())
    quant = run(cfg_for(*common, "cache=resident", f"compare_logits={base}"), io.StringIO())
    assert 0 < quant["kld"]["kld_mean"] < 0.05  # 8-bit K / 4-bit V on a random tiny model: small, not zero
    run(cfg_for(*common, "cache=resident", f"save_logits={res}", "logits_format=float32"), io.StringIO())
    # an arena for 2 of a chunk's 3 pages per layer: the oldest page streams through the ring
    model = load_model(path)
    mib = ArenaPlan(reserve_slab(model, 100), 8, pair_bytes()).mib(SPEC.n_layers * 2)
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    ring8 = CacheConfig(mode="stream", ring_pages="8")
    assert make_cache(ring8, ArenaConfig(mib=str(mib)), model, 600, 100).capacity == 2
    stream = run(cfg_for(*common, "cache=stream", "cache.ring_pages=8", f"arena.mib={mib}", f"compare_logits={res}"),
                 io.StringIO())
    assert stream["kld"]["kld_mean"] == 0.0 and stream["kld"]["same_top1"] == 1.0
