"""Speculator chain-order policies on hand-made stats, without a model."""

from __future__ import annotations

import random

import pytest

from policies.chain_order import ByGoodput, ChainSnapshot, Fixed, build


def snap(names, **stats):
    return ChainSnapshot(tuple(names), stats)


def test_fixed_keeps_the_configured_order():
    s = snap(["draft", "ngram-simple"], draft=(100, 300, 10, 1.0), **{"ngram-simple": (100, 50, 40, 0.0)})
    assert Fixed().decide(s) == ["draft", "ngram-simple"]


def test_by_goodput_orders_by_accepted_tokens_per_drafting_second():
    s = snap(["a", "b", "c"],
             a=(10, 40, 10, 1.0),    # 10 tokens/s
             b=(10, 40, 30, 1.0),    # 30 tokens/s
             c=(10, 40, 20, 0.5))    # 40 tokens/s
    assert ByGoodput().decide(s) == ["c", "b", "a"]


def test_by_goodput_leaves_undersampled_speculators_in_their_slots():
    s = snap(["a", "b", "c", "d"],
             a=(10, 40, 10, 1.0),    # 10 tokens/s
             b=(7, 0, 0, 0.0),       # 7 calls < min_calls = 8: stays second
             c=(10, 40, 30, 1.0),    # 30 tokens/s
             d=(10, 40, 20, 1.0))    # 20 tokens/s
    assert ByGoodput().decide(s) == ["c", "b", "d", "a"]
    assert ByGoodput(min_calls=7).decide(s) == ["c", "d", "a", "b"]  # sampled now: 0 tokens/s, last
    assert ByGoodput().decide(snap(["x", "a"], a=(10, 40, 10, 1.0))) == ["x", "a"]  # no stats: never called


def test_by_goodput_ties_keep_the_current_order():
    tie = {"a": (10, 40, 20, 1.0), "b": (20, 80, 40, 2.0), "c": (10, 40, 20, 1.0)}
    assert ByGoodput().decide(ChainSnapshot(("b", "c", "a"), tie)) == ["b", "c", "a"]
    assert ByGoodput().decide(ChainSnapshot(("a", "c", "b"), tie)) == ["a", "c", "b"]


def test_by_goodput_free_speculators_rank_by_accepted_tokens_per_call():
    s = snap(["draft", "ngram-simple", "ngram-map", "ngram-dead"],
             draft=(100, 400, 300, 0.5),               # 600 tokens/s of drafting
             **{"ngram-simple": (100, 60, 40, 0.0),    # free: 0.4 accepted per call
                "ngram-map": (50, 60, 30, 0.0),        # free: 0.6 accepted per call
                "ngram-dead": (100, 60, 0, 0.0)})      # free but never accepted: 0
    assert ByGoodput().decide(s) == ["ngram-map", "ngram-simple", "draft", "ngram-dead"]


def test_by_goodput_returns_a_permutation():
    rng = random.Random(0)
    names = [f"s{i}" for i in range(6)]
    for _ in range(200):
        stats = {n: (rng.randint(0, 20), rng.randint(0, 50), rng.randint(0, 50), rng.choice([0.0, rng.random()]))
                 for n in names if rng.random() < 0.9}
        order = ByGoodput(min_calls=rng.randint(0, 10)).decide(ChainSnapshot(tuple(names), stats))
        assert sorted(order) == sorted(names)


def test_build():
    assert build("fixed") == Fixed()
    assert build("by_goodput", min_calls=3) == ByGoodput(3)
    with pytest.raises(ValueError, match="policy.chain_order='random'; choose one of fixed, by_goodput"):
        build("random")
    with pytest.raises(ValueError, match="policy.chain_order=fixed: .*min_calls"):
        build("fixed", min_calls=3)
    with pytest.raises(ValueError, match="min_calls >= 0"):
        ByGoodput(-1)
