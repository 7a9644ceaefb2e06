"""Speculative decoding: draft with a speculator chain, verify with one target forward pass.

One round (DESIGN.md, "One decode step, as data"):

1. the chain proposes up to ``n_max`` tokens continuing the history;
2. the target runs ``1 + n`` tokens (the last sampled token, then the draft) in one pass;
3. acceptance keeps a prefix of the draft: greedy (the target's argmax must equal the draft
   token) or, at T > 0, lossless rejection sampling: accept draft token d with probability
   min(1, p(d) / q(d)); on rejection sample from normalise(max(0, p - q)). For point-mass
   drafts (n-gram speculators) q is one-hot, so the test is ``u < p(d)`` and the residual is
   p without d; a draft model reports its q. When every draft token is accepted, a bonus token
   is sampled from the last position. p is the sampler's final distribution (top-k / top-p /
   min-p / temperature). Synthetic acceptance (timing studies) instead keeps each draft
   token with probability alpha whatever its content: such output is NOT the target's;
4. the target cache is rolled back past the last kept token; only the chain's winner is told
   how many tokens were accepted;
5. policies act on the telemetry: the draft length for the next round, the chain's order,
   and (``DraftControl``) ejecting or re-enabling a pinned draft model.

The output has the target's distribution whatever the draft: greedy runs equal plain decoding
token for token (tests), sampled runs match it in distribution (chi-square test).

With ``device_rounds`` (CUDA, greedy) a round whose chain is one speculator that drafts on the
device (``Chain.propose_device``: the draft model) runs with one host sync: the draft's steps
feed each other on the device, the ``p_min`` stop is a mask, the verify pass runs 1 + n tokens
whatever the mask, and greedy (or synthetic) acceptance is computed on the device (one launch,
``kernels.accept``); the host reads back the accepted count and the tokens once, with the
draft's and the verify's device times (CUDA events). The output is the same as the host
round's: a masked token is never accepted, and the token after the accepted prefix is the
target's argmax there. A drafter with ``prepare`` stages its next round's feed before that
readback, from the kept tokens and the accepted count on the device (the MTP head also from the
verify's states): after the readback the host launches the next round without staging it, and
does so before the round's bookkeeping (telemetry, the eject policy; the length policy decides
first), so the device drafts while the host records. Where the next round's length is known
before the readback (a length policy that reads no round: ``Fixed``) and its drafter can start
from what ``prepare`` staged on the device (``Chain.propose_ahead``: the MTP head), that round is
launched before the readback instead, so the device drafts while the host reads back too. A
launched round that the bookkeeping rules out (an eject, a plain measurement, the output's end)
is dropped (``Chain.cancel_device``: its drafted rows roll back).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kernels import reference
from kernels.accept import accept as accept_kernel, scratch_for as accept_scratch
from policies.chain_order import ChainSnapshot
from policies.draft_length import Fixed, LengthSnapshot

from kvstream.cache.paged_staging import PinnedUpload
from kvstream.engine.generate import Generation, GenerationStats, sync_device, prefill_phase, warm_up
from kvstream.engine.readback import Readback
from kvstream.model.sampling import Sampler
from kvstream.telemetry import StepRecord


def accept(logits: torch.Tensor, draft: list[int], sampler: Sampler, q: torch.Tensor | None = None,
           alpha: float | None = None) -> list[int]:
    """Tokens kept from one verify pass: the accepted draft prefix plus one token sampled by
    the target (the correction at the first rejection, or the bonus). logits [1 + n, vocab];
    q [n, vocab] the draft's distributions (None: point masses); alpha: synthetic acceptance."""
    out = []
    for i, d in enumerate(draft):
        if alpha is not None:
            if not bool(torch.rand((), generator=sampler.generator, device=sampler.generator.device) < alpha):
                return out + [int(sampler(logits[i]))]
        elif sampler.params.greedy:
            t = int(logits[i].argmax())
            if t != d:
                return out + [t]
        else:
            p = sampler.dense(logits[i])
            q_i = q[i] if q is not None else torch.zeros_like(p).index_fill_(0, torch.tensor([d], device=p.device), 1.0)
            u = torch.rand((), generator=sampler.generator, device=p.device)
            if not bool(u * q_i[d] < p[d]):  # accept with min(1, p/q); rejected: sample normalise(max(0, p - q))
                residual = (p - q_i).clamp_min(0)
                residual = residual if float(residual.sum()) > 0 else p
                return out + [int(torch.multinomial(residual, 1, generator=sampler.generator)[0])]
        out.append(d)
    return out + [int(sampler(logits[len(draft)]))]


def accept_on_device(logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, sampler: Sampler,
                     alpha: float | None = None, scratch: torch.Tensor | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept`` for greedy rounds, on the device: (result, kept). result: [accepted, valid count,
    the n tokens, the target's 1 + n argmaxes] as one long tensor (one readback); kept: the
    round's kept tokens padded to 1 + n (the accepted drafts, then the target's token after them,
    repeated: a drafter stages its next round from it before the readback). logits [1 + n, vocab].
    With ``scratch`` (``kernels.accept.scratch_for``, CUDA) one launch, into ``out`` (result, kept) when
    given, else the torch expression (``kernels.reference.accept``); synthetic acceptance draws its keeps
    here, as the host round does."""
    n = tokens.shape[0]
    keep = None if alpha is None else torch.rand(n, generator=sampler.generator, device=logits.device) < alpha
    if scratch is not None:
        return accept_kernel(logits, tokens, valid, keep, scratch, *out)
    return reference.accept(logits, tokens, valid, keep)


class _DeviceRound:
    """A round on the device (module docstring): the verify input staged without a sync, one
    readback per round, the draft's and the verify's device times."""

    def __init__(self, device: torch.device, n_max: int):
        self.cuda = device.type == "cuda"
        self.batch = PinnedUpload(torch.zeros(1 + n_max, dtype=torch.long, device=device))
        self.readbacks: dict[int, Readback] = {}
        self.outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.device = device
        # two sets of a round's three marks, made once and used in turn: a round launched before the
        # last one's readback (``run``'s ``ahead``) records its draft's marks before that round's are read
        self.events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(2)] if self.cuda else None
        self.set = 0  # the set the last launch took
        self.n_max = n_max
        # a round's draft part launched ahead: (n, its marks' set, t0, t1, (tokens, valid) or None, the
        # speculator that launched it before the last round's feedback, or None: the chain's pending round)
        self.pending = None
        self.scratch = accept_scratch(1 + n_max, device) if self.cuda else None  # the acceptance kernel's

    def warm(self, vocab: int, synthetic: bool) -> None:
        """CUDA: the acceptance kernel compiled for every draft length here, in setup, not in the
        first timed rounds."""
        if self.scratch is None:
            return
        for n in range(1, self.n_max + 1):
            ones, zeros = (torch.ones(n, dtype=torch.bool, device=self.device),
                           torch.zeros(n, dtype=torch.long, device=self.device))
            accept_kernel(torch.zeros(1 + n, vocab, device=self.device), zeros, ones, ones if synthetic else None,
                          self.scratch)

    def _outputs(self, n: int) -> tuple:
        """The acceptance kernel's (result, kept) buffers for draft length ``n``, made once: read (the
        readback, the next round's staging) before the next round's acceptance rewrites them, in
        stream order. () for the torch path."""
        if self.scratch is None:
            return ()
        if n not in self.outs:
            self.outs[n] = tuple(torch.empty(m, dtype=torch.long, device=self.device) for m in (2 * n + 3, n + 1))
        return self.outs[n]

    def _mark(self, s: int, i: int):
        if not self.cuda:
            return time.perf_counter()
        self.events[s][i].record()
        return self.events[s][i]

    @staticmethod
    def _between(a, b) -> float:
        return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3

    def launch(self, chain, history: list[int], n: int) -> None:
        """Queue a round's draft part (``chain.propose_device``) now: ``run`` then verifies it, if it
        asks for the same ``n``. The engine launches the next round's draft as soon as the last
        round's readback has said what it continues, so the device drafts while the host does that
        round's bookkeeping (telemetry, the eject policy) instead of waiting for it."""
        self.cancel(chain)
        s = self.set = 1 - self.set
        t0 = self._mark(s, 0)
        drafted = chain.propose_device(history, n)  # None: the chain drafts on the host this round
        self.pending = (n, s, t0, self._mark(s, 1), drafted, None)  # (the marks around the draft alone)

    def _launch_ahead(self, chain, n: int) -> bool:
        """Queue the next round's draft part before this round's readback (``Chain.propose_ahead``: a
        drafter whose next feed ``prepare`` staged on the device); False where it cannot."""
        s = 1 - self.set
        t0 = self._mark(s, 0)
        out = chain.propose_ahead(n)
        if out is None:
            return False
        self.set, (spec, drafted) = s, out
        self.pending = (n, s, t0, self._mark(s, 1), drafted, spec)
        return True

    def cancel(self, chain) -> None:
        """Drop a launched round that will not be verified (a plain round, an eject, another length, the
        end of the output): its speculator rolls its drafted rows back."""
        pending, self.pending = self.pending, None
        if pending is None or pending[4] is None:
            return
        if pending[5] is not None:  # launched ahead: the chain's own pending round is settled already
            pending[5].cancel_device_round()
        else:
            chain.cancel_device()

    def run(self, model, cache, chain, history: list[int], n: int, sampler: Sampler, alpha: float | None,
            ahead: int = 0):
        """(kept tokens, valid draft tokens, draft seconds, verify seconds) of one round, or None
        when the chain drafts on the host this round; its draft part ``launch``ed ahead, or now. A
        drafter that reads the target's hidden states (an MTP head) gets the kept rows' (``observe``).
        ``ahead``: the next round's draft length where the engine knows it already; a drafter that
        can (``propose_ahead``) then launches that round after ``prepare``, before this readback, so
        the device drafts while the host reads back (``pending``; ``cancel`` drops it)."""
        if self.pending is None or self.pending[0] != n:
            self.launch(chain, history, n)
        (_, s, t0, t1, drafted, spec), self.pending = self.pending, None
        if drafted is None:
            return None
        if spec is not None:
            chain.resume(spec, n)
        tokens, valid = drafted
        self.batch.stage().numpy()[0] = history[-1]
        self.batch.send()
        batch = self.batch.dst[:1 + n]
        batch[1:].copy_(tokens)
        winner = chain.last_winner
        hidden = getattr(winner, "wants_hidden", False)
        out = model(batch, cache, all_logits=True, hidden=hidden)
        logits, h = out if hidden else (out, None)
        rb = self.readbacks.get(n) or self.readbacks.setdefault(n, Readback(self.device, (2 * n + 3,), torch.long))
        result, kept_dev = accept_on_device(logits, tokens, valid, sampler, alpha, self.scratch, self._outputs(n))
        t2 = self._mark(s, 2)  # before the readback's own event: done when the read returns, so readable
        rb.start(result)
        prepare = getattr(winner, "prepare", None)
        if prepare is not None:  # the next round's feed, staged while the device verifies (its few device
            # ops fall between the verify's events and the next draft's: in neither part's time)
            prepare(kept_dev, len(history) - 1, h=h[:1 + n] if hidden else None, accepted=result[:1], fed=batch,
                    ahead=ahead)
        launched = prepare is not None and ahead > 0 and self._launch_ahead(chain, ahead)
        out = rb.read().tolist()
        accepted, n_valid, toks, top = out[0], out[1], out[2:2 + n], out[2 + n:]
        kept = toks[:accepted] + [top[accepted]]
        winner.read_device_round(toks, n_valid, kept)
        if hidden and not launched:  # the kept rows' states: positions len(history) - 1 .. (the batch's
            # first token on); a round launched ahead has fed them already
            winner.observe(h[:len(kept)], kept, len(history) - 1)
        return kept, n_valid, self._between(t0, t1), self._between(t1, t2)


@dataclass
class _Timing:
    """Running measurements the length policy reads: target verify time per width, draft time."""

    width_s: dict[int, float]
    draft_s: float = 0.0
    drafted: int = 0

    def update(self, width: int, target_s: float, draft_s: float, drafted: int) -> None:
        old = self.width_s.get(width)
        self.width_s[width] = target_s if old is None else 0.8 * old + 0.2 * target_s  # EWMA: context grows
        if drafted:
            self.draft_s += draft_s
            self.drafted += drafted


@torch.inference_mode()
def speculative_generate(model, cache, prompt: list[int], max_new_tokens: int, sampler: Sampler, chain, *,
                         n_max: int = 15, stop_ids: Iterable[int] = (), prefill_chunk: int = 512,
                         on_token: Callable[[int], None] | None = None, synthetic_acceptance: float | None = None,
                         length_policy=None, order_policy=None, control=None, progress: bool = False,
                         run_ahead: bool | None = None, device_rounds: bool | None = None) -> Generation:
    """Generate like :func:`kvstream.engine.generate.generate`, drafting with ``chain``. ``n_max`` caps
    the draft (a verify batch is at most 1 + n_max tokens); ``length_policy`` picks each
    round's length, ``order_policy`` the chain's order, ``control`` ejects / re-enables a
    pinned draft model (``DraftControl``).

    While the chain is idle (its draft ejected) or ``control`` measures plain decoding
    (``control.plain``: the draft pinned, not drafting) rounds are plain steps, and with ``run_ahead``
    (default: on CUDA) the host queues the next one before reading the token that feeds it, as
    ``generate`` does: after an eject the decode runs at the plain rate. A queued step that is
    not used (a stop token, a re-enabled draft, the end of a plain measurement) is rolled back.
    ``device_rounds`` (default: on CUDA) runs greedy drafting rounds on the device (module
    docstring)."""
    stop = set(stop_ids)
    dev = model.device
    ahead = dev.type == "cuda" if run_ahead is None else run_ahead
    readback = Readback(dev, (), torch.long)
    on_device = (dev.type == "cuda" if device_rounds is None else device_rounds) and sampler.params.greedy
    rounds = _DeviceRound(dev, n_max) if on_device else None
    queued = None  # (cache length before it, its logits, its hidden states or None): a plain step queued ahead
    length_policy = length_policy or Fixed(n_max)
    static_length = getattr(length_policy, "static", False)  # its length needs no round's outcome
    watchers = [s for s in chain if getattr(s, "wants_hidden", False)]  # speculators fed the target's states
    # which states (Qwen.body's ``hidden``: the streams an MTP head reads): one pass serves every watcher
    features = watchers[0].wants_hidden if watchers else False
    if any(s.wants_hidden != features for s in watchers):
        raise ValueError(f"speculators read different target states: {[s.wants_hidden for s in watchers]}")
    observe = (lambda h, toks, start: [s.observe(h, toks, start) for s in watchers]) if watchers else None
    logits, prefill_s = prefill_phase(model, cache, prompt, prefill_chunk, observe, features)
    t0 = time.perf_counter()
    chain.begin(prompt)  # a draft model reads the prompt here: part of the prefill phase
    sync_device(dev)
    prefill_s += time.perf_counter() - t0
    # verify widths (with the hidden states where a speculator reads them)
    more = [chain.warm] + ([lambda: rounds.warm(logits.shape[-1], synthetic_acceptance is not None)] if rounds else [])
    warm_s = warm_up(model, cache, [(w, True, features) for w in range(1, n_max + 2)], *more)
    t1 = time.perf_counter()
    emit = on_token or (lambda t: None)
    out = [int(sampler(logits))]
    emit(out[0])
    # the prompt and the output as one list grown by appends: a round hands it to the chain
    # without an O(context) copy (a draft model then compares only what is new: DraftModel._seen)
    history = list(prompt) + out
    records: list[StepRecord] = []
    timing, last = _Timing({}), (0, 0)
    n_round = length_policy.decide(LengthSnapshot(n_max, 0, 0, None, {}, None, 0))  # current 0: the first round
    accepted_total = drafted_total = 0
    bar = tqdm(total=max_new_tokens, initial=1, desc="decode", unit="tok", disable=not progress, leave=False)
    launched = None  # when the next round's draft part was launched ahead (_DeviceRound.launch): its start
    while out[-1] not in stop and len(out) < max_new_tokens:
        ts = launched or time.perf_counter()
        launched = None
        measuring = control is not None and control.plain  # the ejected state's rate, measured in place
        plain = chain.idle or measuring
        if queued is not None and not plain:  # drafting again since it was queued: not a plain round
            cache.truncate(queued[0])
            queued = None
        # the last round is not cut to the tokens left, only to the cache's room: at the usual width
        # it replays a captured graph, where a narrower one captures a new graph (31-56 ms on the H200
        # after a re-layout); what runs past the end
        # is dropped below (kvstream.engine.runner sizes the cache n_max tokens past the end for it)
        n = min(n_round, cache.max_tokens - cache.length - 1)
        start = cache.length
        device_round = rounds is not None and n > 0 and not plain and queued is None
        if rounds is not None and not device_round:  # a round launched ahead that the bookkeeping then ruled out
            rounds.cancel(chain)
        # the next round's length, where it is known before this round's readback (a length policy that
        # reads no round) and that round surely follows (not the output's end, room in the cache)
        n_ahead = n_round if (static_length and len(out) + 1 + n < max_new_tokens
                              and start + (1 + n) + (1 + n_round) <= cache.max_tokens) else 0
        done = rounds.run(model, cache, chain, history, n, sampler, synthetic_acceptance, n_ahead) if device_round else None
        if done is not None:  # drafted, verified and accepted on the device
            kept, n_drafted, draft_s, verify_s = done
            width, stats = 1 + n, cache.stats
        else:
            h_round = None  # the verify's hidden states, for speculators that read them
            draft = chain.propose(history, n) if n > 0 and not plain else []
            n_drafted, width = len(draft), 1 + len(draft)
            draft_s = time.perf_counter() - ts
            if queued is not None:  # this round's step is already on the device
                (start, logits, h_round, stats), queued = queued, None
            else:
                # an ejected MTP head reads the states too: a re-enable catches its KV up from them
                res = model(torch.tensor([out[-1]] + draft, device=dev), cache, all_logits=True, hidden=features)
                logits, h_round = res if watchers else (res, None)
                stats = cache.stats  # this step's (a queued next step gets its own)
            if ahead and plain and len(out) + 1 < max_new_tokens:
                tok = sampler(logits[0])  # what accept() samples for a round without a draft, kept on the device
                readback.start(tok)
                at = cache.length
                res = model(tok.view(1), cache, all_logits=True, hidden=features)  # the next round's step
                queued = (at, *(res if watchers else (res, None)), cache.stats)
                kept = [int(readback.read())]
                if h_round is not None:
                    observe(h_round[:1], kept, start)
            else:
                kept = accept(logits, draft, sampler, chain.last_probs, synthetic_acceptance)
                if h_round is not None:
                    observe(h_round[:len(kept)], kept, start)
        kept = kept[:next((i + 1 for i, t in enumerate(kept) if t in stop), len(kept))]  # nothing after a stop
        kept = kept[:max_new_tokens - len(out)]  # the chain then rolls back what ran past the end
        if queued is None:  # (a step queued after a stop token is rolled back after the loop)
            cache.truncate(start + len(kept))  # the last sampled token and the accepted drafts stay
        winner = chain.last_winner.name if chain.last_winner is not None else ""
        if chain.last_winner is not None:
            chain.accepted(n_drafted, len(kept) - 1)
        for t in kept:
            out.append(t)
            history.append(t)
            emit(t)
        step_s = time.perf_counter() - ts
        # device rounds: the verify's device time for its width (host rounds: the rest of the round)
        timing.update(width, verify_s if done is not None else step_s - draft_s, draft_s, n_drafted)
        drafted_total, accepted_total = drafted_total + n_drafted, accepted_total + len(kept) - 1
        last = (n_drafted, len(kept) - 1)  # (0, 0) after a round without a draft: no change
        n_round = length_policy.decide(LengthSnapshot(
            n_max, *last, accepted_total / drafted_total if drafted_total else None, dict(timing.width_s),
            timing.draft_s / timing.drafted if timing.drafted else None, n_round))
        n_next = min(n_round, cache.max_tokens - cache.length - 1)
        if rounds is not None and rounds.pending is not None:  # launched before this round's readback: its
            launched = time.perf_counter()  # time from here (cancelled below or at the next round if unused)
        elif done is not None and out[-1] not in stop and len(out) < max_new_tokens and not chain.idle and n_next > 0:
            # the next device round's draft, queued before this round's bookkeeping (cancelled at the next
            # round if that bookkeeping ejects the draft or starts a plain measurement); its time from here
            launched = time.perf_counter()
            rounds.launch(chain, history, n_next)
        # this round's length and stats, not those of a step queued after it
        records.append(StepRecord.of(len(records), cache, len(kept), step_s, verify_width=width,
                                     drafted=n_drafted, accepted=len(kept) - 1, draft_s=draft_s,
                                     draft_active=bool(control and control.active), speculator=winner,
                                     plain_measure=measuring, context=start + len(kept), stats=stats))
        bar.update(len(kept))
        if control is not None:
            control.after_step(len(records) - 1, len(kept), step_s, length=start + len(kept),
                               tokens_left=0 if out[-1] in stop else max_new_tokens - len(out), draft_s=draft_s)
        if order_policy is not None and len(chain) > 1:
            chain.reorder(order_policy.decide(ChainSnapshot(tuple(chain.names), {
                s.name: (s.stats.calls, s.stats.drafted_tokens, s.stats.accepted_tokens, s.stats.seconds)
                for s in chain})))
    if queued is not None:  # queued after the stop token that ended the loop: not part of the output
        cache.truncate(queued[0])
    if rounds is not None:  # a round launched before the readback that ended the output
        rounds.cancel(chain)
    bar.close()
    sync_device(dev)
    t2 = time.perf_counter()
    stopped = out[-1] if out[-1] in stop else None
    return Generation(out, GenerationStats(len(prompt), len(out), prefill_s, t2 - t1, warm_s), stopped, [],
                      records)
