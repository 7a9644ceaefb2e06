"""Sampling: llama.cpp's filter semantics, seeded reproducibility, and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvstream.model.sampling import Sampler, SamplingParams, filter_logits


def llama_cpp_keep(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Independent reference: llama.cpp's top-k, top-p, min-p loops written out literally."""
    cand = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        cand = cand[:top_k]
    if top_p < 1.0:
        mx = logits[cand[0]]
        z = sum(math.exp(logits[i] - mx) for i in cand)
        cum, last = 0.0, len(cand)
        for j, i in enumerate(cand):
            cum += math.exp(logits[i] - mx) / z
            if cum >= top_p and j + 1 >= 1:
                last = j + 1
                break
        cand = cand[:last]
    if min_p > 0.0:
        floor = logits[cand[0]] + math.log(min_p)
        cand = [i for i in cand if logits[i] >= floor] or cand[:1]
    return set(cand)


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1), (40, 0.95, 0.05),
    (3, 0.0, 0.0), (0, 0.3, 0.5), (100, 0.99, 0.01),
])
def test_filters_match_llama_cpp(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100) + int(min_p * 10))
    for _ in range(20):
        logits = torch.randn(64, generator=g, dtype=torch.float64).float() * 3
        vals, ids = filter_logits(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p))
        kept = {int(i) for i, v in zip(ids, vals) if v > float("-inf")}
        assert kept == llama_cpp_keep(logits.tolist(), top_k, top_p, min_p)


def test_greedy_is_argmax():
    logits = torch.randn(1000)
    assert int(Sampler(SamplingParams(temperature=0.0))(logits)) == int(logits.argmax())


def test_seeded_runs_reproduce_and_seeds_differ():
    logits = torch.randn(500)
    draw = lambda seed: [int(s(logits)) for s in [Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                                          min_p=0.0, seed=seed))] for _ in range(50)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_distribution_is_softmax(temperature):
    """Chi-square goodness of fit over 8 tokens, 40k draws. Critical value 24.32 is the 0.999
    quantile of chi-square with 7 degrees of freedom: a correct sampler fails 1 run in 1000."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    s = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=3))
    n = 40_000
    counts = torch.bincount(torch.stack([s(logits) for _ in range(n)]), minlength=8).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, chi2


def test_bad_params_are_clear_errors():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=-0.1)
