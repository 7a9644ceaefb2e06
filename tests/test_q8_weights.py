"""model.weights=q8_0: the matrices in q8_0 blocks, against the same model with those blocks
dequantized into dense fp32 weights. Both sides dequantize with ``reference.q8_dense`` (the codec
is checked against gguf in tests/kernels/test_q8_linear.py): these tests check the wiring, i.e.
which tensors are quantized, the embedding lookup, ties, map_tensors and the MTP head."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kernels import reference
from kvstream.model.loader import load_weights, open_gguf, read_config
from kvstream.model.mtp import MTPHead
from kvstream.model.qwen import Qwen, load_model
from kvstream.model.weights import MATRICES, Q8
from kvstream.engine.generate import generate
from kvstream.model.sampling import Sampler, SamplingParams
from tiny_gguf import TinySpec, write_tiny_model

SPECS = {"untied": TinySpec(arch="qwen2", hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96),
         "tied-qwen3": TinySpec(arch="qwen3", hidden=128, n_heads=2, n_kv_heads=1, head_dim=64, ffn=160, tied=True,
                                types=(QT.Q8_0, QT.F32))}


@pytest.fixture(scope="module", params=list(SPECS))
def models(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param) / "m.gguf", SPECS[request.param])
    q8 = load_model(path, torch.float32, "cpu", weights="q8_0")
    reader = open_gguf(path)
    dense = Qwen(read_config(reader), load_weights(reader, read_config(reader), torch.float32, "cpu"))
    # the reference: every matrix replaced by its q8_0 blocks' exact fp32 values
    deq = {n[:-2]: reference.q8_dense(t, q8.tensors()[n[:-2] + ".d"]) for n, t in q8.tensors().items() if n.endswith(".q")}
    return q8, dense.map_tensors(lambda n, t: deq.get(n, t)), path


def test_only_the_matrices_are_quantized_and_a_tied_head_once(models):
    q8, dense, _ = models
    names = set(q8.tensors())
    assert all(n.rsplit(".", 1)[0].split(".")[-1] in MATRICES for n in names if n.endswith((".q", ".d")))
    for L in q8.layers:
        assert all(isinstance(getattr(L, m), Q8) for m in MATRICES if hasattr(L, m))
        assert all(t.dtype == torch.float32 for t in (L.attn_norm, L.ffn_norm, L.bqkv, L.q_norm, L.k_norm) if t is not None)
    assert isinstance(q8.embed, Q8) and isinstance(q8.lm_head, Q8) and q8.out_norm.dtype == q8.dtype == torch.float32
    assert (q8.lm_head is q8.embed) == q8.cfg.tied_output
    # q8_0: 34 bytes per 32 values against fp32's 128; norms and biases unchanged
    ratio = q8.nbytes / dense.nbytes
    assert 34 / 128 < ratio < 0.3, ratio


def test_logits_equal_the_dequantized_dense_model(models):
    q8, dense, _ = models
    ids = torch.randint(0, q8.cfg.vocab_size, (13,))
    with torch.inference_mode():
        a = torch.cat([q8(ids[:9], c := q8.new_cache(32), all_logits=True), q8(ids[9:], c, all_logits=True)])
        b = torch.cat([dense(ids[:9], c := dense.new_cache(32), all_logits=True), dense(ids[9:], c, all_logits=True)])
    # the same fp32 weights and the same ops; the embedding dequantizes rows the same way: equal
    # up to the order of fp32 sums in the reference matmul (x @ W^T of a transposed view)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_greedy_decode_equals_the_dequantized_dense_model(models):
    q8, dense, _ = models
    prompt = torch.randint(0, q8.cfg.vocab_size, (7,)).tolist()
    greedy = Sampler(SamplingParams(temperature=0))
    assert generate(q8, q8.new_cache(48), prompt, 24, greedy).tokens == generate(dense, dense.new_cache(48), prompt, 24, greedy).tokens


def test_map_tensors_rebuilds_q8_weights_from_new_tensors(models):
    q8, _, _ = models
    moved = q8.map_tensors(lambda n, t: t.clone())
    assert isinstance(moved.layers[0].w_down, Q8) and moved.layers[0].w_down.q.data_ptr() != q8.layers[0].w_down.q.data_ptr()
    assert (moved.lm_head is moved.embed) == q8.cfg.tied_output
    ids = torch.tensor([3, 1, 4])
    with torch.inference_mode():
        assert torch.equal(moved(ids, moved.new_cache(8)), q8(ids, q8.new_cache(8)))


def test_an_mtp_head_shares_a_q8_targets_embedding_and_head(models):
    q8, _, _ = models
    if q8.cfg.arch != "qwen2":
        pytest.skip("the MTP head is built for qwen2 targets")
    head = MTPHead(q8, d2t=torch.tensor([0, 5, 2, 7]))
    assert head.shares(q8) and head.embed is q8.embed and head.draft_vocab == 4
    h, tok = torch.randn(3, q8.cfg.hidden), torch.tensor([1, 2, 3])
    from kvstream.model.mtp import REFERENCE
    with torch.no_grad():
        g = head._input(h, tok, REFERENCE)
        logits = head.logits(g)
    dense_rows = reference.q8_dense(q8.lm_head.q, q8.lm_head.d)[[0, 5, 2, 7]]
    ref = torch.nn.functional.linear(reference.rms_norm(g, head.out_norm, q8.cfg.rms_eps), dense_rows)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)  # the gathered rows: the same blocks


def test_dtype_follows_the_norms_through_map_tensors(models):
    q8, dense, _ = models
    assert dense.map_tensors(lambda n, t: t.to(torch.float16)).dtype == torch.float16
    path = models[2]
    half = Qwen(dense.cfg, load_weights(open_gguf(path), dense.cfg, torch.float32, "cpu"), "dense", torch.float16)
    assert half.dtype == half.layers[0].wqkv.dtype == half.embed.dtype == torch.float16


def test_an_unknown_weight_format_is_refused(models):
    q8, dense, _ = models
    with pytest.raises(ValueError, match="weight format 'q4'"):
        Qwen(dense.cfg, {}, "q4")


def test_training_a_head_refuses_a_q8_target():
    from experiments.train_mtp import TrainConfig
    from kvstream.config import ModelSource

    with pytest.raises(ValueError, match="model.weights=q8_0: the head trains against the dense target"):
        TrainConfig(model=ModelSource(weights="q8_0"))


def test_decode_matmul_routes_few_rows_on_cuda_only():
    """``model.gemv``'s routing (``weights.decode_matmul``): 1 row -> kernels/gemv.py, 2-16 rows with K
    below MMA_MAX_K -> kernels/gemv_mma.py, a q8_0 weight's 1 row -> kernels/q8_gemv.py; cuBLAS (None)
    for more rows, a long K at 2+ rows, gemv off, and every CPU tensor; q8_linear (None) for 2+ q8_0 rows."""
    from kernels.gemv import gemv
    from kernels.gemv_mma import gemv_mma
    from kvstream.model.weights import MMA_MAX_K, Q8, _q8_gemv, decode_matmul

    w = torch.zeros(64, 64)
    assert decode_matmul(torch.zeros(1, 64), w, True) is None  # CPU: the reference path
    if not torch.cuda.is_available():
        return
    x = lambda n, k=64: torch.zeros(n, k, device="cuda")
    wc = w.cuda()
    assert decode_matmul(x(1), wc, True) is gemv
    assert decode_matmul(x(2), wc, True) is gemv_mma and decode_matmul(x(16), wc, True) is gemv_mma
    assert decode_matmul(x(17), wc, True) is None and decode_matmul(x(1), wc, False) is None
    wide = torch.zeros(8, MMA_MAX_K, device="cuda")
    assert decode_matmul(x(1, MMA_MAX_K), wide, True) is gemv and decode_matmul(x(5, MMA_MAX_K), wide, True) is None
    assert decode_matmul(x(5, MMA_MAX_K - 32), wide[:, 32:], True) is gemv_mma
    assert decode_matmul(x(1), Q8.of(wc), True) is _q8_gemv and decode_matmul(x(1), Q8.of(wc), False) is None
    assert decode_matmul(x(2), Q8.of(wc), True) is None
