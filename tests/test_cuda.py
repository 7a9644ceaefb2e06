"""The same model and command on CUDA (skipped without a CUDA device)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from kvstream.cli.generate import run
from kvstream.engine.generate import generate
from kvstream.model.qwen import load_model
from kvstream.model.sampling import Sampler, SamplingParams
from test_cli import cfg_for
from tiny_gguf import TinySpec, write_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = TinySpec(arch="qwen2", hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, n_layers=3)
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "m.gguf", spec)


def test_cuda_logits_match_cpu(tiny):
    cpu, gpu = load_model(tiny, torch.float32, "cpu"), load_model(tiny, torch.float32, "cuda")
    ids = torch.randint(0, cpu.cfg.vocab_size, (40,))
    with torch.inference_mode():
        a = cpu(ids, cpu.new_cache(64), all_logits=True)
        b = gpu(ids.cuda(), gpu.new_cache(64), all_logits=True).cpu()
    # fp32 on both, but cuBLAS may use TF32-free but differently blocked sums: ulps of |logit|
    # (measured on the H200: 8.8e-7 of the largest, 2026-11-30; the CPU tests' 1e-4 holds)
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_cuda_bf16_greedy_runs_and_is_deterministic(tiny):
    m = load_model(tiny, torch.bfloat16, "cuda")
    runs = [generate(m, m.new_cache(64), [1, 2, 3, 4], 16, Sampler(SamplingParams(), "cuda")).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) <= 16


def test_generate_command_on_cuda(tiny):
    out = io.StringIO()
    run(cfg_for(f"model.source={tiny}", "hardware=h200", "max_new_tokens=8", "sampling.temperature=0.7"), out)
    assert "decode" in out.getvalue().splitlines()[-1]


def test_cuda_streaming_matches_resident(tmp_path):
    """The Triton kernels and the copy stream: one ring round is bit-identical to resident mode."""
    import test_paged_cache as t

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = t.run(m, t.paged(m, "resident"), toks)
    # 6 of 8 pages resident in decode (the measured CUDA prefill slab needs the room 4 would leave)
    one = t.run(m, t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 8), ring=8), toks)
    many = t.run(m, t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 2), ring=2), toks)
    assert torch.equal(one, ref)
    assert torch.equal(many, ref)  # several rounds: the one call's splits carried across them


def test_cuda_pinned_draft_is_lossless_and_cycles_leave_memory_flat(tmp_path):
    """The draft's weights and KV as arena views on the device; eject / re-enable mid-run;
    200 more cycles leave the arena accounting and the allocated device memory unchanged."""
    import test_draft as t
    from kvstream.cache.arena import MIB, Arena
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.draft_control import DraftControl
    from kvstream.engine.speculative import speculative_generate
    from kvstream.speculators.chain import Chain
    from kvstream.speculators.draft import DraftModel, load_host
    from kvstream.model.tokenizer import Tokenizer

    target_file, draft_file = write_tiny_model(tmp_path / "t.gguf", t.SPEC), write_tiny_model(tmp_path / "d.gguf", t.DRAFT_SPEC)
    m = load_model(target_file, torch.float32, "cuda")
    host = load_host(target_file, Tokenizer.from_gguf(draft_file).token_texts, torch.float32, "cuda")
    greedy = Sampler(SamplingParams(), "cuda")
    new = lambda: DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK)
    nbytes = new().pin(Arena(256 * MIB, "cuda"))
    cache = lambda: make_cache(CacheConfig(mode="stream", ring_pages="4"), ArenaConfig(), m, 1024, t.CHUNK, 9,
                               pinned_bytes=nbytes + MIB)
    plain = generate(m, cache(), t.PROMPT, t.NEW, greedy, prefill_chunk=t.CHUNK).tokens
    c, draft = cache(), new()
    control = DraftControl(draft, c, t.Scripted(at=3, back=8))
    g = speculative_generate(m, c, t.PROMPT, t.NEW, greedy, Chain([draft]), n_max=8, prefill_chunk=t.CHUNK,
                             control=control)
    assert g.tokens == plain and draft.stats.accepted_tokens > 0
    assert [x.action for x in control.transitions] == ["eject", "reenable"]
    torch.cuda.synchronize()
    state, mem = (c.arena.top, list(c.arena.pinned), c.layout), torch.cuda.memory_allocated()
    for _ in range(200):
        c.rearrange(lambda: draft.eject(c.arena))
        c.rearrange(lambda: draft.pin(c.arena))
    torch.cuda.synchronize()
    assert (c.arena.top, c.arena.pinned, c.layout) == state
    assert torch.cuda.memory_allocated() == mem  # every draft byte lives in the arena


@pytest.mark.parametrize("mode, ring, pages", [("resident", None, None), ("stream", 8, 6), ("stream", 2, 6)])
def test_graphed_decode_is_bit_identical_to_eager(tmp_path, mode, ring, pages):
    """Captured decode steps (resident; streaming in one round; in several rounds, copies inside
    the graph) give the eager logits bit for bit, across page boundaries (new plans)."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    new = lambda: t.paged(m, mode) if mode == "resident" else t.paged(m, mode, mib=t.small_arena_mib(m, pages, ring), ring=ring)
    eager = t.run(m, new(), toks)
    graphed = GraphedModel(m)
    got = t.run(graphed, new(), toks)
    assert torch.equal(got, eager)
    # nothing streamed: one capture serves every page (the table is read in place); a streaming
    # plan of another shape is captured, one of the same shape re-points the step's copies
    assert graphed.captures == 1 if mode == "resident" else graphed.captures >= 1


@pytest.mark.parametrize("mode", ["resident", "stream"])
def test_greedy_generate_takes_its_argmax_in_the_graph_and_equals_eager(tmp_path, mode):
    """A greedy ``generate`` through a GraphedModel runs ``next_token`` (the argmax inside the step's
    graph, feeding the next replay): its tokens equal the eager model's across page openings (new
    plans served in place when streaming), a stop token ends it at the same place with the same
    cache length, and the first steps' captures are all it makes."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    prompt = torch.randint(0, 357, (1500,), generator=torch.Generator().manual_seed(3)).tolist()
    new = lambda: t.paged(m, mode) if mode == "resident" else t.paged(m, mode, mib=t.small_arena_mib(m, 6, 8), ring=8)
    greedy = Sampler(SamplingParams(temperature=0), "cuda")
    eager = generate(m, new(), prompt, 400, greedy, prefill_chunk=t.CHUNK)  # to 1900: pages open at 1536 and 1792
    graphed = GraphedModel(m)
    cache = new()  # (kept: a cache that goes drops the graphs captured into it)
    staged, stage = [], cache._stage_step
    cache._stage_step = lambda n: staged.append(cache.length) or stage(n)  # the host's stagings of decode steps
    assert generate(graphed, cache, prompt, 400, greedy, prefill_chunk=t.CHUNK).tokens == eager.tokens
    assert [k[3] for k in graphed.graphs] == ["greedy"]  # no logits-returning step ran
    # each graph stages its successor: the host stages the first steps (the warm-up's included) and the
    # steps at the two page openings (1536, 1792), whose plans may point the new page elsewhere
    assert not {n for n in staged if n > 1500 + 2} - {1536, 1792}, staged
    if mode == "resident":  # nothing streamed: the tables are read in place
        assert graphed.captures == 1
    # the same graphs' steps through the logits path (kept logits): the same tokens too
    assert generate(graphed, new(), prompt, 400, greedy, prefill_chunk=t.CHUNK, keep_logits=True).tokens == eager.tokens
    stop = eager.tokens[max(i for i, tok in enumerate(eager.tokens) if tok not in eager.tokens[:i])]  # its first time
    ends = []
    for step in (m, graphed):
        cache = new()
        g = generate(step, cache, prompt, 400, greedy, prefill_chunk=t.CHUNK, stop_ids=[stop])
        ends.append((g.tokens, g.stopped_on, cache.length))
    assert ends[0] == ends[1] and ends[0][0] == eager.tokens[:len(ends[0][0])]


@pytest.mark.parametrize("hidden", [True, (1, 2)], ids=["last stream", "two streams (EAGLE-3)"])
def test_graphed_steps_return_the_hidden_states_an_mtp_head_reads(tmp_path, hidden):
    """``hidden`` through a captured step (a verify batch, streaming): (logits, h) equal the
    eager pass's bit for bit, and the logits equal a step without ``hidden``'s."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + 12,), generator=torch.Generator().manual_seed(2)).tolist()
    out = []
    for step in (m, GraphedModel(m)):
        cache = t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 8), ring=8, verify_width=5)
        t.run(m, cache, toks[:t.PROMPT + 1], decode=1)
        batch = torch.tensor(toks[t.PROMPT:t.PROMPT + 5], device="cuda")
        with torch.inference_mode():
            for _ in range(3):  # capture, then replays
                n = cache.length
                logits, h = step(batch, cache, all_logits=True, hidden=hidden)
                cache.truncate(n)
                plain = step(batch, cache, all_logits=True)
                cache.truncate(n)
        out.append((logits, h, plain))
        del step
    (a, ha, pa), (b, hb, pb) = out
    width = t.SPEC.hidden * (1 if hidden is True else len(hidden))
    assert h.shape == (5, width) and torch.equal(a, b) and torch.equal(ha, hb) and torch.equal(pa, a)


@pytest.mark.parametrize("ring", [12, 40])
def test_graphed_decode_across_page_openings_updates_its_copies_instead_of_capturing(tmp_path, ring):
    """Eight page openings (tests/test_graph_plan.py's decode: 4 layers, 1-9 streamed pages per
    layer): one capture per step shape, every other plan change an update of the captured copy
    nodes, and the logits equal the eager decode's bit for bit."""
    import test_graph_plan as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + t.WIDTH * t.STEPS,), generator=torch.Generator().manual_seed(5)).tolist()
    eager = t.decode(m, t.cache_for(m, "stream", ring=ring), toks)
    cache, graphed, shapes, plans = t.cache_for(m, "stream", ring=ring), GraphedModel(m), set(), set()
    got = t.decode(graphed, cache, toks, lambda c: (shapes.add(c.step_plan()[0]), plans.add(c.plan_key())))
    captures, updates = graphed.captures, graphed.updates
    del graphed  # its graphs' buffers are in the cache's slab: the graphs go first
    assert torch.equal(got, eager)
    assert captures == len(shapes) and updates >= len(plans) - len(shapes) > 0, (captures, updates, len(plans))


@pytest.mark.parametrize("order", ["cache first", "one collection", "owner first"])
def test_a_cache_releases_the_graphs_in_its_slab_before_its_pools(tmp_path, order):
    """A cache freed before the GraphedModel that captured into its slab (a failed test's frame
    let go local by local), or both in one garbage collection: the cache resets those graphs
    before its pools go, and empties the owner's entries first (their output buffers are the slab's too). The
    owner freed first: its graphs go with it. The other order aborted the process ("Fatal Python error:
    Aborted" while garbage-collecting, H200, 2026-12-02); so did an owner whose cache was freed and the
    allocator's cache emptied before the owner let its output buffers go ("invalid device pointer", the
    owner kept for a second run on a new cache, 2026-12-04)."""
    import gc

    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + 8,), generator=torch.Generator().manual_seed(4)).tolist()
    cache, graphed = t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 8), ring=8), GraphedModel(m)
    t.run(graphed, cache, toks, decode=8)
    assert graphed.graphs and len(cache.slab_graphs) == graphed.captures
    if order == "cache first":
        del cache
        gc.collect()
        torch.cuda.empty_cache()
        assert graphed.graphs == {}  # the cache emptied them: no buffer of its pools outlives them
        del graphed
    elif order == "owner first":  # a discarded GraphedModel's graphs leave the slab with it
        del graphed
        assert cache.slab_graphs == []
        del cache
    else:
        cache.owner, graphed.cache = graphed, cache  # a cycle: freed by the collector, in its order
        del cache, graphed
    gc.collect()
    torch.cuda.synchronize()
    # the allocator still works: a fresh cache and graphs over freed slabs
    again = t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 8), ring=8)
    assert torch.isfinite(t.run(GraphedModel(m), again, toks, decode=8)).all()


@pytest.mark.parametrize("ring, most_rounds", [(16, 1), (4, 3)])
def test_graphed_decode_with_a_residency_step_changes_plan_once(tmp_path, ring, most_rounds):
    """Graphed decode across page openings 8, 9 and 10 with residency step 3 (6 resident pages
    per layer; one round per layer with a 16-slot ring, 2-3 with 4 slots): the streamed set
    changes once, so the step is captured or updated twice in all (the first plan, then the
    change) instead of four times, and the logits equal the eager decode's bit for bit, the replays at
    the kept plan included (several rounds: their round keys and split counts kept too)."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    decode, max_tokens = 700, 3072
    toks = torch.randint(0, 357, (t.PROMPT + decode,), generator=torch.Generator().manual_seed(3)).tolist()
    new = lambda: t.paged(m, "stream", mib=t.small_arena_mib(m, 6, ring, max_tokens), ring=ring,
                          max_tokens=max_tokens, step=3)
    eager = t.run(m, new(), toks, decode)
    cache, graphed = new(), GraphedModel(m)
    got = t.run(graphed, cache, toks, decode)
    captures, updates = graphed.captures, graphed.updates
    del graphed  # its graphs' buffers are in the cache's slab: the graphs go first
    assert cache.capacity == 6 and cache.stats.rounds == most_rounds
    # one round: the plan change keeps the step's shape and re-points its copies; in 2-3 rounds
    # the round count changes the shape, a capture
    assert torch.equal(got, eager) and captures + updates == 2 and captures == (1 if most_rounds == 1 else 2)


def test_graphed_layer_groups_match_resident(tmp_path):
    """Three layers, two sharing each 2-D ring copy (rows from the pinned host store): eager
    and graphed steps give the resident logits bit for bit (one round per layer)."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    spec = TinySpec(**{**t.SPEC.__dict__, "n_layers": 3})
    m = load_model(write_tiny_model(tmp_path / "m.gguf", spec), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = t.run(m, t.paged(m, "resident"), toks)
    new = lambda: t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 16), ring=16)
    cache = new()
    eager = t.run(m, cache, toks)
    graphed = t.run(GraphedModel(m), new(), toks)
    assert cache.group == 2 and cache.stats.streamed_pages > 0
    assert torch.equal(eager, ref) and torch.equal(graphed, ref)


def _slow_ring(monkeypatch, cycles: int = 200_000) -> None:
    """Every ring copy starts, and every read of a ring half begins, ~0.1 ms late (a spin on
    the copy or compute stream, captured with the step): a read that does not wait for its copy,
    or a copy that does not wait for the last reader of its half, then sees or clobbers the
    wrong pages instead of winning the race by luck."""
    from kvstream.cache.cudart import copy_rows
    from kvstream.cache.copier import Copier

    def copy(self, dst, src, half):
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.free[half])
            torch.cuda._sleep(cycles)
            copy_rows(dst, src, self.stream)
            self.ready[half].record(self.stream)

    wait = Copier.wait

    def slow_wait(self, half=None):
        wait(self, half)
        torch.cuda._sleep(cycles)

    monkeypatch.setattr(Copier, "copy", copy)
    monkeypatch.setattr(Copier, "wait", slow_wait)


@pytest.mark.parametrize("ring, pages", [(16, 6), (4, 6), (2, 6)])  # groups of 2 layers; 1; 2 rounds
def test_slow_ring_copies_and_reads_still_match_resident(tmp_path, monkeypatch, ring, pages):
    """Three layers (an odd count of layers x rounds where groups are 1), eager and graphed,
    with every copy and every ring read delayed: the resident logits, bit for bit (several
    rounds too, as in test_cuda_streaming_matches_resident)."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    spec = TinySpec(**{**t.SPEC.__dict__, "n_layers": 3})
    m = load_model(write_tiny_model(tmp_path / "m.gguf", spec), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = t.run(m, t.paged(m, "resident"), toks)
    _slow_ring(monkeypatch)
    new = lambda: t.paged(m, "stream", mib=t.small_arena_mib(m, pages, ring), ring=ring)
    cache = new()
    eager = t.run(m, cache, toks)
    graphed = t.run(GraphedModel(m), new(), toks)
    assert cache.stats.streamed_pages > 0 and cache.group == {16: 2, 4: 1, 2: 1}[ring]
    assert torch.equal(graphed, eager)
    assert torch.equal(eager, ref)  # one round or several


@pytest.mark.parametrize("eject, gemv", [(False, False), (True, False), ("measure_plain", False), (True, True)])
def test_graphed_speculative_decoding_with_a_pinned_draft(tmp_path, eject, gemv):
    """Eager and graphed drafting rounds give the same tokens; with model.gemv (target and draft
    single decode rows by kernels/gemv.py, the verify batches by kernels/gemv_mma.py, PDL launches in
    both models' graphs) also plain decoding's."""
    import test_draft as t
    from kvstream.cache.arena import MIB, Arena
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.graphs import GraphedModel
    from kvstream.engine.draft_control import DraftControl
    from kvstream.engine.speculative import speculative_generate
    from kvstream.speculators.chain import Chain
    from kvstream.speculators.draft import DraftModel, load_host
    from kvstream.model.tokenizer import Tokenizer

    target_file = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    m = load_model(target_file, torch.float32, "cuda", gemv=gemv)
    host = load_host(target_file, Tokenizer.from_gguf(target_file).token_texts, torch.float32, "cuda", gemv=gemv)
    greedy = Sampler(SamplingParams(), "cuda")
    nbytes = DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK).pin(Arena(256 * MIB, "cuda"))
    cache = lambda model=m: make_cache(CacheConfig(mode="stream", ring_pages="4"), ArenaConfig(), model, 1024, t.CHUNK,
                                       9, pinned_bytes=nbytes + MIB)
    runs = []
    for graphs in (False, True):
        c, draft = cache(), DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK, graphs=graphs)
        policy = t.MeasurePlainAt(at=2) if eject == "measure_plain" else t.Scripted(at=3, back=8)
        control = DraftControl(draft, c, policy) if eject else None
        step = GraphedModel(m) if graphs else m
        runs.append(speculative_generate(step, c, t.PROMPT, t.NEW, greedy, Chain([draft]), n_max=8,
                                         prefill_chunk=t.CHUNK, control=control).tokens)
        assert eject != "measure_plain" or control.count("measure_plain") == 1
    assert runs[0] == runs[1]
    if gemv:
        plain = load_model(target_file, torch.float32, "cuda")
        assert runs[0] == generate(plain, cache(plain), t.PROMPT, t.NEW, greedy, prefill_chunk=t.CHUNK).tokens


@pytest.mark.parametrize("n_max", [8, 4])
def test_graphed_device_rounds_with_a_draft_model_equal_eager_ones(tmp_path, monkeypatch, n_max):
    """Device rounds whose catch-up and draft steps replay one graph per (catch-up width, draft
    length) (``DraftModel._run_chain``): the tokens of eager device rounds and of plain decoding;
    every chain was captured at the warm-up (catch-up widths 1..1 + n_max at n_max draft steps), none
    during the decode. At 4 draft steps most rounds launch before the last one's readback (``propose_ahead``:
    a pass of 9 rows; at 8 its 17 rows are more than a pass, so none does)."""
    import test_draft as t
    from kvstream.cache.arena import MIB, Arena
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.generate import generate
    from kvstream.engine.graphs import GraphedModel
    from kvstream.engine.draft_control import DraftControl
    from kvstream.engine.speculative import speculative_generate
    from kvstream.speculators.chain import Chain
    from kvstream.speculators.draft import DraftModel, load_host
    from kvstream.model.tokenizer import Tokenizer
    from policies.eject import Never

    target_file = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    m = load_model(target_file, torch.float32, "cuda")
    host = load_host(target_file, Tokenizer.from_gguf(target_file).token_texts, torch.float32, "cuda")
    greedy = Sampler(SamplingParams(), "cuda")
    nbytes = DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK).pin(Arena(256 * MIB, "cuda"))
    cache = lambda: make_cache(CacheConfig(mode="stream", ring_pages="4"), ArenaConfig(), m, 1024, t.CHUNK, 9,
                               pinned_bytes=nbytes + MIB)
    plain = generate(m, cache(), t.PROMPT, t.NEW, greedy, prefill_chunk=t.CHUNK).tokens
    launched, ahead = [], DraftModel.propose_ahead
    monkeypatch.setattr(DraftModel, "propose_ahead", lambda self, n: launched.append(ahead(self, n)) or launched[-1])
    runs = []
    for graphs in (False, True):
        launched.clear()
        c, draft = cache(), DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK, graphs=graphs,
                                       max_width=1 + n_max)
        g = speculative_generate(GraphedModel(m) if graphs else m, c, t.PROMPT, t.NEW, greedy, Chain([draft]),
                                 n_max=n_max, prefill_chunk=t.CHUNK, control=DraftControl(draft, c, Never()),
                                 device_rounds=True)
        runs.append(g.tokens)
        assert draft.stats.calls > 2 and draft.fed == (t.PROMPT + g.tokens)[:len(draft.fed)]
        n_ahead = sum(out is not None for out in launched)
        assert n_ahead == 0 if n_max == 8 else n_ahead >= draft.stats.calls // 2, (n_ahead, draft.stats.calls)
    assert runs[0] == runs[1] == plain
    widths = range(1, 2 + n_max)
    assert draft.chains.captures == len(widths) and set(draft.chains.graphs) == {(w, n_max) for w in widths}


def test_a_reenabled_draft_replays_its_graphs(tmp_path):
    """An eject and a re-enable pin the draft at the same addresses: its captured steps replay (no
    new capture) and draft what they drafted before, though the target's pages took those bytes."""
    import test_draft as t
    from kvstream.cache.arena import MIB, Arena
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.graphs import GraphedModel
    from kvstream.engine.draft_control import DraftControl
    from kvstream.engine.speculative import speculative_generate
    from kvstream.speculators.chain import Chain
    from kvstream.speculators.draft import DraftModel, load_host
    from kvstream.model.tokenizer import Tokenizer
    from policies.eject import Never

    target_file = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    m = load_model(target_file, torch.float32, "cuda")
    host = load_host(target_file, Tokenizer.from_gguf(target_file).token_texts, torch.float32, "cuda")
    nbytes = DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK).pin(Arena(256 * MIB, "cuda"))
    c = make_cache(CacheConfig(mode="stream", ring_pages="4"), ArenaConfig(), m, 1024, t.CHUNK, 9,
                   pinned_bytes=nbytes + MIB)
    draft = DraftModel(host, "cuda", max_tokens=1024, chunk=t.CHUNK, graphs=True)
    control = DraftControl(draft, c, Never())
    g = speculative_generate(GraphedModel(m), c, t.PROMPT, t.NEW, Sampler(SamplingParams(), "cuda"), Chain([draft]),
                             n_max=8, prefill_chunk=t.CHUNK, control=control)
    history = t.PROMPT + g.tokens
    for _ in range(2):  # the second call replays what the first captured
        before = draft.propose(history, 4)
        draft.accepted(len(before), 0)
    captures, graphed = draft.model.captures, draft.model
    c.rearrange(lambda: draft.eject(c.arena))
    c.kspace.fill_(7)  # the target's pool holds the draft's bytes now: overwrite them all
    c.vspace.fill_(7)
    c.rearrange(lambda: draft.pin(c.arena))
    assert draft.propose(history, 4) == before
    assert draft.model is graphed and graphed.captures == captures


def test_a_pinned_drafts_buffers_and_graphs_live_in_the_arena(tmp_path):
    """A graphed draft's steps and catch-up passes take their buffers from its two slabs in its
    KV region, inside the target's arena: every captured draft step's output lies in the step
    slab, catch-up chunks ran in the catch-up slab, and a speculative run adds beyond the arena
    only the callers' copies of the logits."""
    import test_draft as t
    from kvstream.cache.arena import MIB, Arena
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.graphs import GraphedModel
    from kvstream.engine.draft_control import DraftControl
    from kvstream.engine.speculative import speculative_generate
    from kvstream.speculators.chain import Chain
    from kvstream.speculators.draft import DraftModel, load_host
    from kvstream.model.tokenizer import Tokenizer
    from policies.eject import Never

    target_file = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    m = load_model(target_file, torch.float32, "cuda")
    host = load_host(target_file, Tokenizer.from_gguf(target_file).token_texts, torch.float32, "cuda")
    new = lambda: DraftModel(host, "cuda", max_tokens=1024, chunk=64, graphs=True)  # 64: catch-ups wider than a step
    nbytes = new().pin(Arena(256 * MIB, "cuda"))
    step = GraphedModel(m)

    def run():
        c, draft = make_cache(CacheConfig(mode="stream", ring_pages="4"), ArenaConfig(), m, 1024, t.CHUNK, 9,
                              pinned_bytes=nbytes + MIB), new()
        speculative_generate(step, c, t.PROMPT, t.NEW, Sampler(SamplingParams(), "cuda"), Chain([draft]), n_max=8,
                             prefill_chunk=t.CHUNK, control=DraftControl(draft, c, Never()))
        return c, draft

    run()  # compiles, cuBLAS workspaces
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    c, draft = run()
    torch.cuda.synchronize()
    added = free - torch.cuda.mem_get_info()[0]
    catch_up, steps = draft.cache._pools
    assert draft.model.graphs and all(steps.base < e.out.data_ptr() < steps.base + steps.nbytes
                                      for e in draft.model.graphs.values())
    assert catch_up.segments.peak > 0  # the prompt's catch-up ran there (483 tokens: 64-token chunks)
    kv = draft.cache.arena.buf
    assert c.arena.buf.data_ptr() <= kv.data_ptr() < kv.data_ptr() + kv.numel() <= c.arena.buf.data_ptr() + c.arena.nbytes
    # beyond the arena: the clones of the target's and the draft's logits (a 2 MiB segment or two)
    assert added - c.arena.nbytes <= 6 << 20, (added, c.arena.nbytes)


def host_matches_device(cache, tail: bool = False) -> int:
    """Committed pages whose host copy differs from the device copy in a committed row (any layer,
    K or V); with ``tail`` the partial last page's committed rows too (the rows past the length
    are never written back)."""
    from kernels.formats import page_to_ggml

    torch.cuda.synchronize()
    n, bad = -(-cache.length // 256) if tail else cache.length // 256, 0  # else rows past the length may be stale
    for p, j in cache.slot.items():
        if p < n:
            rows = min(cache.length - 256 * p, 256)
            idx = torch.tensor([cache._pool_slot(l, j) for l in range(cache.n_layers)], device="cuda")
            for host, space, fmt in ((cache.host.k, cache.kspace, cache.k_fmt), (cache.host.v, cache.vspace, cache.v_fmt)):
                bad += int((page_to_ggml(space[idx].cpu(), fmt)[:, :rows] != page_to_ggml(host[:, p], fmt)[:, :rows]).any())
    return bad


LONG = TinySpec(arch="qwen2", hidden=256, n_heads=12, n_kv_heads=2, head_dim=128, ffn=256, n_layers=2,
                context_length=40000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_decode_matches_eager_at_32k(tmp_path, dtype):
    """After a 32000-token prompt (a whole number of pages, the last prefill chunk partial, as in
    the runs that disagreed), graphed and eager decode steps give the same logits bit for bit
    (finite: a stale page once made one of them emit token 0 from the second token on)."""
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.graphs import GraphedModel
    from kvstream.engine.generate import prefill

    m = load_model(write_tiny_model(tmp_path / "m.gguf", LONG), dtype, "cuda")
    toks = torch.randint(0, 357, (32000 + 8,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(step, cache):
        with torch.inference_mode():
            out = [prefill(step, cache, toks[:32000], 512)]
            cache.set_phase("decode")
            for t in toks[32000:]:
                out.append(step(torch.tensor([t], device="cuda"), cache)[-1])
        return torch.stack(out).float()

    paged = lambda: make_cache(CacheConfig(mode="resident"), ArenaConfig(), m, 32100, 512)
    eager, graphed = run(m, paged()), run(GraphedModel(m), paged())
    assert torch.isfinite(eager).all() and torch.isfinite(graphed).all()
    assert torch.equal(graphed, eager)


def test_every_streaming_plan_fits_the_reserved_decode_slab(tmp_path):
    """Each decode width 1..5 (both logits kinds), captured at contexts whose streaming plans
    differ (rounds, and the pages each covers), fits the decode slab the reserve pass measured at
    the end of the context. The 1.5B's attention shapes, a 64-slot ring: the rounds' partials
    live in one buffer sized from the table, not per plan, so every plan's buffers fall into the
    allocator segment classes the reserve pass saw."""
    from kvstream.cache.arena import ArenaPlan, pair_bytes
    from kvstream.cache.factory import make_cache, phase_slabs
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.graphs import GraphedModel
    from kvstream.engine.generate import prefill, warm_widths

    spec = replace(LONG, n_layers=28)  # the 1.5B's layers: pages, not the prefill slab, fill the arena
    m = load_model(write_tiny_model(tmp_path / "m.gguf", spec), torch.float16, "cuda")
    cfg, max_tokens, chunk = CacheConfig(mode="stream", ring_pages="64"), 22528, 256
    slabs = phase_slabs(cfg, m, max_tokens, chunk, verify_width=5)
    pair = pair_bytes("q8_0", "q4_0", LONG.n_kv_heads, LONG.head_dim)
    # ~30 resident pages per layer while decoding (2 rounds from 63 pages, 3 from 95), at least 2
    # while prefilling
    nbytes = max(ArenaPlan(slabs["decode"], 64, pair).bytes(spec.n_layers * 30),
                 ArenaPlan(slabs["prefill"], 64, pair).bytes(spec.n_layers * 2))
    arena = ArenaConfig(mib=str(nbytes / 2**20))
    toks = torch.randint(0, 357, (max_tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    plans = set()
    with torch.inference_mode():
        for context in range(9472, max_tokens - 5, 1024):
            cache, step = make_cache(cfg, arena, m, max_tokens, chunk, verify_width=5, slabs=slabs), GraphedModel(m)
            prefill(m, cache, toks[:context], chunk)
            cache.set_phase("decode")
            warm_widths(step, cache, [(w, every) for w in range(1, 6) for every in (False, True)])
            plans.add((cache.capacity, tuple(b - a for a, b, _ in cache.rounds)))
            del step, cache  # the graphs first: they hold the slab's segments
    torch.cuda.synchronize()
    assert sum(len(rounds) > 1 for _, rounds in plans) >= 5, sorted(plans)  # several multi-round plans were captured


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_store_holds_every_committed_page_after_a_long_prefill(tmp_path, dtype):
    """The host store is authoritative: after a 32000-token prefill in 512-token chunks (each
    chunk's pages go back to the host on the copy stream while the next chunk computes) every
    page on the host equals its device copy byte for byte, and so do the pages the phase switch
    re-uploads from the host: a write-back that does not wait for the kernels that wrote its
    source (the copy stream must wait on the compute stream) leaves pages that differ."""
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.engine.generate import prefill

    m = load_model(write_tiny_model(tmp_path / "m.gguf", LONG), dtype, "cuda")
    toks = torch.randint(0, 357, (32000,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = make_cache(CacheConfig(mode="resident"), ArenaConfig(), m, 32100, 512)
    prefill(m, cache, toks, 512)
    assert host_matches_device(cache) == 0
    cache.set_phase("decode")
    assert host_matches_device(cache) == 0


def test_copy_rows_writes_a_strided_pinned_view_from_strided_device_rows():
    from kvstream.cache.cudart import copy_rows

    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (5, 7, 100), dtype=torch.uint8, generator=g).pin_memory()
    space = torch.randint(0, 256, (40, 100), dtype=torch.uint8, generator=g).cuda()
    before = host.clone()
    stream = torch.cuda.Stream()
    copy_rows(host[:, 3], space[2:2 + 4 * 8 + 1:8], stream)  # rows 2, 10, ..., 34 -> page 3 of 5 layers
    stream.synchronize()
    assert torch.equal(host[:, 3], space[2::8][:5].cpu())
    before[:, 3] = host[:, 3]
    assert torch.equal(host, before)  # nothing else written
    with pytest.raises(ValueError, match="contiguous rows"):
        copy_rows(host[:, 3, ::2], space[:5, ::2], stream)


@pytest.mark.parametrize("mode, pages", [("resident", None), ("stream", 6)])
def test_run_ahead_decode_matches_step_by_step_and_keeps_the_host_store(tmp_path, mode, pages):
    """Graphed greedy decode with the host a step ahead (write-backs as asynchronous 2-D copies
    under the next step) gives the step-by-step tokens, across a page boundary, and leaves every
    page on the host equal to the device's, the partial last one included."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    runs, hosts = [], []
    for ahead in (False, True):
        mib = None if mode == "resident" else t.small_arena_mib(m, pages, 8, max_tokens=2400)
        cache = t.paged(m, mode, mib=mib, max_tokens=2400)
        g = generate(GraphedModel(m), cache, toks, 300, Sampler(SamplingParams(), "cuda"), prefill_chunk=t.CHUNK,
                     run_ahead=ahead)
        runs.append(g.tokens)
        assert cache.length == t.PROMPT + 299
        assert host_matches_device(cache, tail=True) == 0  # the resident pages
        hosts.append((cache.host.k.clone(), cache.host.v.clone()))
    assert runs[0] == runs[1]
    # every committed page, streamed ones included, against an eager resident run (same kernels)
    ref = t.paged(m, "resident", max_tokens=2400)
    assert generate(m, ref, toks, 300, Sampler(SamplingParams(), "cuda"), prefill_chunk=t.CHUNK).tokens == runs[0]
    torch.cuda.synchronize()
    full = ref.length // 256
    for k, v in hosts:
        assert torch.equal(k[:, :full], ref.host.k[:, :full]) and torch.equal(v[:, :full], ref.host.v[:, :full])


def test_slab_pool_serves_segments_from_its_region_and_names_the_numbers():
    """torch's allocator over a region: blocks land inside it (never at its first byte, where
    the buffer's own block starts), a segment that does not fit is ArenaTooSmall with the
    sizes, and closing gives every segment back."""
    from kvstream.cache.arena import ArenaTooSmall
    from kvstream.cache.slab_pool import SlabPool

    buf = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    lo, hi = buf.data_ptr(), buf.data_ptr() + (4 << 20)
    slab = SlabPool(buf[:4 << 20], "test slab")
    with slab.scope():
        a = torch.ones(100_000, device="cuda")  # < 1 MiB: one 2 MiB segment
        b = a * 2
    assert lo < a.data_ptr() < hi and lo < b.data_ptr() < hi and slab.segments.bytes == 2 << 20
    with pytest.raises(ArenaTooSmall, match=r"test slab of 4\.00 MiB .* a 20\.00 MiB segment did not fit"):
        with slab.scope():
            torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # 1-10 MiB blocks take 20 MiB segments
    assert torch.equal(b, torch.full_like(b, 2.0))
    del a, b
    slab.close()
    assert not slab.segments.live and slab.segments.holes == [(lo + 512, (4 << 20) - 512)]


def test_decode_buffers_and_captured_graphs_live_in_the_arena(tmp_path):
    """A graphed streaming decode allocates its step buffers and graph pool in the arena's slab:
    every captured step's output lies in the arena, and the device memory the run adds beyond
    the arena is only the caller's copies of the logits."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    new = lambda: t.paged(m, "stream", mib=t.small_arena_mib(m, 6, 8, max_tokens=2400), ring=8, max_tokens=2400)
    step = GraphedModel(m)
    generate(step, new(), toks, 20, Sampler(SamplingParams(), "cuda"), prefill_chunk=t.CHUNK)  # compiles, cuBLAS
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    cache = new()
    # the logits-returning steps (kept logits; greedy steps without them return the GraphedModel's feed)
    generate(step, cache, toks, 40, Sampler(SamplingParams(), "cuda"), prefill_chunk=t.CHUNK, keep_logits=True)
    torch.cuda.synchronize()
    added = free - torch.cuda.mem_get_info()[0]
    lo, hi = cache.arena.buf.data_ptr(), cache.arena.buf.data_ptr() + cache.layout.slab
    assert cache.phase == "decode" and cache.capacity < cache.max_pages and step.graphs
    assert all(lo < e.out.data_ptr() < hi for e in step.graphs.values())
    assert cache.slab_pool.segments.bytes > 0
    # beyond the arena: the clones of the logits handed to the sampler (a 2 MiB segment or two)
    assert added - cache.arena.nbytes <= 4 << 20, (added, cache.arena.nbytes)


def test_a_passes_wait_is_device_time_read_after_later_replays_are_queued():
    """The stamps measure in device time inside a captured graph, and each pass reads its own
    total although the next replays (which reuse its pinned slot) were queued before it was read."""
    from kvstream.telemetry import StepStats
    from kvstream.cache.wait_clock import WaitClock

    clock, cycles = WaitClock(torch.device("cuda"), enabled=True), 2_000_000  # ~1 ms at the H200's ~1.9 GHz
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    clock.open_pass()
    with torch.cuda.stream(side):
        with clock.timing():  # compiles both stamps outside the capture
            torch.cuda._sleep(1000)
        with torch.cuda.graph(graph, stream=side):
            with clock.timing():
                torch.cuda._sleep(cycles)
    clock.close_pass(StepStats())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    sleep_s = start.elapsed_time(end) / 1e3
    passes = []
    for _ in range(5):  # back to back: pass i's slot is taken again by pass i + 4 (SLOTS), read first
        clock.open_pass()
        graph.replay()
        passes.append(StepStats())
        clock.close_pass(passes[-1])
    for s in passes:
        # the same spin as the events timed, give or take a launch gap and the timer's ~1 us
        # steps: 2% (the clock may move between runs) + 20 us
        assert abs(s.wait_s - sleep_s) <= 0.02 * sleep_s + 20e-6, (s.wait_s, sleep_s)


def test_graphed_decode_records_the_ring_wait(tmp_path, monkeypatch):
    """Run-ahead graphed decode: every streaming step waits for ring copies made slow (~0.1 ms
    late each), and its record says so; resident steps that open no page wait for nothing, 0 s."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    toks = torch.randint(0, 357, (t.PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = Sampler(SamplingParams(), "cuda")
    resident = generate(GraphedModel(m), t.paged(m, "resident", time_waits=True), toks, 20, greedy,
                        prefill_chunk=t.CHUNK).records
    assert [r.wait_s for r in resident if r.context % 256 != 1] == [0.0] * sum(r.context % 256 != 1 for r in resident)
    _slow_ring(monkeypatch)
    cache = t.paged(m, "stream", mib=t.small_arena_mib(m, 4, 8), ring=8, time_waits=True)
    records = generate(GraphedModel(m), cache, toks, 20, greedy, prefill_chunk=t.CHUNK).records
    untimed = generate(GraphedModel(m), t.paged(m, "stream", mib=t.small_arena_mib(m, 4, 8), ring=8), toks, 4,
                       greedy, prefill_chunk=t.CHUNK).records
    assert [r.wait_s for r in untimed] == [None] * 3  # the default on CUDA: not timed
    assert all(r.streamed_pages == 4 for r in records)
    # layer 1's copy starts ~0.1 ms late while layer 0 computes for less than that: each step
    # waits for it. The waits are most of the device's step here, and a step's host-side interval
    # (step_s, with the host a step ahead) jitters around it: the sums, not each step, compare
    assert all(r.wait_s > 20e-6 for r in records), [r.wait_s for r in records]
    assert sum(r.wait_s for r in records) < sum(r.step_s for r in records)


def test_no_cache_copies_on_the_capture_stream(tmp_path):
    """torch.cuda.Stream() hands out 32 pooled streams in turn: a cache's copy stream once came
    round to the capture stream after enough caches (the reserve passes make some too), and the
    captured step then ran its copies in line with its kernels."""
    import test_paged_cache as t
    from kvstream.cache.streams import side_stream

    m = load_model(write_tiny_model(tmp_path / "m.gguf", t.SPEC), torch.float32, "cuda")
    side = side_stream(m.device).cuda_stream
    for _ in range(20):  # each makes 2 or more streams (its reserve passes): more than the pool has
        assert t.paged(m, "stream", mib=t.small_arena_mib(m, 4, 8), ring=8).copier.stream.cuda_stream != side


@pytest.mark.parametrize("features, head_graphs, gemv", [(None, False, False), ((1, 2), False, False),
                                                          ((1, 2), True, False), ((1, 2), True, True)],
                         ids=["last stream", "two streams (EAGLE-3)", "EAGLE-3, the head's rounds captured",
                              "EAGLE-3 captured, model.gemv"])
def test_graphed_device_rounds_with_an_mtp_head_equal_plain_decoding(tmp_path, features, head_graphs, gemv):
    """spec.type=mtp on CUDA: captured verify steps with their hidden states, device rounds (each
    next feed staged before the readback: ``MTPDraft.prepare``), the head pinned in the arena, its
    rounds eager or captured: the tokens equal plain decoding's. With model.gemv the verify batches'
    matmuls run kernels/gemv_mma.py, plain decoding's single rows kernels/gemv.py, and the head (made for
    the gemv target: it follows it) its feeds and steps through both, PDL-launched (fp32)."""
    import test_mtp_engine as t
    from kvstream.engine.graphs import GraphedModel
    from kvstream.model.mtp import MTPHead
    from kvstream.model.mtp_gguf import write_head
    from kvstream.model.registry import sha256_file

    target = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    m = load_model(target, torch.float32, "cuda", gemv=gemv)
    write_head(tmp_path / "h.gguf", MTPHead(load_model(target), seed=2, features=features), sha256_file(target),
               {"command": "test"}, "f32")
    cache = t.make_cache(t.CacheConfig(mode="resident"), t.ArenaConfig(), m, 1024, t.CHUNK)
    plain = generate(m, cache, t.PROMPT, t.NEW, Sampler(t.GREEDY, "cuda"), prefill_chunk=t.CHUNK).tokens
    g, mtp, _, cache = t.run_mtp(m, (target, tmp_path / "h.gguf"), device_rounds=True, step=GraphedModel(m),
                                 head_graphs=head_graphs)
    assert g.tokens == plain and mtp.stats.drafts > 0


@pytest.mark.parametrize("features", [None, (1, 2)], ids=["last stream", "two streams (EAGLE-3)"])
def test_an_mtp_head_of_a_gemv_target_computes_what_cublas_does(tmp_path, features):
    """An MTP head follows its target's model.gemv: its feeds (5 rows: kernels/gemv_mma.py, fc's long K
    by cuBLAS) and steps (1 row: kernels/gemv.py), PDL-launched, give the logits of the same head on a
    cuBLAS target within fp32's summation-order error (the 1e-4 of test_gemv_decode_matches_cublas...);
    the drafted tokens are asserted nowhere else with model.gemv (greedy verification hides them)."""
    import test_mtp_engine as t
    from kvstream.model.mtp import MTPHead

    target = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    heads = [MTPHead(load_model(target, torch.float32, "cuda", gemv=g), seed=2, features=features).cuda()
             for g in (False, True)]
    assert heads[1].gemv and not heads[0].gemv
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(5, heads[0].feature_dim, device="cuda", generator=g)
    toks = torch.randint(0, heads[0].cfg.vocab_size, (5,), device="cuda", generator=g)
    out = []
    for head in heads:
        kv = head.new_cache(64)
        with torch.no_grad():
            feed, g_out = head.step(h, toks, torch.arange(5, device="cuda"), kv)  # a round's feed
            step, _ = head.step(g_out[-1:], toks[:1], torch.tensor([5], device="cuda"), kv)  # a draft step
        out.append((feed, step))
    for a, b in zip(*out):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()


@pytest.mark.parametrize("draft_vocab, features", [(False, None), (True, None), (False, (1, 2))],
                         ids=["full vocabulary", "draft vocabulary", "two streams (EAGLE-3)"])
def test_captured_head_steps_draft_what_eager_ones_do(tmp_path, monkeypatch, draft_vocab, features):
    """MTPDraft(graphs=True): a round's feed and draft steps replay one captured graph (one capture
    per feed width, at the warm-up; wider feeds: a graph per width), and every round drafts the
    eager head's tokens (the same kernels on the same bytes)."""
    import test_mtp_engine as t
    from kvstream.engine.graphs import GraphedModel
    from kvstream.model.mtp import MTPHead
    from kvstream.model.mtp_gguf import write_head
    from kvstream.model.registry import sha256_file
    from kvstream.speculators.mtp import MTPDraft

    target = write_tiny_model(tmp_path / "t.gguf", t.SPEC)
    m = load_model(target, torch.float32, "cuda")
    d2t = torch.arange(0, m.cfg.vocab_size, 2) if draft_vocab else None  # (its index is captured: a 1-element tensor)
    write_head(tmp_path / "h.gguf", MTPHead(load_model(target), d2t=d2t, seed=2, features=features),
               sha256_file(target), {"command": "test"}, "f32")
    rounds, draft = [], MTPDraft._draft

    def recorded(self, history, n):  # read at once: a captured chain's outputs hold until its next replay
        out = draft(self, history, n)
        rounds.append(None if out is None else out[0].tolist())
        return out
    monkeypatch.setattr(MTPDraft, "_draft", recorded)
    drafted = {}
    for graphs in (False, True):
        rounds.clear()
        g, mtp, _, _ = t.run_mtp(m, (target, tmp_path / "h.gguf"), step=GraphedModel(m), head_graphs=graphs)
        drafted[graphs] = (g.tokens, [r for r in rounds if r is not None])
    assert drafted[True] == drafted[False] and len(drafted[True][1]) > 4
    # warm-up captured each feed width (1..5) once, and a round's feed + 4 draft steps (one graph) per
    # feed width and for a whole verify's feed launched ahead (``propose_ahead``); no round captured
    assert mtp.step is mtp._graphed and mtp._graphed.captures == 5 and mtp.chains.captures == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_q8_weights_on_cuda_match_the_cpu_reference_and_graph_bit_for_bit(tmp_path, dtype):
    """model.weights=q8_0: the Triton kernel against the CPU reference path (the dequantized fp32
    matmul), and captured decode steps against eager ones, bit for bit."""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    path = write_tiny_model(tmp_path / "m.gguf", t.SPEC)
    cpu, gpu = load_model(path, torch.float32, "cpu", weights="q8_0"), load_model(path, dtype, "cuda", weights="q8_0")
    ids = torch.randint(0, cpu.cfg.vocab_size, (40,))
    with torch.inference_mode():
        a = cpu(ids, cpu.new_cache(64), all_logits=True)
        b = gpu(ids.cuda(), gpu.new_cache(64), all_logits=True).float().cpu()
    # the same q8_0 blocks on both sides; the GPU runs in 16-bit activations: its rounding of
    # every activation (2^-8 relative for bf16, 2^-11 fp16) over 2 layers, a few % of |logit| at most
    assert (a - b).abs().max() <= (0.05 if dtype == torch.bfloat16 else 0.01) * a.abs().max()
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    eager = t.run(gpu, t.paged(gpu, "resident"), toks)
    assert torch.equal(t.run(GraphedModel(gpu), t.paged(gpu, "resident"), toks), eager)


@pytest.mark.parametrize("weights", ["dense", "q8_0", "q8_0_int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_decode_matches_cublas_and_graphs_bit_for_bit(tmp_path, monkeypatch, dtype, weights):
    """model.gemv: single decode rows through kernels/gemv.py (q8_0: kernels/q8_gemv.py, the LM head's
    too), the step's layer and attention kernels launched as programmatic dependents. Against cuBLAS
    (q8_0: kernels/q8_linear.py on the same blocks; q8_0_int8: x's rounding through q8_0 blocks besides,
    ~1/254 of a block's largest value, held to bf16's 0.05): fp32 sums in another order (fp32: the 1e-4
    of test_cuda_logits_match_cpu; bf16: one activation's rounding may flip, 2^-8 relative, over the
    tiny model's 2 layers a few % of |logit|; greedy tokens asked equal in fp32). Captured steps (PDL
    edges in the graph) and streamed rounds equal the eager resident decode bit for bit. (A race
    would show here only by chance: tests/kernels/test_gemv.py forces the late write.)"""
    import test_paged_cache as t
    from kvstream.engine.graphs import GraphedModel

    path = write_tiny_model(tmp_path / "m.gguf", t.SPEC)
    plain = load_model(path, dtype, "cuda", weights=weights)
    fast = load_model(path, dtype, "cuda", weights=weights, gemv=True)
    toks = torch.randint(0, 357, (t.PROMPT + t.DECODE,), generator=torch.Generator().manual_seed(1)).tolist()
    eager = t.run(fast, t.paged(fast, "resident"), toks)  # the prefill by cuBLAS, every decode step by gemv
    ref = t.run(plain, t.paged(plain, "resident"), toks)
    exact = dtype == torch.float32 and weights != "q8_0_int8"
    assert (eager.float() - ref.float()).abs().max() <= (1e-4 if exact else 0.05) * ref.float().abs().max()
    assert torch.equal(t.run(GraphedModel(fast), t.paged(fast, "resident"), toks), eager)
    if exact:
        assert torch.equal(eager.argmax(-1), ref.argmax(-1))
    # streamed rounds: ring copies and their event waits in front of the PDL attention launches; the
    # carried rounds equal one call bit for bit (test_cuda_streaming_matches_resident), eager and graphed
    stream = lambda: t.paged(fast, "stream", mib=t.small_arena_mib(fast, 6, 2), ring=2)
    assert torch.equal(t.run(fast, stream(), toks), eager)
    assert torch.equal(t.run(GraphedModel(fast), stream(), toks), eager)
    if weights == "q8_0_int8":  # x's q8_0 blocks written once by the norms, the attention merge and gate/up's
        # epilogue (xq) are the quants and scales each matmul's programs make themselves, summed in the same
        # order: bit for bit
        from kvstream.model import weights as model_weights

        monkeypatch.setattr(model_weights, "int8_row", lambda *a: False)
        assert torch.equal(t.run(fast, t.paged(fast, "resident"), toks), eager)
