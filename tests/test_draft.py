"""The draft-model speculator pinned in the target's arena: lossless greedy output, exact
draft-KV rollback, eject / re-enable accounting, q-aware rejection sampling, synthetic
acceptance, the vocabulary check."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from statistics import median

import pytest
import torch

from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS
from kvstream.cache.arena import MIB, Arena, ArenaPlan, both_slabs_bytes
from kvstream.cache.factory import make_cache, reserve_slab
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.engine.draft_control import CHARGED, GOODPUT_MIN, PLAIN_CHARGED, DraftControl, Transition
from kvstream.engine.generate import generate
from kvstream.model.qwen import load_model
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.engine.speculative import accept, speculative_generate
from kvstream.speculators.chain import Chain
from kvstream.speculators.draft import DraftModel, VocabMismatch, load_host
from kvstream.speculators.ngram_simple import NgramSimple
from kvstream.telemetry import StepStats
from kvstream.model.tokenizer import Tokenizer
from policies.eject import Action, Always, KeepPages, Never, Onset
from test_paged_cache import SPEC, pair_bytes
from tiny_gguf import TinySpec, write_tiny_model

GREEDY = SamplingParams(temperature=0.0)
DRAFT_SPEC = TinySpec(arch="qwen2", hidden=64, n_heads=2, n_kv_heads=1, head_dim=64, ffn=64, n_layers=2,
                      context_length=4096, seed=5)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 60 + [11, 12, 13]  # 483 tokens: 2 pages
NEW = 40
CHUNK = 16  # prefill chunks through the decode-attention path: a prefill slab close to the decode one


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    return write_tiny_model(d / "target.gguf", SPEC), write_tiny_model(d / "draft.gguf", DRAFT_SPEC)


@pytest.fixture(scope="module")
def model(files):
    return load_model(files[0])


@pytest.fixture(scope="module", params=["same-weights", "other-model"])
def host(request, files):
    """The draft's host weights: the target itself (high acceptance; its KV is f16, the
    target's q8_0/q4_0, so some rejections) or a different random model (mostly rejections)."""
    tok = Tokenizer.from_gguf(files[0])
    return load_host(files[0] if request.param == "same-weights" else files[1], tok.token_texts, torch.float32, "cpu")


def new_draft(host, max_tokens=1024, **kw):
    return DraftModel(host, "cpu", max_tokens=max_tokens, chunk=CHUNK, **kw)


def draft_bytes(host, **kw) -> int:
    return new_draft(host, **kw).pin(Arena(256 * MIB, "cpu"))


def arena_mib(model, host, pages_per_layer, ring=4, **kw):
    """An arena whose decode layout, with the draft pinned, holds ``pages_per_layer`` pages per
    layer (plus bytes short of one more page, which the slightly larger prefill slab takes)."""
    plan = ArenaPlan(reserve_slab(model, 9), ring, pair_bytes(), draft_bytes(host, **kw))
    return (plan.bytes(SPEC.n_layers * pages_per_layer + 1) - 1) / MIB


def target_cache(model, mib, ring=4, step=1, verify_width=9):
    return make_cache(CacheConfig(mode="stream", ring_pages=str(ring), residency_step=step), ArenaConfig(mib=str(mib)),
                      model, 1024, CHUNK, verify_width=verify_width)


class CountingModel:
    """A model that counts its forward passes."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


@dataclass
class Scripted:
    """Eject at step ``at`` and re-enable at step ``back`` (an eject policy for tests)."""

    at: int
    back: int
    step: int = 0

    def decide(self, snap):
        self.step += 1
        if self.step == self.at and snap.draft_active:
            return Action.EJECT
        if self.step == self.back and not snap.draft_active:
            return Action.REENABLE
        return Action.STAY


def run_with_draft(model, host, policy, pages=2, window=0, n_max=8, **kw):
    cache = target_cache(model, arena_mib(model, host, pages, window=window))
    draft = new_draft(host, window=window, run_ahead=kw.get("run_ahead"))  # the draft too: as on CUDA
    control = DraftControl(draft, cache, policy)
    assert control.capacity_with == pages
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=n_max,
                             prefill_chunk=CHUNK, control=control, **kw)
    return g, draft, control, cache


@pytest.fixture(scope="module")
def plain(model):
    cache = make_cache(CacheConfig(mode="resident"), ArenaConfig(), model, 1024, CHUNK)
    return generate(model, cache, PROMPT, NEW, Sampler(GREEDY), prefill_chunk=CHUNK).tokens


@pytest.mark.parametrize("weights", ["q8_0", "q8_0_int8"])
def test_a_draft_in_q8_0_blocks_pins_fewer_bytes_and_drafts_losslessly(model, files, plain, weights):
    """``spec.draft.weights``: the draft's matrices in q8_0 blocks (its norms and biases dense) pin about
    a quarter of its fp32 bytes (34 bytes a block of 32 values against 128), and the decode through it,
    eject and re-enable included, still equals plain decoding (int8 rows: the CPU's reference of the
    int8 kernel, with model.gemv as the target's setting)."""
    tok = Tokenizer.from_gguf(files[0])
    dense = load_host(files[0], tok.token_texts, torch.float32, "cpu")
    q8 = load_host(files[0], tok.token_texts, torch.float32, "cpu", gemv=weights == "q8_0_int8", weights=weights)
    weight_bytes = lambda h: sum(t.nbytes for n, t in h.tensors().items() if "norm" not in n and "bias" not in n)
    assert weight_bytes(q8) / weight_bytes(dense) == pytest.approx(34 / 128, rel=0.01)
    assert draft_bytes(q8) < draft_bytes(dense)
    g, draft, control, _ = run_with_draft(model, q8, Scripted(at=4, back=9), device_rounds=True)
    assert g.tokens == plain and [t.action for t in control.transitions] == ["eject", "reenable"]
    assert draft.stats.drafts > 0 and draft.stats.accepted_tokens > 0


def test_a_reenable_reloads_the_draft_kv_where_it_was(model, host):
    """An eject and a re-enable pin the draft KV at the same bytes: its cache keeps its layout and
    tensors (on CUDA its captured steps stay valid) and gets its pages back from the host store,
    though the target's pages took those bytes meanwhile."""
    g, draft, _, cache = run_with_draft(model, host, Never())
    history, key = PROMPT + g.tokens, draft.cache.plan_key()
    before = draft.propose(history, 4)
    draft.accepted(len(before), 0)
    cache.rearrange(lambda: draft.eject(cache.arena))
    cache.kspace.fill_(7)  # the target's pool holds the draft's bytes now: overwrite them all
    cache.vspace.fill_(7)
    cache.rearrange(lambda: draft.pin(cache.arena))
    assert draft.cache.plan_key() == key
    assert draft.propose(history, 4) == before


@pytest.mark.parametrize("window, run_ahead", [(0, False), (128, False), (128, True)])
def test_greedy_with_a_pinned_draft_equals_plain_decoding(model, host, plain, window, run_ahead):
    g, draft, control, _ = run_with_draft(model, host, Never(), window=window, run_ahead=run_ahead)
    assert g.tokens == plain
    assert draft.stats.drafts > 0 and all(r.draft_active for r in g.records)
    assert sum(r.new_tokens for r in g.records) == len(g.tokens) - 1
    assert g.records[-1].streamed_pages > 0  # the run ends in page 3 of 2 resident: verify batches stream
    history = PROMPT + g.tokens
    assert draft.fed == history[:len(draft.fed)]  # the draft KV never holds a rejected token
    if window:
        assert draft.base > 0 and draft.cache.length <= window  # it slid


def test_draft_kv_holds_exactly_the_accepted_history(host):
    """After a round the draft's KV equals a fresh draft that read the accepted history."""
    arena = Arena(64 * MIB, "cpu")
    d = new_draft(host)
    d.pin(arena)
    history = PROMPT[:300]
    with torch.inference_mode():
        draft = d.propose(history, 6)
        d.accepted(len(draft), 2)
        assert d.fed == history + draft[:2] and d.cache.length == len(d.fed)
        fresh = new_draft(host)
        fresh.pin(Arena(64 * MIB, "cpu"))
        a = d.model(torch.tensor([7]), d.cache)
        for piece in (history, draft[:1], draft[1:2], [7]):  # the batches the drafter ran
            b = fresh._feed(piece)
    assert torch.equal(a[-1], b)  # the same rows in the same batches: bit-identical


def test_eject_gives_the_draft_bytes_to_the_page_pool_and_reenable_takes_them_back(model, host):
    cache = target_cache(model, arena_mib(model, host, 2))
    arena, layout0 = cache.arena, cache.layout
    draft = new_draft(host)
    control = DraftControl(draft, cache, Never())
    pinned, pool_with = draft.pinned_bytes, cache.layout.pool_pages
    assert arena.nbytes - arena.top == pinned and control.capacity_with == 2
    state = (arena.top, list(arena.pinned), cache.layout, cache.capacity)
    for _ in range(1000):
        cache.rearrange(lambda: draft.eject(arena))
        assert arena.top == arena.nbytes and cache.layout == layout0  # the pool took every byte back
        assert cache.layout.pool_pages - pool_with in (pinned // pair_bytes(), pinned // pair_bytes() + 1)
        cache.rearrange(lambda: draft.pin(arena))
        assert (arena.top, arena.pinned, cache.layout, cache.capacity) == state
    assert control.capacity_without == min(layout0.pool_pages // SPEC.n_layers, cache.max_pages)


def test_the_draft_pins_both_its_slabs_and_its_estimate_covers_what_it_pins(host):
    """The draft's KV region lays out its catch-up slab and its step slab side by side (on CUDA
    the pools of its passes: tests/test_cuda.py); ``estimated_bytes``, which sizes an automatic
    arena before the draft is pinned, is what ``pin`` then takes below an aligned top."""
    draft = DraftModel(host, "cpu", max_tokens=1024, chunk=64)
    estimate = draft.estimated_bytes()
    pinned = draft.pin(Arena(256 * MIB, "cpu"))
    assert draft.slabs["prefill"] > draft.slabs["decode"] > 0  # 64-token catch-ups, 16-token steps
    assert draft.cache.layout.slab == both_slabs_bytes(draft.slabs)
    assert draft.cache.both_slabs
    assert estimate == pinned


def test_the_page_cost_is_the_mean_over_whole_residency_steps(model, host):
    """With residency step 3 one page opening in 3 re-captures: the per-page cost averages the
    latest 8 steps of openings (24), so it always holds 8 re-captures whatever the phase; after
    the first opening (a re-capture) it is already a third of it, not all of it."""
    control = DraftControl(new_draft(host), target_cache(model, arena_mib(model, host, 2), step=3),
                           Scripted(at=-1, back=-1))
    control.transitions.append(Transition(0, "eject", 40, 37, 48, 0.01, 0, after_s=0.09))
    # before any opening, the eject's re-capture stands in for one in 3 pages (not for every page,
    # which would overcharge a streaming state and keep a faster draft ejected)
    assert control.page_s == pytest.approx(0.03)
    for i in range(40):
        control.page_costs.append(0.09 if i % 3 == 0 else 0.0)
        # before a whole residency step of openings, the ones not yet seen count as nothing
        mean = 0.03 if len(control.page_costs) == 24 else 0.09 * (i // 3 + 1) / max(i + 1, 3)
        assert control.page_s == pytest.approx(mean)


@pytest.mark.parametrize("queued", [0, 1])
def test_goodput_is_steady_rounds_plus_a_cost_per_page_where_the_state_streams(model, host, queued):
    """A state's goodput: its steady rounds (mean tokens over the median batch: a lone slow batch,
    such as a verify width captured late, does not count), plus what a page opening costs, once
    per page of tokens, wherever that state streams (a streaming plan re-captures its graphs
    then: ~0.1 s every ~51 kept rounds of ~11 ms on the H200). A probe is too short to meet a
    page boundary, so the cost is measured where pages open and applied to either state.
    ``queued``: a step queued ahead (run-ahead plain rounds) is in the cache when its round is
    recorded, so the round that launched a page's first step pays that page's capture."""
    control = DraftControl(new_draft(host), target_cache(model, arena_mib(model, host, 2)), Scripted(at=-1, back=-1))
    assert control.capacity_with == 2 and control.capacity_without >= 3  # the draft streams at 3 pages, plain not
    length = 3 * PAGE_TOKENS - 60  # in page 3; rounds of 5 tokens, the one that opens page 4 re-captures
    for step in range(40):
        opens = -(-(length + 5 + queued) // PAGE_TOKENS) > -(-(length + queued) // PAGE_TOKENS)
        length += 5
        control.cache.length = length + queued
        control.after_step(step, 5, 0.085 if opens else 0.011, length=length)
    assert control.measured[True][0] == pytest.approx(5 / 0.011) and control.page_s == pytest.approx(0.074)
    assert control.goodput(True, 3)[0] == pytest.approx(1 / (0.011 / 5 + 0.074 / PAGE_TOKENS))
    control.measured[False] = (400.0, 3)
    assert control.goodput(False, 3)[0] == 400.0  # plain does not stream there: no page cost
    streams = control.capacity_without + 1
    assert control.goodput(False, streams)[0] == pytest.approx(1 / (1 / 400 + 0.074 / PAGE_TOKENS))
    control.transitions.append(Transition(0, "eject", 3, 2, 3, 0.01, 0, after_s=0.03))
    assert control.page_s == pytest.approx(0.074)  # measured page openings come first
    control.page_costs.clear()
    assert control.page_s == 0.03  # before any: an eject's re-capture cost stands in


def test_a_draft_restart_in_an_opening_batch_is_not_a_page_cost(model, host):
    """A page opening costs what the target's part of its batch takes beyond the target's median.
    The draft's window restart (~0.1 s of draft time) landing in the same batch is the draft's:
    counted as the page's, it would make auto eject a draft that pays."""
    control = DraftControl(new_draft(host), target_cache(model, arena_mib(model, host, 2)), Scripted(at=-1, back=-1))
    length = 3 * PAGE_TOKENS - 60  # in page 3 (streamed with the draft pinned); page 4 opens once
    for step in range(40):
        opens = -(-(length + 5) // PAGE_TOKENS) > -(-length // PAGE_TOKENS)
        length += 5
        control.cache.length = length
        draft = 0.106 if opens else 0.006  # the restart lands on the opening batch
        control.after_step(step, 5, 0.005 + draft + (0.074 if opens else 0.0), length=length, draft_s=draft)
    assert control.measured[True][0] == pytest.approx(5 / 0.011) and control.page_s == pytest.approx(0.074)


def test_a_transition_is_charged_with_its_slow_first_batches(model, host):
    """The horizon of ``auto`` needs what a transition costs: its re-layout plus what the first
    batches after it take beyond the new state's measured rate (graph captures, catch-up)."""
    policy = Scripted(at=2, back=99)
    snaps = []
    policy.decide = (lambda decide: lambda snap: snaps.append(snap) or decide(snap))(policy.decide)
    control = DraftControl(new_draft(host), target_cache(model, arena_mib(model, host, 2)), policy)
    for step, secs in enumerate([0.008, 0.008]):
        control.after_step(step, 5, secs, tokens_left=100 - 5 * step)
    eject, = control.transitions
    assert snaps[-1].tokens_left == 95 and (snaps[-1].eject_s, snaps[-1].reenable_s) == (None, None)
    # plain batches: a 30 ms capture and a 4 ms batch (the transition's), then the 2 ms rate
    for step, secs in enumerate([0.030, 0.004, 0.002, 0.002, 0.002], start=2):
        control.after_step(step, 1, secs, tokens_left=90)
        assert eject.after_s is None and control.cost("eject") is None  # the rate is not measured yet
    control.after_step(7, 1, 0.002, tokens_left=89)
    assert eject.after_s == pytest.approx(0.028 + 0.002) and eject.cost_s == eject.seconds + eject.after_s
    assert (snaps[-1].tokens_left, snaps[-1].eject_s, snaps[-1].reenable_s) == (89, eject.cost_s, None)
    control.after_step(8, 1, 0.5, tokens_left=88)  # a slow batch later on is not the transition's
    assert control.cost("eject") == eject.cost_s and control.transitions_rows()[0]["after_s"] == eject.after_s


def test_auto_measure_batches_must_cover_a_measured_stint():
    from kvstream.config import PolicyConfig
    from kvstream.engine.runner import eject_policy
    assert eject_policy(PolicyConfig(eject="auto", measure_batches=6)).inner.measure_batches == 6
    with pytest.raises(ValueError, match=r"policy.measure_batches=5: auto needs at least 6 batches in a state"):
        PolicyConfig(eject="auto", measure_batches=5)
    eject_policy(PolicyConfig(eject="onset", measure_batches=1))  # measure_batches is auto's alone


def test_no_transition_after_the_last_token(model, host):
    control = DraftControl(new_draft(host), target_cache(model, arena_mib(model, host, 2)), Scripted(at=1, back=99))
    assert control.after_step(0, 5, 0.008, tokens_left=0) is Action.STAY and not control.transitions
    assert control.after_step(1, 5, 0.008, tokens_left=5) is Action.EJECT  # the policy's first decision


def test_a_transition_leaves_the_stats_of_a_step_queued_ahead_alone(model, host):
    cache = target_cache(model, arena_mib(model, host, 2))
    control = DraftControl(new_draft(host), cache, Scripted(at=1, back=99))
    control.after_step(0, 5, 0.008, tokens_left=0)  # no decision after the last token
    queued = cache.stats = StepStats(h2d_bytes=123)  # the telemetry of a step already on the device
    assert control.after_step(1, 5, 0.008, tokens_left=5) is Action.EJECT
    assert cache.stats is queued and queued.h2d_bytes == 123  # the re-layout's uploads counted apart


@pytest.mark.parametrize("run_ahead", [False, True])
def test_eject_and_reenable_mid_run_stay_lossless(model, host, plain, run_ahead):
    # run_ahead (what CUDA runs): ejected rounds queue the next plain step before reading the
    # token that feeds it, the re-enable drops the step queued last; the draft queues its next
    # step before reading each draft token
    g, draft, control, cache = run_with_draft(model, host, Scripted(at=3, back=8), run_ahead=run_ahead)
    assert g.tokens == plain and cache.length == len(PROMPT) + len(plain) - 1
    # each record is its own round's, not a step queued after it: the context grows by new_tokens
    assert [r.context for r in g.records] == list(accumulate((r.new_tokens for r in g.records), initial=len(PROMPT)))[1:]
    assert [t.action for t in control.transitions] == ["eject", "reenable"]
    active = [r.draft_active for r in g.records]
    assert active[:2] == [True, True] and not any(active[3:7]) and all(active[8:])
    assert all(r.drafted == 0 for r in g.records[3:8])  # ejected: plain decoding
    assert control.transitions[0].capacity_after > control.transitions[0].capacity_before
    eject, reenable = control.transitions
    assert eject.h2d_bytes > 0 and reenable.h2d_bytes > host.nbytes and eject.seconds > 0  # resident pages re-uploaded
    history = PROMPT + g.tokens
    assert draft.fed == history[:len(draft.fed)] and len(draft.fed) > len(PROMPT) + 8  # it caught up


@dataclass
class MeasurePlainAt:
    """Ask for a plain measurement in place at step ``at`` (an eject policy for tests)."""

    at: int
    step: int = 0
    seen: list = None

    def decide(self, snap):
        self.step += 1
        self.seen = (self.seen or []) + [snap.plain_in_place]
        return Action.MEASURE_PLAIN if self.step == self.at else Action.STAY


@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_plain_measurement_in_place_keeps_the_draft_pinned_and_stays_lossless(model, host, plain, run_ahead):
    # short drafts (n_max 2): enough rounds before and after the plain batches
    g, draft, control, cache = run_with_draft(model, host, MeasurePlainAt(at=2), pages=3, n_max=2, run_ahead=run_ahead)
    assert g.tokens == plain and cache.length == len(PROMPT) + len(plain) - 1
    assert [r.context for r in g.records] == list(accumulate((r.new_tokens for r in g.records), initial=len(PROMPT)))[1:]
    n = PLAIN_CHARGED + GOODPUT_MIN  # the batches after the second's decision: plain, the draft pinned all along
    stint = g.records[2:2 + n]
    assert all(r.drafted == 0 and r.verify_width == 1 and r.draft_active for r in stint)
    assert all(r.drafted > 0 for r in g.records[:2] + g.records[2 + n:2 + n + 2])  # drafting before and after
    assert control.transitions == [] and draft.model is not None  # no eject, no re-layout
    rate, pages = control.measured[False]  # the ejected state's goodput, from the last GOODPUT_MIN of them
    assert pages == stint[-1].pages_per_layer and rate == pytest.approx(1 / median(r.step_s for r in stint[-GOODPUT_MIN:]))
    assert control.transitions_rows() == [{"step": 1, "action": "measure_plain",
                                           "pages_per_layer": g.records[1].pages_per_layer}]
    assert control.count("measure_plain") == 1 and control.count("eject") == 0
    # the policy is not asked during the plain batches, nor after the last token
    assert len(control.policy.seen) == len(g.records) - n - 1 and control.policy.seen[:2] == [True, True]
    history = PROMPT + g.tokens
    assert draft.fed == history[:len(draft.fed)] and len(draft.fed) > len(PROMPT) + 2 + n  # it caught up


def test_a_plain_measurement_fits_below_the_onset_and_measures_only_its_own_batches(model, host):
    cache = target_cache(model, arena_mib(model, host, 3))
    control = DraftControl(new_draft(host), cache, MeasurePlainAt(at=1))
    end, n = control.capacity_with * PAGE_TOKENS, PLAIN_CHARGED + GOODPUT_MIN
    assert control.snapshot(end - n - 1, tokens_left=100).plain_in_place
    # the step queued after the last plain one would stream (the draft's pool): not the ejected state
    assert not control.snapshot(end - n, tokens_left=100).plain_in_place
    assert not control.snapshot(end - n - 1, tokens_left=2 * n).plain_in_place  # too little decode left to use it
    control.meter[False].extend([(1, 0.5, 0.0)] * 8)  # an older ejected stint, at a shorter context
    length = end - 40
    assert control.after_step(0, 3, 0.008, length=length, tokens_left=100) is Action.MEASURE_PLAIN
    for i in range(n):
        assert control.plain
        assert control.after_step(1 + i, 1, 0.002, length=length + 1 + i, tokens_left=99 - i) is Action.STAY
    assert not control.plain and list(control.meter[False]) == [(1, 0.002, 0.0)] * GOODPUT_MIN
    assert control.measured[False] == (pytest.approx(500), control.capacity_with)
    # the first drafting round after it (the draft catches up on the plain tokens) is not a steady round
    kept = list(control.meter[True])
    control.after_step(n + 1, 3, 0.030, length=length + n + 3, tokens_left=80)
    control.after_step(n + 2, 3, 0.008, length=length + n + 6, tokens_left=77)
    assert list(control.meter[True]) == kept + [(3, 0.008, 0.0)]


def test_plain_measurements_are_not_offered_beside_another_speculator(model, host):
    """With an n-gram speculator in the chain the ejected state still speculates: plain steps
    would not measure it. A policy that asks anyway is a bug, reported as such."""
    cache = target_cache(model, arena_mib(model, host, 3))
    control = DraftControl(new_draft(host), cache, MeasurePlainAt(at=1), measure_in_place=False)
    assert control.snapshot(tokens_left=100).plain_in_place is False
    with pytest.raises(RuntimeError, match="asked for a plain measurement the snapshot said cannot be made"):
        for step in range(CHARGED + 2):
            control.after_step(step, 5, 0.008, tokens_left=100)


def test_a_stop_token_while_ejected_rolls_the_queued_step_back(model, host, plain):
    g, *_ = run_with_draft(model, host, Scripted(at=1, back=99), run_ahead=True)
    first_plain = 1 + g.records[0].new_tokens  # tokens from here on come from ejected rounds
    # a stop token that first appears there, after at least one queued step was used
    k = next(i for i in range(first_plain + 2, len(plain)) if plain[i] not in plain[:i])
    calls = {}
    for run_ahead in (False, True):
        counted = CountingModel(model)
        cache = target_cache(model, arena_mib(model, host, 2))
        draft = new_draft(host, run_ahead=run_ahead)
        g = speculative_generate(counted, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=8,
                                 prefill_chunk=CHUNK, control=DraftControl(draft, cache, Scripted(at=1, back=99)),
                                 stop_ids=[plain[k]], run_ahead=run_ahead)
        assert (g.tokens, g.stopped_on) == (plain[:k + 1], plain[k])
        assert cache.length == len(PROMPT) + k  # the stop token is never fed
        calls[run_ahead] = counted.calls
    assert calls[True] == calls[False] + 1  # the step queued after the stop token, rolled back


def test_onset_policy_ejects_when_the_context_outgrows_the_draft_active_pool(model, host, plain):
    # 2 resident pages per layer with the draft; the run ends in page 3: the onset is crossed
    g, draft, control, _ = run_with_draft(model, host, Onset(), pages=2)
    assert g.tokens == plain
    assert [t.action for t in control.transitions] == ["eject"]
    assert control.transitions[0].pages_per_layer == control.capacity_with + 1
    assert not g.records[-1].draft_active and g.records[-1].drafted == 0


def test_always_ejects_at_once_and_keep_pages_never_below_its_threshold(model, host, plain):
    g, _, control, _ = run_with_draft(model, host, Always())
    assert g.tokens == plain and [t.step for t in control.transitions] == [0]
    g, _, control, _ = run_with_draft(model, host, KeepPages(100))
    assert g.tokens == plain and control.transitions == []


def test_rejection_sampling_with_draft_distributions_is_lossless():
    """Draft tokens sampled from q, accepted with min(1, p/q), residual max(0, p - q): the
    first kept token follows p0, the second (after accepting d0) p1. Chi-square with 5 degrees
    of freedom, 20.5 = the 0.999 quantile (a correct sampler fails 1 run in 1000)."""
    torch.manual_seed(0)
    logits, q = torch.randn(3, 6) * 1.5, torch.softmax(torch.randn(2, 6), -1)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    g = torch.Generator().manual_seed(1)
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(30_000):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        kept = accept(logits, draft, sampler, q)
        first[kept[0]] += 1
        if len(kept) > 1:  # the first draft token was accepted: the second kept token follows p1
            second[kept[1]] += 1
    for counts, row in ((first, 0), (second, 1)):
        expected = torch.softmax(logits[row], -1) * counts.sum()
        assert float(((counts - expected) ** 2 / expected).sum()) < 20.5


def test_synthetic_acceptance_keeps_each_draft_token_with_probability_alpha():
    logits = torch.randn(5, 6)
    sampler, kept = Sampler(SamplingParams(temperature=0.0, seed=2)), 0
    n = 4000
    for _ in range(n):
        kept += len(accept(logits, [0], sampler, alpha=0.3)) - 1  # whatever the draft token is
    # binomial(4000, 0.3): sd 29; 5 sd either side
    assert abs(kept - 0.3 * n) < 5 * (n * 0.3 * 0.7) ** 0.5


def test_draft_and_ngram_chain(model, host, plain):
    cache = target_cache(model, arena_mib(model, host, 2))
    draft = new_draft(host)
    control = DraftControl(draft, cache, Never())
    chain = Chain([NgramSimple(n=3, m=8), draft])
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), chain, n_max=8, prefill_chunk=CHUNK,
                             control=control)
    assert g.tokens == plain
    assert chain.get("ngram-simple").stats.drafts > 0
    assert {r.speculator for r in g.records} <= {"ngram-simple", "draft", ""}


def test_vocabulary_mismatch_is_a_clear_error(files):
    tok = Tokenizer.from_gguf(files[0])
    with pytest.raises(VocabMismatch, match=r"356 tokens vs the target's 357|357 tokens vs the target's 356"):
        load_host(files[1], tok.token_texts[:-1], torch.float32, "cpu")
    wrong = list(tok.token_texts)
    wrong[40] = "zz"
    with pytest.raises(VocabMismatch, match="first difference at token 40"):
        load_host(files[1], wrong, torch.float32, "cpu")


def test_capacities_follow_the_phase_layout(model, host):
    """The decode layout has a smaller slab than the prefill one: the capacities the eject
    policy compares against are the current phase's, with and without the draft."""
    cache = make_cache(CacheConfig(mode="stream", ring_pages="4"), ArenaConfig(mib=str(arena_mib(model, host, 2) + 1.0)),
                       model, 4096, 128, verify_width=9)  # prefill chunks of 128: a prefill slab ~10 pairs larger
    control = DraftControl(new_draft(host), cache, Never())
    prefill_caps = (control.capacity_with, control.capacity_without)
    cache.set_phase("decode")
    assert control.capacity_with == cache.capacity > prefill_caps[0]
    with_, predicted = cache.capacity, control.capacity_without
    cache.rearrange(lambda: control.draft.eject(cache.arena))
    assert cache.capacity == predicted > with_  # the prediction was the layout's own arithmetic
    assert control.capacity_with == with_


def test_real_pair_greedy_speculation_equals_plain_decoding(qwen15_path, qwen05_path):
    """The real 1.5B target with the real 0.5B draft pinned in a streaming arena (skipped
    without both extras): greedy output identical to plain decoding, and the draft is used."""
    target = load_model(qwen15_path)
    tok = Tokenizer.from_gguf(qwen15_path)
    host = load_host(qwen05_path, tok.token_texts, torch.float32, "cpu")
    prompt = tok.encode("def binary_search(a, x):\n    \"\"\"Return the index of x in the sorted list a.\"\"\"\n")
    new = lambda pinned: make_cache(CacheConfig(mode="stream"), ArenaConfig(), target, 512, 64, verify_width=9,
                                    pinned_bytes=pinned)
    plain = generate(target, new(0), prompt, 32, Sampler(GREEDY), prefill_chunk=64).tokens
    cache, draft = new(host.nbytes + 64 * MIB), DraftModel(host, "cpu", max_tokens=512, chunk=64, p_min=0.0)
    control = DraftControl(draft, cache, Never())
    g = speculative_generate(target, cache, prompt, 32, Sampler(GREEDY), Chain([draft]), n_max=6, prefill_chunk=64,
                             control=control)
    assert g.tokens == plain
    assert draft.stats.accepted_tokens > 0 and control.bytes > host.nbytes  # weights + KV in the arena


def test_predicted_capacities_hold_with_an_automatic_ring(tmp_path, host):
    """With ring_pages=auto the ring is re-sized at every re-layout: the capacity predicted for
    the other state must be the one the re-layout then gives (no eject/re-enable thrash).
    Six layers: with two, the automatic ring is all-or-nothing and never moves."""
    from dataclasses import replace as dc_replace

    target = load_model(write_tiny_model(tmp_path / "six.gguf", dc_replace(SPEC, n_layers=6)))
    plan = ArenaPlan(reserve_slab(target, 9), 0, pair_bytes(), draft_bytes(host, max_tokens=4096))
    rings_moved = 0
    for pairs in (44, 48, 56, 64):  # page pairs beside the draft: 3..8 resident pages per layer
        cache = make_cache(CacheConfig(mode="stream", ring_pages="auto"),
                           ArenaConfig(mib=str(plan.mib(pairs))), target, 4096, CHUNK, verify_width=9)
        control = DraftControl(new_draft(host, max_tokens=4096), cache, Never())
        cache.set_phase("decode")
        predicted, ring_with = control.capacity_without, cache.ring_pages
        cache.rearrange(lambda: control.draft.eject(cache.arena))
        assert cache.capacity == predicted, pairs
        rings_moved += cache.ring_pages != ring_with
        predicted = control.capacity_with
        cache.rearrange(lambda: control.draft.pin(cache.arena))
        assert cache.capacity == predicted, pairs
    assert rings_moved  # the case the prediction must get right did occur


def test_a_stop_token_inside_an_accepted_draft_ends_the_round(model, host, plain):
    """Tokens after a stop token are neither emitted nor counted as accepted."""
    stop = plain[len(plain) // 2]
    first = plain.index(stop)
    g, draft, _, _ = run_with_draft(model, host, Never(), stop_ids=[stop])
    assert g.tokens == plain[:first + 1] and g.stopped_on == stop
    assert sum(r.new_tokens for r in g.records) == len(g.tokens) - 1
    assert draft.stats.accepted_tokens == sum(r.accepted for r in g.records)


def test_dropped_short_drafts_leave_the_draft_kv_at_the_history(host):
    d = new_draft(host, n_min=9)  # drafts of at most 6 tokens below: always dropped
    d.pin(Arena(64 * MIB, "cpu"))
    history = PROMPT[:200]
    with torch.inference_mode():
        assert d.propose(history, 6) == []
    assert d.fed == history and d.cache.length == len(history)


def test_length_and_order_policies_act_in_the_engine(model, host, plain):
    """The +2/-1 length policy changes the verify widths round to round, by_goodput re-ranks
    the chain, and the output stays plain decoding's."""
    from policies.chain_order import ByGoodput
    from policies.draft_length import Heuristic

    cache = target_cache(model, arena_mib(model, host, 2))
    draft = new_draft(host, p_min=0.0)
    control = DraftControl(draft, cache, Never())
    chain = Chain([NgramSimple(n=3, m=8), draft])
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), chain, n_max=8, prefill_chunk=CHUNK,
                             control=control, length_policy=Heuristic(n_min=1, start=2),
                             order_policy=ByGoodput(min_calls=2))
    assert g.tokens == plain
    assert len({r.verify_width for r in g.records if r.drafted}) > 1  # the length moved
    assert g.records[0].verify_width <= 3  # started at 2 draft tokens, not n_max
    # by_goodput: a drafter that takes no time and had tokens accepted ranks first; one with none
    # accepted ranks below the draft model (which accepted some): the configured order is overridden
    ngram, drafted = chain.get("ngram-simple").stats, chain.get("draft").stats
    assert ngram.accepted_tokens or drafted.accepted_tokens  # a ranking with something to rank
    assert chain.names[0] == ("ngram-simple" if ngram.accepted_tokens else "draft")


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q8_0", "q4_0")])
def test_quantized_draft_kv_stays_lossless(model, host, plain, types):
    cache = target_cache(model, arena_mib(model, host, 2, type_k=types[0], type_v=types[1]))
    draft = new_draft(host, type_k=types[0], type_v=types[1])
    control = DraftControl(draft, cache, Never())
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=8,
                             prefill_chunk=CHUNK, control=control)
    assert g.tokens == plain and draft.stats.drafts > 0
    assert draft.cache.k_fmt.kv_type.name.lower() == types[0]


def test_p_min_stops_the_draft_at_the_first_unsure_token(host):
    """Greedy drafting stops before the first token whose top probability (the draft model's
    full softmax) is below p_min. The probabilities come from the draft's weights through a
    dense fp32 cache, not from the speculator; its f16 pages move them by ~1e-3, so every
    threshold below sits at least 0.01 away from every probability. Drafting a step ahead (what
    CUDA runs: the next draft step queued before the token is read) leaves the same draft, fed
    tokens and draft KV length (a queued step past a p_min stop is rolled back)."""
    history = PROMPT[:200]

    def propose(p_min):
        out = []
        for run_ahead in (False, True):
            d = new_draft(host, p_min=p_min, sampling=GREEDY, run_ahead=run_ahead)
            d.pin(Arena(64 * MIB, "cpu"))
            with torch.inference_mode():
                out.append((d.propose(history, 8), list(d.fed), d.cache.length))
        assert out[0] == out[1]
        return out[0][0]

    full = propose(0.0)
    m = host
    with torch.inference_mode():
        ids = torch.tensor(history + full[:-1])
        logits = m(ids, m.new_cache(len(ids)), all_logits=True)[len(history) - 1:]
    top = torch.softmax(logits.float(), -1).max(-1).values.tolist()  # top[i]: before full[i] is drafted
    assert len(full) == 8 and logits.argmax(-1).tolist() == full
    if min(top) > 0.011:
        assert propose(min(top) - 0.01) == full
    assert propose(top[0] + 0.01) == []  # unsure from the start: no draft
    cuts = [j for j in range(1, 8) if top[j] < min(top[:j]) - 0.02]
    if cuts:  # a token less sure than all before it: the draft ends just before it
        j = cuts[0]
        assert propose(top[j] + 0.01) == full[:j]


@pytest.mark.parametrize("p_min", [0.0, 0.02])
def test_device_rounds_equal_plain_decoding(model, host, plain, p_min):
    """Rounds drafted, verified and accepted on the device (one readback each; what CUDA runs):
    the same tokens as plain decoding, with every round verifying 1 + n tokens and the p_min
    stop a mask (drafted counts only the unmasked prefix); the draft KV never holds a rejected
    token. p_min 0.02 masks part of the tiny models' drafts (their top probabilities spread
    around it)."""
    cache = target_cache(model, arena_mib(model, host, 2))
    draft = new_draft(host, p_min=p_min, sampling=GREEDY)
    control = DraftControl(draft, cache, Never())
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4,
                             prefill_chunk=CHUNK, control=control, device_rounds=True)
    assert g.tokens == plain
    drafting = [r for r in g.records if r.verify_width > 1]
    assert drafting and all(r.verify_width == 5 and r.drafted <= 4 and r.accepted <= r.drafted for r in drafting)
    if p_min:
        assert any(r.drafted < 4 for r in drafting) and any(r.drafted > 0 for r in drafting)
    assert draft.fed == (PROMPT + g.tokens)[:len(draft.fed)]
    assert draft.stats.drafted_tokens == sum(r.drafted for r in g.records)


@pytest.mark.parametrize("alpha, p_min", [(None, 0.02), (0.5, 0.0)])
def test_device_rounds_through_the_acceptance_kernel(model, host, alpha, p_min, monkeypatch):
    """The round's acceptance by ``kernels.accept`` (CUDA's path, here under the interpreter) against
    the torch expression (the CPU's): the same tokens and per-round counts, p_min's masks and
    synthetic draws included."""
    from kvstream.engine import speculative
    from kernels.accept import scratch_for

    if torch.cuda.is_available():  # (the interpreter runs it on these CPU tensors only where it is on)
        pytest.skip("the kernel on CPU tensors needs the Triton interpreter; on CUDA test_cuda's device rounds run it")

    def decode():
        cache = target_cache(model, arena_mib(model, host, 2))
        draft = new_draft(host, p_min=p_min, sampling=GREEDY)
        g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4,
                                 prefill_chunk=CHUNK, control=DraftControl(draft, cache, Never()), device_rounds=True,
                                 synthetic_acceptance=alpha)
        return g.tokens, [(r.verify_width, r.drafted, r.accepted) for r in g.records]

    torch_ops = decode()
    init = speculative._DeviceRound.__init__

    def with_kernel(self, device, n_max):
        init(self, device, n_max)
        self.scratch = scratch_for(1 + n_max, device)

    monkeypatch.setattr(speculative._DeviceRound, "__init__", with_kernel)
    assert decode() == torch_ops and any(d > a for _, d, a in torch_ops[1])


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_device_rounds_with_synthetic_acceptance_match_the_host_rounds(model, host, alpha):
    """Synthetic acceptance 1 (a perfect draft) keeps every draft token and 0 none, on the
    device as on the host: the same tokens either way (the timing studies' setting)."""
    out = []
    for device_rounds in (False, True):
        cache = target_cache(model, arena_mib(model, host, 2))
        draft = new_draft(host, p_min=0.0, sampling=GREEDY, run_ahead=False)
        g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4,
                                 prefill_chunk=CHUNK, control=DraftControl(draft, cache, Never()),
                                 synthetic_acceptance=alpha, device_rounds=device_rounds)
        out.append((g.tokens, [(r.drafted, r.accepted) for r in g.records]))
    assert out[0] == out[1]


def test_device_rounds_survive_an_eject_and_a_reenable(model, host, plain):
    """A device round after a re-enable catches the draft up on what the target decoded while it
    was ejected (a catch-up wider than a decode step runs on the host, then rounds go back to
    the device); the tokens stay plain decoding's."""
    g, draft, control, _ = run_with_draft(model, host, Scripted(at=4, back=9), device_rounds=True)
    assert g.tokens == plain and [t.action for t in control.transitions] == ["eject", "reenable"]
    assert any(not r.draft_active for r in g.records) and draft.stats.drafts > 0
    assert draft.fed == (PROMPT + g.tokens)[:len(draft.fed)]


class Alternating:
    """A length policy of 2, 4, 2, 4, ... drafted tokens."""

    def decide(self, snap) -> int:
        return 4 if snap.current == 2 else 2


def count_cancels(spec) -> list[int]:
    """The drafted lengths of the rounds ``spec`` drops (``cancel_device_round``), recorded as they go."""
    cancelled, cancel = [], type(spec).cancel_device_round
    spec.cancel_device_round = lambda: (cancelled.append(spec._round), cancel(spec))
    return cancelled


@pytest.mark.parametrize("policy", ["length", "eject"])
def test_the_next_round_launched_ahead_of_the_bookkeeping(model, host, plain, policy):
    """The engine launches the next device round's draft as soon as a round's readback is read, with
    the length the policy just gave (2, 4, 2, ...: each round as decided, none dropped), before the
    round's telemetry and the eject policy; an eject there drops it (``cancel_device_round``: its
    drafted rows roll back). The tokens stay plain decoding's and the draft counts only the
    verified rounds."""
    draft = new_draft(host, sampling=GREEDY)
    cancelled = count_cancels(draft)
    cache = target_cache(model, arena_mib(model, host, 2))
    control = DraftControl(draft, cache, Never() if policy == "length" else Scripted(at=4, back=9))
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4, prefill_chunk=CHUNK,
                             control=control, device_rounds=True,
                             length_policy=Alternating() if policy == "length" else None)
    assert g.tokens == plain
    widths = [r.verify_width for r in g.records if r.verify_width > 1]
    assert draft.stats.calls == len(widths) and draft.fed == (PROMPT + g.tokens)[:len(draft.fed)]
    if policy == "length":
        assert set(widths) == {3, 5} and all(a != b for a, b in zip(widths, widths[1:])) and cancelled == []
    else:
        assert [t.action for t in control.transitions] == ["eject", "reenable"] and cancelled == [4]


def test_a_device_round_reads_the_device_once(model, host, plain, monkeypatch):
    """One host read per drafting round (the accepted count and tokens together), none for the
    draft tokens themselves: every Readback.read of the decode is a round's."""
    from kvstream.engine.readback import Readback

    reads = []
    read = Readback.read
    monkeypatch.setattr(Readback, "read", lambda self: reads.append(self.host.shape) or read(self))
    cache = target_cache(model, arena_mib(model, host, 2))
    draft = new_draft(host, p_min=0.0, sampling=GREEDY)
    g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4, prefill_chunk=CHUNK,
                             control=DraftControl(draft, cache, Never()), device_rounds=True, run_ahead=False)
    assert g.tokens == plain
    assert len(reads) == sum(r.verify_width == 5 for r in g.records) and set(reads) == {(2 * 4 + 3,)}


@pytest.mark.parametrize("alpha, p_min", [(None, 0.0), (0.5, 0.0), (None, 0.1)])
def test_a_device_round_stages_the_drafts_next_round_before_its_readback(model, host, plain, alpha, p_min,
                                                                          monkeypatch):
    """``DraftModel.prepare``: before a round's readback the device stages the next round's catch-up
    ids and the draft cache's pass at the length after the accepted drafts' rows, which the host
    learns only from the readback; after it the host stages nothing but the round's launch. Every
    chain starts from the ids of the history's next tokens (checked before each), and the decode
    with ``prepare`` off gives the same tokens and per-round counts (real acceptance: plain
    decoding's; alpha 0.5: one- and two-token catch-ups; p_min 0.02: rounds with every draft
    masked), with the ids and the draft cache's staging the host did after each readback gone from
    all rounds but the first (and the pass's where a page of the draft cache opens)."""
    from kvstream.cache.paged import PagedCache

    def decode(prepare: bool):
        counts, stage, stage_step = {"ids": 0, "widths": [], "plans": 0}, DraftModel._stage, PagedCache._stage_step
        cache = target_cache(model, arena_mib(model, host, 2))
        draft = new_draft(host, p_min=p_min, sampling=GREEDY, run_ahead=False)

        def ids(self, tokens):
            counts["ids"] += 1
            return stage(self, tokens)

        def step(self, n):
            counts["passes"] = counts.get("passes", 0) + (self is draft.cache)
            return stage_step(self, n)

        propose, run_chain = draft.propose_device, draft._run_chain

        def spy(history, n):
            counts["widths"].append(len(history) - len(draft.fed))
            counts["history"], version = history, draft.cache._tables_version
            out = propose(history, n)
            counts["plans"] += draft.cache._tables_version != version  # a page opened
            return out

        def chain(w, n):  # the ids a chain starts from: the history's next w tokens, however staged
            assert draft._ids.dst[:w].tolist() == counts["history"][len(draft.fed):len(draft.fed) + w]
            return run_chain(w, n)

        draft.propose_device, draft._run_chain = spy, chain
        with monkeypatch.context() as m:
            m.setattr(DraftModel, "_fits_ahead", lambda *a: False)  # (launched ahead: the test above)
            m.setattr(DraftModel, "_stage", ids)
            m.setattr(PagedCache, "_stage_step", step)
            if not prepare:
                m.delattr(DraftModel, "prepare")
            g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4,
                                     prefill_chunk=CHUNK, control=DraftControl(draft, cache, Never()),
                                     synthetic_acceptance=alpha, device_rounds=True)
        if alpha is None:
            assert g.tokens == plain
        assert draft.fed == (PROMPT + g.tokens)[:len(draft.fed)]
        if prepare:  # a next request stages its own first round: nothing of this one's is taken for it
            draft.begin(PROMPT + g.tokens)
            assert draft._prepared is None
        return g, counts, draft.stats.calls

    (g, on, rounds), (g_off, off, rounds_off) = decode(True), decode(False)
    assert g.tokens == g_off.tokens and [(r.drafted, r.accepted) for r in g.records] == \
        [(r.drafted, r.accepted) for r in g_off.records]
    assert rounds == rounds_off >= 8 and on["widths"] == off["widths"]
    if alpha is not None:
        assert {1, 2} <= set(on["widths"][1:])  # both catch-up widths were staged on the device
    if p_min:
        assert any(r.drafted == 0 for r in g.records[1:])  # rounds whose drafts were all masked
    assert off["ids"] - on["ids"] == rounds - 1  # every round's ids but the first's: staged by prepare
    # and its pass of the draft cache, but where a page of it opens (new tables: staged anew)
    assert off["passes"] - on["passes"] == rounds - 1 - on["plans"] and on["plans"] == off["plans"]


@pytest.mark.parametrize("alpha, p_min", [(None, 0.0), (0.5, 0.0), (1.0, 0.0), (None, 0.1)])
def test_the_drafts_next_round_launches_before_the_readback(model, host, plain, alpha, p_min, monkeypatch):
    """Device rounds with a fixed draft length: the draft's next round is launched right after
    ``prepare``, before the round's readback (``propose_ahead``), its catch-up the two rows before
    and at the target's token, at positions only the device knows. Every round runs so but the
    first, the last few and those whose pass would open a page of the draft's KV. The tokens and the
    per-round counts are those of the same decode launching after each readback (real acceptance:
    plain decoding's; alpha 0.5: both catch-up widths; p_min 0.1: rounds with every draft masked),
    the draft's history is the output's, and its KV holds that history (a next token's logits are a
    fresh draft's that read it, within fp32 sum order: a re-fed row is a two-row pass's). A length
    policy that reads the rounds launches none."""
    from policies.draft_length import Heuristic

    def decode(ahead: bool, length_policy=None):
        launched, propose_ahead = [], DraftModel.propose_ahead
        cache = target_cache(model, arena_mib(model, host, 2))
        draft = new_draft(host, p_min=p_min, sampling=GREEDY)
        with monkeypatch.context() as m:
            m.setattr(DraftModel, "propose_ahead", lambda self, n: launched.append(propose_ahead(self, n)) or launched[-1])
            if not ahead:
                m.setattr(DraftModel, "_fits_ahead", lambda self, at, n, k: False)
            g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=4,
                                     prefill_chunk=CHUNK, control=DraftControl(draft, cache, Never()),
                                     synthetic_acceptance=alpha, device_rounds=True, length_policy=length_policy)
        assert draft.fed == (PROMPT + g.tokens)[:len(draft.fed)] and draft.cache.length == len(draft.fed)
        return g, draft, [out is not None for out in launched]

    (g, draft, launched), (g_off, _, off) = decode(True), decode(False)
    rounds = sum(r.verify_width > 1 for r in g.records)
    assert g.tokens == g_off.tokens and (alpha is not None or g.tokens == plain) and not any(off)
    assert [(r.drafted, r.accepted) for r in g.records] == [(r.drafted, r.accepted) for r in g_off.records]
    assert draft.stats.calls == rounds and draft.stats.drafted_tokens == sum(r.drafted for r in g.records)
    opened = draft.cache.length // 256 - len(PROMPT) // 256  # the draft's KV pages opened while decoding
    assert rounds - (1 + 5 + 9 * opened) <= sum(launched) < rounds, (launched, rounds, opened)
    if p_min:
        assert any(r.drafted == 0 for r in g.records[1:])
    fresh = new_draft(host, sampling=GREEDY)  # the KV rows the history makes, fed in chunks
    fresh.pin(Arena(64 * MIB, "cpu"))
    with torch.inference_mode():
        fresh._feed(draft.fed)
        a, b = draft.model(torch.tensor([7]), draft.cache)[-1], fresh.model(torch.tensor([7]), fresh.cache)[-1]
    # other batches, so other fp32 sum orders: at most 2.3e-6 of logits up to ~3 in these 8 cases
    assert torch.allclose(a, b, rtol=0, atol=1e-4)
    g, _, launched = decode(True, Heuristic(n_min=1, start=2))
    assert (alpha is not None or g.tokens == plain) and launched == []


@pytest.mark.parametrize("n_max", [4, 15])
def test_a_device_round_is_one_pass_of_the_draft_cache(model, host, n_max, monkeypatch):
    """A device round's catch-up and its n - 1 draft steps are one ``begin`` / ``commit`` of the
    draft's cache (``DraftModel._run_chain``; on CUDA one captured graph): with a perfect draft
    (synthetic acceptance 1) a round catches up 2 tokens (its last draft, the target's next), 15
    draft tokens included. The tokens and the per-round counts are the host rounds'."""
    from kvstream.cache.paged import PagedCache

    out = []
    real_begin = PagedCache.begin
    monkeypatch.setattr(DraftModel, "_fits_ahead", lambda *a: False)  # rounds launched after each readback
    for device_rounds in (False, True):
        cache = target_cache(model, arena_mib(model, host, 3), verify_width=1 + n_max)  # (a wider slab)
        draft = new_draft(host, p_min=0.0, sampling=GREEDY, run_ahead=False)
        passes, rounds = [], []
        monkeypatch.setattr(PagedCache, "begin", lambda self, n: (self is draft.cache and passes.append(n))
                            or real_begin(self, n))
        propose = draft.propose_device

        def spy(history, n):
            passes.clear()
            got = propose(history, n)
            rounds.append((list(passes), n))
            return got

        draft.propose_device = spy
        g = speculative_generate(model, cache, PROMPT, NEW, Sampler(GREEDY), Chain([draft]), n_max=n_max,
                                 prefill_chunk=CHUNK, control=DraftControl(draft, cache, Never()),
                                 synthetic_acceptance=1.0, device_rounds=device_rounds)
        out.append((g.tokens, [(r.drafted, r.accepted) for r in g.records]))
    assert out[0] == out[1] and len(rounds) > 2
    assert all(p == [w + n - 1] and 1 <= w <= 2 for p, n in rounds[1:] for w in [p[0] - n + 1]), rounds


def test_a_device_round_too_wide_for_one_pass_feeds_its_catch_up_first(host):
    """A catch-up of 7 tokens (``begin`` reads all of its prompt but the last) before 15 draft
    steps (21 rows, more than a pass's 16): the first 6 are fed in a pass of their own and the
    chain starts from the last; the draft is the host
    path's greedy draft token for token, and the draft KV holds the history and 14 drafts."""
    from kvstream.cache.paged import PagedCache

    history = PROMPT[:200]
    drafts = []
    for device in (False, True):
        d = new_draft(host, p_min=0.0, sampling=GREEDY, run_ahead=False)
        d.pin(Arena(64 * MIB, "cpu"))
        passes, begin = [], d.cache.begin
        d.cache.begin = lambda n: passes.append(n) or begin(n)
        with torch.inference_mode():
            d.begin(history[:-6])
            passes.clear()
            if device:
                tokens, valid = d.propose_device(history, 15)
                assert bool(valid.all()) and passes == [6, 15], passes
                assert d.cache.length == len(history) + 14
                drafts.append(tokens.tolist())
            else:
                drafts.append(d.propose(history, 15))
    assert len(drafts[0]) == 15 and drafts[0] == drafts[1]


def test_seen_compares_only_what_is_new_and_agrees_with_a_whole_compare(host):
    """``DraftModel._seen`` (how much of ``fed`` is the history's) on the engine's one growing list
    compares from its last check on; through real feeds of the history's tokens and of drafts that
    differ from it, truncations below the last check and appends to the history, it always equals a
    whole-list compare, and a new list is compared whole."""
    from kvstream.speculators.draft import _common_prefix

    rng = torch.Generator().manual_seed(7)
    rand = lambda hi: int(torch.randint(0, hi, (), generator=rng))
    d = new_draft(host, sampling=GREEDY)
    d.pin(Arena(64 * MIB, "cpu"))
    history = list(PROMPT[:64])
    with torch.inference_mode():
        d.begin(history)
        for _ in range(300):
            op = rand(4)
            if op == 0:  # the engine kept tokens
                history.extend(rand(357) for _ in range(1 + rand(3)))
            elif op == 1 and len(d.fed) < len(history):  # the draft catches up
                d._feed(history[len(d.fed):len(d.fed) + 1 + rand(3)])
            elif op == 2:  # drafted tokens, not the history's
                d._feed([rand(357) for _ in range(1 + rand(3))])
            else:  # a rollback of up to 4 tokens, below the last check too
                d._truncate(max(0, len(d.fed) - 1 - rand(4)))
            if rand(3) == 0:  # several changes between two checks too
                assert d._seen(history) == _common_prefix(d.fed, history), (op, len(d.fed), len(history))
        other = list(history)
        other[rand(len(other))] = 1000  # the same tokens but one, in another list: compared whole
        assert d._seen(other) == _common_prefix(d.fed, other)
        d._truncate(_common_prefix(d.fed, history))  # the draft holds the whole history: checked to its end
        d._feed(history[len(d.fed):])
        assert d._seen(history) == len(history) == len(d.fed)
        del history[-5:]  # the same list, shorter than the last check: compared whole
        assert d._seen(history) == _common_prefix(d.fed, history) == len(history)
