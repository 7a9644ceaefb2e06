"""Speculative decoding: draft with a speculator chain, verify with one target forward pass.

One round (DESIGN.md, "One decode step, as data"):

1. the chain proposes up to ``n_max`` tokens continuing the history;
2. the target runs ``1 + n`` tokens (the last sampled token, then the draft) in one pass;
3. acceptance keeps a prefix of the draft: greedy (the target's argmax must equal the draft
   token) or, at T > 0, lossless rejection sampling: accept draft token d with probability
   min(1, p(d) / q(d)); on rejection sample from normalise(max(0, p - q)). For point-mass
   drafts (n-gram speculators) q is one-hot, so the test is ``u < p(d)`` and the residual is
   p without d. When every draft token is accepted, a bonus token is sampled from the last
   position. p is the sampler's final distribution (top-k / top-p / min-p / temperature);
4. the target cache is rolled back past the last kept token; only the chain's winner is told
   how many tokens were accepted.

The output has the target's distribution whatever the draft: greedy runs equal plain decoding
token for token (tests), sampled runs match it in distribution (chi-square test).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from .generate import Generation, GenerationStats, _sync, prefill_phase
from .sampling import Sampler
from .telemetry import StepRecord


def accept(logits: torch.Tensor, draft: list[int], sampler: Sampler) -> list[int]:
    """Tokens kept from one verify pass: the accepted draft prefix plus one token sampled by
    the target (the correction at the first rejection, or the bonus). logits [1 + n, vocab]."""
    out = []
    for i, d in enumerate(draft):
        if sampler.params.greedy:
            t = int(logits[i].argmax())
            if t != d:
                return out + [t]
        else:
            probs, ids = sampler.probs(logits[i])
            p_d = probs[ids == d].sum()
            u = torch.rand((), generator=sampler.generator, device=probs.device)
            if not bool(u < p_d):  # rejected: sample from p with d removed (q is one-hot)
                residual = torch.where(ids == d, torch.zeros_like(probs), probs)
                return out + [int(ids[torch.multinomial(residual, 1, generator=sampler.generator)[0]])]
        out.append(d)
    return out + [int(sampler(logits[len(draft)]))]


@torch.inference_mode()
def speculative_generate(model, cache, prompt: list[int], max_new_tokens: int, sampler: Sampler, chain, *,
                         n_max: int = 15, stop_ids: Iterable[int] = (), prefill_chunk: int = 512,
                         on_token: Callable[[int], None] | None = None) -> Generation:
    """Generate like :func:`kvstream.generate.generate`, drafting with ``chain`` (point-mass
    speculators); ``n_max`` caps the draft so a verify batch is at most 1 + n_max tokens."""
    stop = set(stop_ids)
    dev = model.device
    chain.begin(prompt)
    logits, prefill_s = prefill_phase(model, cache, prompt, prefill_chunk)
    t1 = time.perf_counter()
    emit = on_token or (lambda t: None)
    out = [int(sampler(logits))]
    emit(out[0])
    records: list[StepRecord] = []
    while out[-1] not in stop and len(out) < max_new_tokens:
        ts = time.perf_counter()
        budget = min(n_max, max_new_tokens - len(out) - 1)  # room for the kept drafts + one more
        draft = chain.propose(prompt + out, budget) if budget > 0 else []
        if chain.last_probs is not None:
            raise NotImplementedError("drafts with probabilities (a draft model) need q-aware acceptance")
        start = cache.length
        logits = model(torch.tensor([out[-1]] + draft, device=dev), cache, all_logits=True)
        kept = accept(logits, draft, sampler)
        cache.truncate(start + len(kept))  # the last sampled token and the accepted drafts stay
        if draft:
            chain.accepted(len(draft), len(kept) - 1)
        for t in kept:
            out.append(t)
            emit(t)
            if t in stop:
                break
        records.append(StepRecord.of(len(records), cache, len(kept), time.perf_counter() - ts))
    _sync(dev)
    t2 = time.perf_counter()
    stopped = out[-1] if out[-1] in stop else None
    return Generation(out, GenerationStats(len(prompt), len(out), prefill_s, t2 - t1), stopped, [], records)
