"""Speculative decoding with n-gram drafts: greedy equals plain decoding token for token;
sampled acceptance is lossless (chi-square); rollback leaves the cache as plain decoding would."""

from __future__ import annotations

import pytest
import torch

from kvstream.engine.generate import generate
from kvstream.model.qwen import load_model
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.engine.speculative import accept, speculative_generate
from kvstream.speculators.base import Speculator
from kvstream.speculators.chain import Chain
from kvstream.speculators.ngram_simple import NgramSimple
from test_paged_cache import SPEC, paged
from tiny_gguf import write_tiny_model

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("spec") / "m.gguf", SPEC))


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 97 + [11, 12, 13]  # 779 tokens (4 pages), n-grams match


def _streamed_cache(model):
    """A paged cache that streams during decode (3 resident pages per layer of the 4 the run
    needs), reserved for verify batches of 1 + 8 tokens."""
    from kvstream.cache.factory import make_cache, reserve_slab
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.cache.arena import ArenaPlan
    from test_paged_cache import pair_bytes
    mib = ArenaPlan(reserve_slab(model, 32), 4, pair_bytes()).mib(SPEC.n_layers * 2)  # fits prefill
    cache = make_cache(CacheConfig(mode="stream", ring_pages=4), ArenaConfig(mib=mib), model, 1024, 32,
                       verify_width=9)
    return cache


class Fixed(Speculator):
    """Always proposes the same tokens (a point-mass draft)."""

    name = "fixed"

    def __init__(self, tokens):
        super().__init__()
        self.tokens = list(tokens)

    def _propose(self, history, n_max, state):
        return self.tokens[:n_max]

    def _accepted(self, n_drafted, n_accepted):
        pass


class Oracle(Fixed):
    """Drafts the plain run's continuation with every ``wrong``-th token replaced, so full
    acceptance, partial acceptance and the bonus token all happen."""

    name = "oracle"

    def __init__(self, future: list[int], prompt_len: int, wrong: int):
        super().__init__(future)
        self.prompt_len, self.wrong = prompt_len, wrong

    def _propose(self, history, n_max, state):
        pos = len(history) - self.prompt_len  # index in the run of the next token
        return [(t + 1) % 357 if (pos + i) % self.wrong == self.wrong - 1 else t
                for i, t in enumerate(self.tokens[pos:pos + n_max])]


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged-stream"])
@pytest.mark.parametrize("speculator", ["ngram", "oracle"])
def test_greedy_speculation_equals_plain_decoding(model, cache_kind, speculator):
    new_cache = (lambda: model.new_cache(1024)) if cache_kind == "contiguous" else (lambda: _streamed_cache(model))
    plain = generate(model, new_cache(), PROMPT, 48, Sampler(GREEDY), prefill_chunk=32)  # same cache kind
    spec = NgramSimple(n=3, m=8) if speculator == "ngram" else Oracle(plain.tokens, len(PROMPT), wrong=5)
    got = speculative_generate(model, new_cache(), PROMPT, 48, Sampler(GREEDY), Chain([spec]), n_max=8, prefill_chunk=32)
    assert got.tokens == plain.tokens
    assert spec.stats.drafts > 0
    if speculator == "oracle":  # 4 of every 5 draft positions are right: most rounds keep several
        assert spec.stats.accepted_tokens >= len(plain.tokens) // 2
        assert max(r.new_tokens for r in got.records) == 5  # 4 accepted + the corrected token
    assert sum(r.new_tokens for r in got.records) == len(got.tokens) - 1
    if cache_kind == "paged-stream":
        assert all(r.streamed_pages == 1 for r in got.records)  # verify batches read streamed pages


def test_last_round_verifies_at_the_usual_width(model):
    """The decode's last round drafts as many tokens as the others (on CUDA: the width whose graph
    is captured, not a narrower one to capture) and drops what runs past max_new_tokens."""
    plain = generate(model, model.new_cache(1024), PROMPT, 40, Sampler(GREEDY), prefill_chunk=32)
    spec = Oracle(plain.tokens, len(PROMPT), wrong=1000)  # never wrong: every round keeps 4 + 1
    got = speculative_generate(model, model.new_cache(1024), PROMPT, 23, Sampler(GREEDY), Chain([spec]),
                               n_max=4, prefill_chunk=32)
    assert got.tokens == plain.tokens[:23]
    # 1 + 4 rounds of 5 = 21 tokens, then a round of width 5 that keeps the 2 still wanted
    assert [r.verify_width for r in got.records] == [5] * 5
    assert [r.new_tokens for r in got.records] == [5, 5, 5, 5, 2]
    assert spec.stats.accepted_tokens == 17  # what was kept: the chain's state matches the output


def test_rejection_sampling_is_lossless():
    """Rows with fixed distributions p0, p1, p2 and the draft [d0, d1]: the first kept token
    must follow p0, and the second, given the first was d0, p1. Chi-square with 5 degrees of
    freedom over 6 tokens: 20.5 is the 0.999 quantile (a correct sampler fails 1 run in 1000)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    draft = [2, 4]
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    n = 30_000
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(n):
        kept = accept(logits, draft, sampler)
        first[kept[0]] += 1
        if kept[0] == draft[0]:
            second[kept[1]] += 1
    for counts, row in ((first, 0), (second, 1)):
        expected = torch.softmax(logits[row], -1) * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (row, chi2)


def test_sampled_speculation_is_seeded_and_rolls_back(model):
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.0, seed=3)
    runs = [speculative_generate(model, model.new_cache(1024), PROMPT, 24, Sampler(params),
                                 Chain([Fixed([11, 12, 13, 14])]), n_max=4) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 24
    # the cache holds exactly the history: re-running plain decoding over it gives the same logits
    cache = model.new_cache(1024)
    speculative_generate(model, cache, PROMPT, 24, Sampler(params), Chain([Fixed([11, 12, 13, 14])]), n_max=4)
    fresh = model.new_cache(1024)
    seq = PROMPT + runs[0].tokens[:-1]
    with torch.inference_mode():
        a = model(torch.tensor([runs[0].tokens[-1]]), cache)
        model(torch.tensor(seq), fresh)
        b = model(torch.tensor([runs[0].tokens[-1]]), fresh)
    assert cache.length == fresh.length
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()  # same history; batch shapes differ (fp32 sums)
