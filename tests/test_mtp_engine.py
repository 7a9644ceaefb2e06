"""The MTP head as a speculator (spec.type=mtp) on a tiny random target: lossless greedy drafting
on the host and on the device, pinned in the arena and ejectable, from the config through the
runner, in a chain, and the config's checks."""

from __future__ import annotations

import pytest
import torch

from kvstream.cache.arena import MIB, ArenaPlan
from kvstream.cache.factory import make_cache, phase_slabs
from kvstream.config import ArenaConfig, CacheConfig, GenerateConfig, ModelSource, MTPConfig, SpecConfig
from kvstream.engine.draft_control import DraftControl
from kvstream.engine.generate import generate
from kvstream.engine.runner import run_decode
from kvstream.engine.speculative import speculative_generate
from kvstream.model.mtp import MTPHead
from kvstream.model.mtp_gguf import write_head
from kvstream.model.qwen import load_model
from kvstream.model.registry import sha256_file
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.model.tokenizer import Tokenizer
from kvstream.speculators.chain import Chain
from kvstream.speculators.mtp import MTPDraft
from policies.eject import Never
from test_draft import Scripted
from test_paged_cache import SPEC, pair_bytes
from tiny_gguf import write_tiny_model

GREEDY = SamplingParams(temperature=0.0)
PROMPT = torch.randint(0, 357, (700,), generator=torch.Generator().manual_seed(11)).tolist()
NEW, CHUNK = 40, 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_engine")
    target = write_tiny_model(tmp / "t.gguf", SPEC)
    head = MTPHead(load_model(target), seed=2)
    write_head(tmp / "head.gguf", head, sha256_file(target), {"command": "test", "tokens_seen": 0}, "f32")
    return target, tmp / "head.gguf"


@pytest.fixture(scope="module")
def eagle3_files(files, tmp_path_factory):
    """The target and a random head that reads two of its streams (EAGLE-3's form): entering block 1
    and after the last block."""
    target = load_model(files[0])
    head = MTPHead(target, seed=3, features=(1, target.cfg.n_layers))
    path = tmp_path_factory.mktemp("eagle3") / "head.gguf"
    write_head(path, head, sha256_file(files[0]), {"command": "test", "tokens_seen": 0}, "f32")
    return files[0], path


@pytest.fixture(scope="module")
def model(files):
    return load_model(files[0])


@pytest.fixture(scope="module")
def plain(model):
    return plain_tokens(model, NEW)


def plain_tokens(model, new: int) -> list[int]:
    """Plain greedy decoding of ``new`` tokens after PROMPT, the reference every drafted decode equals."""
    cache = make_cache(CacheConfig(mode="resident"), ArenaConfig(), model, 1024, CHUNK)
    return generate(model, cache, PROMPT, new, Sampler(GREEDY), prefill_chunk=CHUNK).tokens


def run_mtp(model, files, policy=None, device_rounds=False, n_max=4, chain=None, step=None, head_graphs=False,
            run_ahead=None, alpha=None, new=NEW, p_min=0.0, on_draft=None, length_policy=None):
    """A greedy decode with the head pinned in a stream cache's arena (``step``: the model, or a
    GraphedModel of it; ``head_graphs``: the head's steps captured, CUDA; ``alpha``: synthetic
    acceptance, ``new`` tokens, the head's ``p_min``)."""
    from kvstream.engine.runner import mtp_head
    head = mtp_head(str(files[1]), model, str(files[0]))
    mtp = MTPDraft(head, model.device, max_tokens=1024, graphs=head_graphs, max_width=1 + n_max, p_min=p_min)
    # an arena whose decode layout, the head pinned, holds 2 pages per layer: the decode streams
    cc = CacheConfig(mode="stream", ring_pages="4")
    slabs = phase_slabs(cc, model, 2048, CHUNK, 1 + n_max)
    nbytes = max(ArenaPlan(slabs[phase], 4, pair_bytes(), mtp.estimated_bytes()).bytes(SPEC.n_layers * 2)
                 for phase in ("prefill", "decode"))
    cache = make_cache(cc, ArenaConfig(str(nbytes / MIB)), model, 2048, CHUNK, verify_width=1 + n_max)
    chain = Chain([mtp]) if chain is None else Chain(chain(mtp))
    control = DraftControl(mtp, cache, policy or Never(), measure_in_place=len(chain) == 1)
    if on_draft is not None:  # (a test's hook on the speculator)
        on_draft(mtp)
    g = speculative_generate(step or model, cache, PROMPT, new, Sampler(GREEDY, model.device), chain, n_max=n_max,
                             prefill_chunk=CHUNK, control=control, device_rounds=device_rounds, run_ahead=run_ahead,
                             synthetic_acceptance=alpha, length_policy=length_policy)
    return g, mtp, control, cache


@pytest.mark.parametrize("device_rounds", [False, True])
def test_greedy_with_an_mtp_head_equals_plain_decoding(model, files, plain, device_rounds):
    """The head drafts from the target's hidden states (prefill chunks, then each round's kept rows)
    and its drafts are verified: the tokens are plain decoding's. Its KV holds one row per
    committed position after the first (drafted rows rolled back)."""
    g, mtp, control, cache = run_mtp(model, files, device_rounds=device_rounds)
    assert g.tokens == plain
    assert mtp.stats.drafts > 0 and all(r.draft_active for r in g.records)
    # only committed rows (drafted ones rolled back), at most one round's kept rows behind the target
    assert mtp.cache.length == mtp.committed and 0 <= cache.length - mtp.cache.length <= 1 + 4


@pytest.mark.parametrize("device_rounds", [False, True])
def test_a_head_reading_several_target_streams_drafts_losslessly(model, eagle3_files, plain, device_rounds):
    """An EAGLE-3-style head (the streams entering blocks 1 and n_layers, fused): the engine hands it
    those streams from every pass (prefill chunks, verify batches, the states kept while ejected:
    an eject and re-enable mid-run), and the tokens stay plain decoding's (that its drafts are the
    head's own chain over those streams: the next test's EAGLE-3 case)."""
    g, mtp, control, cache = run_mtp(model, eagle3_files, policy=Scripted(at=3, back=8), device_rounds=device_rounds)
    assert g.tokens == plain and mtp.wants_hidden == (1, model.cfg.n_layers) and mtp.stats.drafts > 0
    assert [t.action for t in control.transitions] == ["eject", "reenable"]
    assert mtp.cache.length == mtp.committed  # its KV caught up with every committed row after the re-enable


def test_an_mtp_draft_refuses_states_of_other_streams(model, eagle3_files):
    """Rows of the last stream handed to a head that reads two would pass for its own chained
    states: ``observe`` refuses them, naming the streams to pass."""
    from kvstream.cache.arena import Arena
    from kvstream.engine.runner import mtp_head
    mtp = MTPDraft(mtp_head(str(eagle3_files[1]), model, str(eagle3_files[0])), "cpu", max_tokens=1024)
    mtp.pin(Arena(64 * MIB, "cpu"))
    with pytest.raises(ValueError, match=rf"streams \(1, {model.cfg.n_layers}\).*rows of {model.cfg.hidden}: pass hidden="):
        mtp.observe(torch.zeros(3, model.cfg.hidden), [1, 2, 3], 0)


def test_the_head_lives_in_the_arena_and_an_eject_gives_its_bytes_to_the_pages(model, files, plain):
    """Pinned: its own weights and its KV pages are views into the target's arena, and they count
    against the pages the target can keep resident; an eject and a re-enable mid-run leave the
    tokens plain decoding's."""
    g, mtp, control, cache = run_mtp(model, files, policy=Scripted(at=3, back=8))
    assert g.tokens == plain and [t.action for t in control.transitions] == ["eject", "reenable"]
    lo, hi = cache.arena.buf.data_ptr(), cache.arena.buf.data_ptr() + cache.arena.nbytes
    assert all(lo <= p.data_ptr() < hi for p in mtp.head.parameters())
    assert control.capacity_without > control.capacity_with
    assert mtp.host_nbytes + mtp._kv_bytes() <= mtp.pinned_bytes <= mtp.estimated_bytes()  # the estimate holds


def test_an_mtp_head_in_a_chain_with_an_ngram_drafter(model, files, plain):
    from kvstream.speculators.ngram_simple import NgramSimple
    g, mtp, *_ = run_mtp(model, files, chain=lambda mtp: [NgramSimple(), mtp])
    assert g.tokens == plain and mtp.stats.calls > 0


def test_spec_type_mtp_through_the_runner(model, files, plain):
    cfg = GenerateConfig(model=ModelSource(str(files[0])), cache=CacheConfig(mode="stream", ring_pages="4"),
                         spec=SpecConfig(type="mtp", n_max=4, mtp=MTPConfig(source=str(files[1]))),
                         prompt="x", max_new_tokens=NEW, ignore_eos=True, prefill_chunk=CHUNK)
    from kvstream.model.loader import open_gguf
    res = run_decode(cfg, model, Tokenizer.from_gguf(open_gguf(files[0])), PROMPT)
    assert res.generation.tokens == plain and res.chain.get("mtp").stats.drafts > 0 and res.control is not None


@pytest.mark.parametrize("kw, message", [
    (dict(type="mtp"), r"spec.mtp.source is not set"),
    (dict(type="draft,mtp", mtp=MTPConfig(source="h.gguf")), r"one pinned drafter at a time"),
    (dict(type="mtp", mtp=MTPConfig(source="h.gguf", p_min=2.0)), r"spec.mtp.p_min=2.0"),
])
def test_the_mtp_config_is_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**kw)


def test_the_first_draft_is_the_heads_chain_over_the_prompts_rows(model, files):
    """What the head is fed is its definition's rows: after the prefill (chunks observed) the
    first draft equals ``MTPHead.draft`` run once over every prompt row (h_t, x_{t+1}), the
    last one's token being the first sampled, with a fresh dense cache (fp32 here: the head's
    f16 pages move its logits by ~1e-3, below the tiny model's top-1 gaps on this prompt)."""
    from kvstream.cache.arena import Arena
    from kvstream.engine.generate import prefill
    from kvstream.engine.runner import mtp_head

    head = mtp_head(str(files[1]), model, str(files[0]))
    mtp = MTPDraft(head, "cpu", max_tokens=1024)
    mtp.pin(Arena(64 * MIB, "cpu"))
    hs = []
    with torch.inference_mode():
        logits = prefill(model, make_cache(CacheConfig(mode="resident"), ArenaConfig(), model, 1024, CHUNK), PROMPT,
                         CHUNK, observe=lambda h, toks, start: (hs.append(h), mtp.observe(h, toks, start)))
        first = int(logits.argmax())
        got = mtp.propose(PROMPT + [first], 4)
        want = head.draft(torch.cat(hs), torch.tensor(PROMPT[1:] + [first]), torch.arange(1, len(PROMPT) + 1), 4,
                          head.new_cache(len(PROMPT) + 8, torch.float32))
    assert len(hs) == -(-len(PROMPT) // CHUNK) and got == want.tolist()


@pytest.mark.parametrize("case", [
    {}, {"policy": True}, {"policy": True, "run_ahead": True}, {"policy": True, "eagle3": True},
    {"device_rounds": True}, {"device_rounds": True, "policy": True, "eagle3": True},
    {"device_rounds": True, "alpha": 0.7, "new": 150}, {"device_rounds": True, "p_min": 0.05}],
    ids=["kept", "ejected and re-enabled", "ejected, plain steps run ahead", "EAGLE-3 head",
         "device rounds (feeds staged before the readback)", "device rounds, EAGLE-3 head, ejected and re-enabled",
         "device rounds, several kept rows a round (synthetic acceptance), past a page of the head's KV",
         "device rounds, p_min: rounds whose drafts are all masked"])
def test_every_rounds_draft_is_the_heads_chain_over_the_committed_rows(model, files, eagle3_files, monkeypatch, case):
    """Each round, not only the first, and after an eject and a re-enable (the rows of the tokens
    decoded while ejected made from the states kept on the host): the draft equals ``MTPHead.draft`` run from scratch over
    every committed row (a fresh dense head cache; the target's hidden states recomputed in one
    pass through a cache of the engine's page types, q8_0 / q4_0: a dense target cache's states
    differ enough to flip later drafts of this random head), so the rows fed after each
    verification and their positions (``HeadStep.offset``) are the definition's. Device rounds
    stage each next feed before the readback (``prepare``): with synthetic acceptance a round keeps
    several rows (the drafts, then the target's token), and 150 tokens take the head's KV past a
    page; with ``p_min`` some rounds draft nothing valid, and their drafted rows must still go."""
    from kvstream.engine.speculative import _DeviceRound

    policy, eagle3 = case.get("policy"), case.get("eagle3")
    rounds, draft, verify = [], MTPDraft._draft, _DeviceRound.run

    def spy(self, history, n):
        out = draft(self, history, n)
        if out is not None:
            rounds.append((list(history), out[0].tolist()))
        return out

    def ahead(self, model, cache, chain, history, n, *a):  # a round launched before the last one's readback
        pending = self.pending  # (``propose_ahead``): its history is known at its verify
        if pending is not None and pending[5] is not None and pending[0] == n:
            rounds.append((list(history), pending[4][0].tolist()))
        return verify(self, model, cache, chain, history, n, *a)

    monkeypatch.setattr(MTPDraft, "_draft", spy)
    monkeypatch.setattr(_DeviceRound, "run", ahead)
    policy = Scripted(at=3, back=12) if policy else None
    g, mtp, control, _ = run_mtp(model, eagle3_files if eagle3 else files, policy=policy,
                                 **{k: v for k, v in case.items() if k not in ("policy", "eagle3")})
    assert len(rounds) >= 8 and [t.action for t in control.transitions] == (["eject", "reenable"] if policy else [])
    if "alpha" in case:  # several rows kept a round, and the head's KV past its first page (256 x 3 rows)
        assert max(r.accepted for r in g.records) >= 2 and mtp.cache.length > 768
    if "p_min" in case:
        assert any(r.drafted == 0 and r.speculator == "mtp" for r in g.records)
    for history, got in rounds:
        n = len(history)
        with torch.inference_mode():
            dense = make_cache(CacheConfig(mode="resident"), ArenaConfig(), model, n, CHUNK)
            _, h = model(torch.tensor(history[:-1]), dense, all_logits=True, hidden=mtp.head.features)
            want = mtp.head.draft(h, torch.tensor(history[1:]), torch.arange(1, n), len(got),
                                  mtp.head.new_cache(n + 8, torch.float32))
        assert got == want.tolist(), (n, got, want.tolist())


def test_a_device_round_stages_the_heads_next_feed_before_its_readback(model, files, plain, monkeypatch):
    """Device rounds: ``prepare`` stages the next round's feed (the kept rows' states and tokens,
    taken on the device; the pass's positions and slots) before the round's readback, so after it
    the head stages nothing but the round's launch. The same decode with ``prepare`` off stages
    each round after its readback; both give plain decoding's tokens, and the host staging the
    readback waited for is gone from all rounds but the first."""
    from kvstream.cache.paged import PagedCache

    def staged(prepare: bool):
        counts, stage, stage_step = {"feeds": 0}, MTPDraft._stage, PagedCache._stage_step

        def feed(self, *a):
            counts["feeds"] += 1
            return stage(self, *a)

        def step(self, n):
            counts[id(self)] = counts.get(id(self), 0) + 1
            return stage_step(self, n)

        with monkeypatch.context() as m:
            m.setattr(MTPDraft, "_stage", feed)
            m.setattr(PagedCache, "_stage_step", step)
            if not prepare:
                m.delattr(MTPDraft, "prepare")
            g, mtp, *_ = run_mtp(model, files, device_rounds=True)
        assert g.tokens == plain
        return counts["feeds"], counts[id(mtp.cache)], mtp.stats.calls

    feeds, steps, rounds = staged(True)
    feeds_off, steps_off, rounds_off = staged(False)
    assert rounds == rounds_off >= 8
    assert feeds_off - feeds == rounds - 1  # every round's own staging but the first's: done by prepare
    assert steps == steps_off + 1  # a pass staged per round all the same (ahead), and the last round's unused


def test_rows_observed_before_the_heads_first_draft_are_all_fed(model, files):
    """Round 1 won by another speculator (or a plain round): the head observes that round's row
    before it first drafts, while the prompt's last row still waits for its token. Both rows are
    fed, with the history's tokens: the draft equals ``MTPHead.draft`` over every row. (A prompt
    whose last chunk is 10 rows: a decode-width feed, which missed a token before the fix.)"""
    prompt = PROMPT[:650]
    from kvstream.cache.arena import Arena
    from kvstream.engine.generate import prefill
    from kvstream.engine.runner import mtp_head

    head = mtp_head(str(files[1]), model, str(files[0]))
    mtp = MTPDraft(head, "cpu", max_tokens=1024)
    mtp.pin(Arena(64 * MIB, "cpu"))
    hs = []
    with torch.inference_mode():
        cache = make_cache(CacheConfig(mode="resident"), ArenaConfig(), model, 1024, CHUNK)
        logits = prefill(model, cache, prompt, CHUNK,
                         observe=lambda h, toks, start: (hs.append(h), mtp.observe(h, toks, start)))
        first = int(logits.argmax())
        cache.set_phase("decode")
        step_logits, h = model(torch.tensor([first]), cache, all_logits=True, hidden=True)
        second = int(step_logits[-1].argmax())
        mtp.observe(h, [second], len(prompt))
        got = mtp.propose(prompt + [first, second], 4)
        want = head.draft(torch.cat(hs + [h]), torch.tensor(prompt[1:] + [first, second]),
                          torch.arange(1, len(prompt) + 2), 4, head.new_cache(len(prompt) + 8, torch.float32))
    assert got == want.tolist()


def test_host_rows_keep_runs_of_positions_across_blocks(monkeypatch):
    """The ejected head's backlog: rows across block boundaries come back in order, as runs of
    consecutive positions (a gap starts a new run), and the store empties for reuse."""
    from kvstream.speculators import host_rows

    monkeypatch.setattr(host_rows, "BLOCK", 3)
    store = host_rows.HostRows(4, torch.float32, pin=False)
    rows = torch.randn(9, 4)
    store.add(rows[:2], 10)
    store.add(rows[2:7], 12)  # continues the run, over two block boundaries
    store.add(rows[7:], 30)  # a gap
    runs = store.take(torch.device("cpu"))
    assert [s for s, _ in runs] == [10, 30] and not store and len(store.blocks) == 3
    assert torch.equal(runs[0][1], rows[:7]) and torch.equal(runs[1][1], rows[7:])
    store.add(rows[:1], 5)  # reused: the first block again
    assert torch.equal(store.take(torch.device("cpu"))[0][1], rows[:1]) and len(store.blocks) == 3


def test_a_rounds_feed_and_draft_steps_are_one_pass_of_the_heads_cache(model, files, plain, monkeypatch):
    """A round's feed and its n - 1 draft steps run as one pass (one ``begin`` / ``commit`` of the
    head's cache: on CUDA one captured graph, ``MTPDraft._run_chain``). A feed too wide for that
    pass (the first round's: the prompt's last chunk) has all but its last row fed first, in a
    pass of their own, and the chain starts from that last row. The output is plain decoding's."""
    from kvstream.cache.paged import PagedCache
    from kvstream.speculators.mtp import CHAIN_ROWS

    begins, seen = [], []
    real_begin, draft = PagedCache.begin, MTPDraft._draft
    monkeypatch.setattr(PagedCache, "begin", lambda self, n: begins.append(n) or real_begin(self, n))

    def spy(self, history, n):  # the passes the head's cache makes in each round's drafting
        begins.clear()
        out = draft(self, history, n)
        seen.append((list(begins), n))
        return out

    monkeypatch.setattr(MTPDraft, "_draft", spy)
    g, _, _, _ = run_mtp(model, files, device_rounds=True)
    assert g.tokens == plain and len(seen) > 4
    (first, n), rest = seen[0], seen[1:]
    assert len(first) == 2 and first[0] > CHAIN_ROWS - n and first[1] == n, first  # wide feed, then the chain
    for passes, n in rest:
        assert len(passes) == 1 and n <= passes[0] <= CHAIN_ROWS, passes  # the fed rows and n - 1 steps


def test_the_slabs_hold_the_hidden_states_a_head_reads(model):
    """A target whose passes also return an MTP head's states needs room for them in both phases'
    compute slabs (measured by reserve passes on CUDA, from the shapes here): more for more streams."""
    cc = CacheConfig(mode="resident")
    plain, last, three = (phase_slabs(cc, model, 1024, CHUNK, 5, hidden=h) for h in (False, True, (0, 1, 2)))
    for phase in ("prefill", "decode"):
        assert plain[phase] < last[phase] < three[phase], (phase, plain, last, three)


def test_a_heads_round_launched_ahead_is_dropped_by_an_eject(model, files, plain):
    """As ``test_draft``'s: the head's next round, launched before a round's bookkeeping, is dropped
    when the eject policy then ejects the head (its drafted rows roll back; the rows it fed stay
    committed history, which the re-enable's catch-up continues): the tokens stay plain decoding's
    and the head counts only the verified rounds."""
    from test_draft import count_cancels

    cancelled = []
    g, mtp, control, _ = run_mtp(model, files, Scripted(at=4, back=9), device_rounds=True,
                                 on_draft=lambda m: cancelled.append(count_cancels(m)))
    assert g.tokens == plain and [t.action for t in control.transitions] == ["eject", "reenable"]
    assert cancelled == [[4]] and mtp.stats.calls == sum(r.verify_width > 1 for r in g.records)


@pytest.mark.parametrize("alpha", [None, 0.7])
def test_a_heads_next_round_launches_before_the_readback(model, files, plain, alpha, monkeypatch):
    """Device rounds with a fixed draft length: the head's next chain is launched right after
    ``prepare``, before the round's readback (``propose_ahead``), feeding the verify's rows and
    drafting from the last kept one, so the device drafts while the host reads back. Every round
    runs so but the first, the last few (a round that may end the output launches none; the last
    one launched is dropped) and those whose pass of 2 x 4 rows would open a page of the head's KV
    (staged from the host: at most 8 a page). The tokens are plain decoding's and the head counts
    the verified rounds. A length policy that reads the rounds launches none."""
    from policies.draft_length import Heuristic

    launched, ahead = [], MTPDraft.propose_ahead
    monkeypatch.setattr(MTPDraft, "propose_ahead", lambda self, n: launched.append(ahead(self, n)) or launched[-1])
    g, mtp, _, _ = run_mtp(model, files, device_rounds=True, alpha=alpha, new=150)
    rounds = sum(r.verify_width > 1 for r in g.records)
    # (synthetic acceptance keeps drafts whatever the target says: its tokens are not plain decoding's;
    # that each of its rounds drafts the head's chain is test_every_rounds_draft_is_the_heads_chain...'s)
    want = plain_tokens(model, 150)
    assert (alpha is not None or g.tokens == want) and mtp.stats.calls == rounds
    pages = mtp.cache.length // 256 - len(PROMPT) // 256  # the head's KV pages opened while decoding
    fallbacks = 1 + 5 + 8 * pages  # the first round, the last five at most, at page openings
    assert rounds - fallbacks <= sum(out is not None for out in launched) < rounds, (launched, rounds, pages)
    launched.clear()
    g, *_ = run_mtp(model, files, device_rounds=True, alpha=alpha, new=60, length_policy=Heuristic(n_min=1, start=2))
    assert (alpha is not None or g.tokens == want[:60]) and launched == []  # (no stop token: a prefix)
