"""The MTP head on a tiny random Qwen2 target: shared views, the training-time-test unroll against the
drafting chain, training, its GGUF, refusal of another target, exact resume."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hydra import compose, initialize_config_module

from experiments.train_mtp import TrainConfig, target_pass, train
from kvstream.config import ModelSource, to_typed
from kvstream.model.mtp import MTPHead
from kvstream.model.mtp_gguf import HeadMismatch, load_head, write_head
from kvstream.model.qwen import load_model
from kvstream.model.registry import sha256_file
from tiny_gguf import TinySpec, write_tiny_model

SPEC = TinySpec(hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=96, n_layers=2)


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mtp") / "t.gguf", SPEC)


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(target_path)


def random_head(target, ffn=None, d2t=None, features=None) -> MTPHead:
    """A head whose every weight is random (norms and biases too, unlike a fresh head's ones and zeros)."""
    head = MTPHead(target, ffn, d2t, seed=1, features=features)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p) if p is not head.bqkv else 0.1 * torch.randn_like(p))
    return head


def config(path, tmp, **kw) -> TrainConfig:
    """A run small enough for one CPU core: 64-token sequences of the stdlib, 2 unrolled steps."""
    base = dict(model=ModelSource(str(path)), corpus=["stdlib"], seq_len=64, batch=2, steps=300, unroll=2, lr=5e-3,
                warmup=10, eval_every=100, eval_seqs=4, out=str(tmp / "head.gguf"), out_type="f32", progress=False)
    return TrainConfig(**(base | kw))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_draft", [None, 40])
def test_shapes_and_shared_views(tmp_path, tied, n_draft):
    target = load_model(write_tiny_model(tmp_path / "t.gguf", dataclasses.replace(SPEC, tied=tied)))
    d2t = None if n_draft is None else torch.randperm(target.cfg.vocab_size)[:n_draft].sort().values
    head = MTPHead(target, ffn=48, d2t=d2t)
    c, d = target.cfg, target.cfg.hidden
    for shared, own in ((head.embed, target.embed), (head.out_norm, target.out_norm), (head.lm_head, target.lm_head),
                        (head.inv_freq, target.inv_freq)):
        assert shared.data_ptr() == own.data_ptr() and shared.shape == own.shape
    assert head.shares(target)
    assert not head.shares(load_model(tmp_path / "t.gguf"))  # the same weights, loaded again: other storage
    assert set(head.state_dict()) == {"enorm", "hnorm", "eh_proj", "attn_norm", "wqkv", "bqkv", "wo", "ffn_norm",
                                      "w_gate_up", "w_down"}
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    own = 4 * d + 2 * d * d + qkv * (d + 1) + d * c.n_heads * c.head_dim + 3 * 48 * d
    assert sum(p.numel() for p in head.parameters()) == own
    assert head.nbytes == 4 * (own + (n_draft or 0) * d)  # fp32; a draft vocabulary adds its gathered rows
    if n_draft is None:
        assert head.lm_rows is target.lm_head
    else:
        assert torch.equal(head.lm_rows, target.lm_head[d2t]) and torch.equal(head.to_target(torch.arange(n_draft)), d2t)
    kv = head.new_cache(16)
    logits, h = head.step(torch.randn(5, d), torch.randint(0, c.vocab_size, (5,)), torch.arange(1, 6), kv)
    assert logits.shape == (5, n_draft or c.vocab_size) and logits.dtype == torch.float32
    assert h.shape == (5, d) and kv.length == 5


def test_hidden_is_the_pre_norm_residual(target):
    tokens = torch.randint(0, target.cfg.vocab_size, (12,))
    logits, h = target_pass(target, tokens)
    cache = target.new_cache(12)
    assert torch.equal(logits, target(tokens, cache, all_logits=True))  # hidden=True changes nothing else
    from kernels.reference import rms_norm
    ref = torch.nn.functional.linear(rms_norm(h, target.out_norm, target.cfg.rms_eps), target.lm_head)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)  # fp32, the same ops in another order: a few ulps


def test_forward_returns_the_hidden_states_beside_the_logits(target):
    """``forward(hidden=True)`` (what a verify batch hands an MTP head) gives the pass's logits
    and every row's pre-norm state: the logits equal a pass without it, the states body's."""
    tokens = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(3))
    a, b = target.new_cache(12), target.new_cache(12)
    logits, h = target(tokens, a, all_logits=True, hidden=True)
    assert torch.equal(logits, target(tokens, b, all_logits=True)) and h.shape == (12, target.cfg.hidden)
    c = target.new_cache(12)
    assert torch.equal(h, target.body(tokens, c.begin(12), c, all_logits=True, hidden=True)[1])


def test_body_taps_the_streams_entering_the_named_blocks(target):
    """``hidden`` as block indices: the residual streams entering those blocks, side by side in
    the order given; index 0 is the embedding, n_layers the stream True gives (after the last
    block); the logits do not change. Indices outside 0..n_layers, or repeated, are refused."""
    from kvstream.model.weights import embedding
    n, L = 12, target.cfg.n_layers
    tokens = torch.randint(0, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    logits, last = target_pass(target, tokens, True)
    logits2, h = target_pass(target, tokens, (L, 0, 1))
    d = target.cfg.hidden
    assert torch.equal(logits2, logits) and h.shape == (n, 3 * d)
    assert torch.equal(h[:, :d], last) and torch.equal(h[:, d:2 * d], embedding(tokens, target.embed, target.dtype))
    # the stream entering block 1 = the embedding + block 0's attention and FFN: neither end
    assert not torch.equal(h[:, 2 * d:], h[:, d:2 * d]) and not torch.equal(h[:, 2 * d:], last)
    for bad in ((L + 1,), (-1,), (1, 1), ()):
        with pytest.raises(ValueError, match="block indices"):
            target_pass(target, tokens, bad)


@pytest.mark.parametrize("n_draft,features", [(None, None), (50, None), (None, (1, 2))])
def test_unroll_equals_the_drafting_chain(target, n_draft, features):
    """Row i of unrolled step s = the logits of step s of a drafting chain from position i: the
    cache holds the step-1 rows 0..i (true target features), then the chain's own rows. With
    several target streams (EAGLE-3) the first step fuses them, later steps read their own state."""
    d2t = None if n_draft is None else torch.arange(0, 2 * n_draft, 2)
    head, T, k = random_head(target, d2t=d2t, features=features), 24, 4
    tokens = torch.randint(0, target.cfg.vocab_size, (T,))
    _, h = target_pass(target, tokens, head.features)
    with torch.no_grad():
        unrolled = head.unroll(h, tokens, k)
        assert [u.shape[0] for u in unrolled] == [T - s for s in range(1, k + 1)]
        for i in (0, 1, 7, T - k - 1):
            kv = head.new_cache(T + k)
            logits, g = head.step(h[:i + 1], tokens[1:i + 2], torch.arange(1, i + 2), kv)
            chain = [logits[-1]]
            for s in range(2, k + 1):
                logits, g = head.step(g[-1:], tokens[i + s:i + s + 1], torch.tensor([i + s]), kv)
                chain.append(logits[0])
            for s, got in enumerate(chain, 1):
                # fp32; SDPA over a masked key set vs the causal cache: summation order only (|logit| <= ~4)
                torch.testing.assert_close(unrolled[s - 1][i], got, rtol=0, atol=2e-5)


def test_draft_is_the_greedy_chain_and_rollback_is_exact(target):
    head, n, k = random_head(target), 9, 5
    tokens = torch.randint(0, target.cfg.vocab_size, (n + 1,))
    _, h = target_pass(target, tokens)
    kv = head.new_cache(32)
    drafted = head.draft(h[:n], tokens[1:], torch.arange(1, n + 1), k, kv)
    assert drafted.shape == (k,) and kv.length == n + k - 1
    ref_kv = head.new_cache(32)
    with torch.no_grad():
        logits, g0 = head.step(h[:n], tokens[1:], torch.arange(1, n + 1), ref_kv)
        want, g = [logits[-1].argmax()], g0
        for j in range(1, k):
            logits, g = head.step(g[-1:], want[-1][None], torch.tensor([n + j]), ref_kv)
            want.append(logits[0].argmax())
        assert torch.equal(drafted, torch.stack(want))
        kv.truncate(n)  # the round's drafted rows go; the committed rows stay
        again, _ = head.step(g0[-1:], drafted[:1], torch.tensor([n + 1]), kv)
        fresh = head.new_cache(32)
        head.step(h[:n], tokens[1:], torch.arange(1, n + 1), fresh)
        ref, _ = head.step(g0[-1:], drafted[:1], torch.tensor([n + 1]), fresh)
    assert torch.equal(again, ref)  # same rows, same ops: bit-identical


@pytest.fixture(scope="module")
def trained(target_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    return train(config(target_path, tmp), command="pytest trained"), tmp


def test_training_raises_heldout_agreement(trained):
    curve = trained[0]["curve"]
    untrained, last = curve[0], curve[-1]
    assert untrained["step"] == 0 and last["step"] == 300
    # the untrained head agrees on ~1/vocab of the rows; 300 steps on a random 2-layer target reach ~0.4
    for s in (1, 2):
        assert last[f"agree_{s}"] >= untrained[f"agree_{s}"] + 0.25, curve
    assert last["heldout_loss"] < 0.5 * untrained["heldout_loss"]
    assert trained[0]["csv"].read_text().splitlines()[0].startswith("step,tokens_seen,lr,train_loss,heldout_loss,agree_1")


def test_gguf_round_trip_is_exact(trained, target, target_path, tmp_path):
    result, _ = trained
    assert sha256_file(result["gguf"]) == result["sha256"]
    head, meta = load_head(result["gguf"], target, sha256_file(target_path))
    assert meta["target_sha256"] == sha256_file(target_path) and meta["train.command"] == "pytest trained"
    assert meta["train.corpus"].startswith("stdlib: ")
    assert meta["train.tokens_seen"] == 300 * 2 * 64 and meta["train.seed"] == 0 and meta["draft_vocab_size"] == 0
    assert meta["vocab_size"] == target.cfg.vocab_size and meta["feed_forward_length"] == target.cfg.ffn
    # with a draft vocabulary, and written again: bit-identical tensors and file
    assert tuple(meta["feature_layers"]) == (target.cfg.n_layers,) and head.fc is None
    d2t = torch.arange(3, 120, 3)
    other = random_head(target, ffn=40, d2t=d2t, features=(0, 2))  # EAGLE-3's form: fc fuses two streams
    train = {"command": "cmd", "corpus": "", "tokens_seen": 7, "steps": 1, "seed": 2}
    sha = write_head(tmp_path / "h.gguf", other, "ab" * 32, train, out_type="f32")
    back, meta = load_head(tmp_path / "h.gguf", target, "ab" * 32)
    assert meta["draft_vocab_size"] == len(d2t) and meta["train.corpus"] == "-" and torch.equal(back.d2t, d2t) and back.ffn == 40
    assert back.features == (0, 2) and back.fc.shape == (target.cfg.hidden, 2 * target.cfg.hidden)
    for name, p in other.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name
    assert write_head(tmp_path / "h2.gguf", back, "ab" * 32, train, out_type="f32") == sha


def test_a_head_for_another_target_or_vocabulary_is_refused(trained, target, target_path, tmp_path):
    path = trained[0]["gguf"]
    other = write_tiny_model(tmp_path / "other.gguf", dataclasses.replace(SPEC, seed=5))
    other_sha = sha256_file(other)
    with pytest.raises(HeadMismatch, match=f"sha256 {sha256_file(target_path)}.*sha256 is {other_sha}"):
        load_head(path, load_model(other), other_sha)
    wider = load_model(other)
    wider.cfg = dataclasses.replace(wider.cfg, vocab_size=target.cfg.vocab_size + 1)  # a vocabulary of another size
    with pytest.raises(HeadMismatch, match=f"vocabulary of {target.cfg.vocab_size} tokens.*has {target.cfg.vocab_size + 1}"):
        load_head(path, wider, other_sha)


def test_resume_continues_identically(target_path, tmp_path):
    run = lambda out, **kw: train(config(target_path, tmp_path, steps=6, eval_every=3, ckpt_every=3, out=str(out),
                                         draft_vocab=100, **kw), command="resume")  # the truncated-vocabulary loss too
    whole = run(tmp_path / "a.gguf", resume=False)
    first = run(tmp_path / "b.gguf", stop_after=3)
    assert "gguf" not in first and first["losses"] == whole["losses"][:3]
    rest = run(tmp_path / "b.gguf")
    assert rest["losses"] == whole["losses"][3:]  # exact: same state, same data, same ops
    assert rest["sha256"] == whole["sha256"] and rest["curve"] == whole["curve"]
    with pytest.raises(ValueError, match="belongs to another run.*'lr': \\(0.005, 0.001\\)"):
        run(tmp_path / "b.gguf", lr=1e-3)


def test_config_composes():
    with initialize_config_module("conf", version_base=None):
        cfg = to_typed(compose("train_mtp", overrides=["hardware=cpu", "steps=10", "draft_vocab=32768"]), TrainConfig)
    assert cfg.steps == 10 and cfg.draft_vocab == 32768 and cfg.hardware.dtype == "float32" and cfg.unroll == 4


def test_a_head_reading_several_target_streams_trains_and_is_written(target_path, tmp_path):
    """``features``: "last" (the default head), "eagle3" (blocks 2, n / 2, n - 3: here the 2-layer
    target's taps coincide, so refused in one line naming them), or indices; a head
    trained on two streams lowers its loss and its GGUF records them."""
    from experiments.train_mtp import feature_layers
    assert feature_layers("last", 28) is None and feature_layers("eagle3", 28) == (2, 14, 25)
    assert feature_layers("0,2", None) == (0, 2)
    with pytest.raises(ValueError, match="last, eagle3, or comma-separated"):
        config(target_path, tmp_path, features="low")
    with pytest.raises(ValueError, match=r"coincide or fall outside 0..2 for this target's 2 blocks \(\[2, 1, -1\]\)"):
        feature_layers("eagle3", 2)
    with pytest.raises(ValueError, match=r"6 blocks \(\[2, 3, 3\]\)"):
        feature_layers("eagle3", 6)
    assert feature_layers("eagle3", 7) == (2, 3, 4)
    result = train(config(target_path, tmp_path, steps=30, eval_every=30, features="0,2"), command="features")
    assert result["curve"][-1]["heldout_loss"] < result["curve"][0]["heldout_loss"]
    head, meta = load_head(result["gguf"], load_model(target_path), sha256_file(target_path))
    assert tuple(meta["feature_layers"]) == (0, 2) == head.features and head.fc is not None


def test_heads_written_before_feature_layers_load_and_a_missing_fc_is_named(target, tmp_path):
    """A GGUF without ``feature_layers`` (heads written before it) loads as a head of the last
    stream; one that lists several streams but lacks ``fc`` is refused in one line naming it."""
    from gguf import GGUFReader, GGUFWriter
    from kvstream.model.loader import GGUFError

    def copy(src, dst, drop_key=None, drop_tensor=None):
        r, w = GGUFReader(src), GGUFWriter(str(dst), "kvstream-mtp")
        for key, f in r.fields.items():
            if key.startswith("kvstream-mtp.") and key != drop_key:
                val = f.contents()
                (w.add_array if isinstance(val, list) else w.add_string if isinstance(val, str) else w.add_uint64)(key, val)
        for t in r.tensors:
            if t.name != drop_tensor:
                w.add_tensor(t.name, np.array(t.data))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    import numpy as np
    old, fused = tmp_path / "old.gguf", tmp_path / "fused.gguf"
    write_head(tmp_path / "a.gguf", random_head(target), "ab" * 32, {"command": "c"}, out_type="f32")
    copy(tmp_path / "a.gguf", old, drop_key="kvstream-mtp.feature_layers")
    head, meta = load_head(old, target, "ab" * 32)
    assert "feature_layers" not in meta and head.features == (target.cfg.n_layers,) and head.fc is None
    write_head(tmp_path / "b.gguf", random_head(target, features=(0, 2)), "ab" * 32, {"command": "c"}, out_type="f32")
    copy(tmp_path / "b.gguf", fused, drop_tensor="blk.0.nextn.fc.weight")
    with pytest.raises(GGUFError, match=r"fused.gguf: the head's tensors \['blk.0.nextn.fc.weight'\] are missing"):
        load_head(fused, target, "ab" * 32)


def test_the_head_refuses_input_rows_of_another_width(target):
    head = random_head(target, features=(0, 2))
    kv = head.new_cache(8)
    with pytest.raises(ValueError, match=f"input rows are 7 wide.*{2 * target.cfg.hidden}.*{target.cfg.hidden}"):
        head.step(torch.zeros(1, 7), torch.zeros(1, dtype=torch.long), torch.tensor([1]), kv)
