"""Paged cache: streaming vs resident exactness, rollback, host authority, arena accounting, gates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import reference
from kernels.decode_attention import MAX_N_Q
from kernels.formats import PAGE_TOKENS, PageFormat
from kvstream.cache.arena import MIB, Arena, ArenaPlan, ArenaTooSmall
from kvstream.cache.arena import pair_bytes as pair_of
from kvstream.cache.contiguous import ContextOverflow, causal_attention
from kvstream.cache.factory import make_cache, phase_slabs
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.engine.generate import prefill
from kvstream.model.qwen import load_model
from kvstream.cache.paged import PagedCache
from kvstream.cache.paged_ring import copy_runs, group_size
from policies.residency import RESIDENCY
from tiny_gguf import TinySpec, write_tiny_model

SPEC = TinySpec(arch="qwen2", hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn=128, n_layers=2,
                context_length=4096)
PROMPT = 2016  # 8 pages, the last partial; whole chunks of 32, all through the prefill path
DECODE = 30
CHUNK = 32     # small prefill chunks: a small prefill slab, so small arenas still prefill


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("paged") / "m.gguf", SPEC))


def pair_bytes(type_k="q8_0", type_v="q4_0"):
    return pair_of(type_k, type_v, SPEC.n_kv_heads, SPEC.head_dim)


def run(model, cache, tokens, decode=DECODE, chunk=CHUNK):
    """Prefill in chunks, then single-token decode steps; returns the stacked decode logits."""
    out = [prefill(model, cache, tokens[:PROMPT], chunk)]
    cache.set_phase("decode")  # re-lays the arena: smaller slab, resident pages re-uploaded
    with torch.inference_mode():
        for t in tokens[PROMPT:PROMPT + decode - 1]:
            out.append(model(torch.tensor([t], device=model.device), cache)[-1])
    return torch.stack(out)


def slabs(model, ring, max_tokens=2048, types=("q8_0", "q4_0"), verify_width=1):
    """The phases' slabs; on CUDA (measured) the decode phase keeps the prefill's: the tiny
    model's pages are ~50 KB and a 2 MiB allocator segment is 40 of them, so a shrinking slab
    would leave every page resident where a test wants a given number."""
    s = phase_slabs(CacheConfig(mode="stream" if ring else "resident", type_k=types[0], type_v=types[1],
                                ring_pages=ring or "auto"), model,
                    max_tokens, CHUNK, verify_width)
    return {"prefill": max(s.values()), "decode": max(s.values())} if model.device.type == "cuda" else s


def paged(model, mode, mib=None, ring=8, types=("q8_0", "q4_0"), max_tokens=2048, residency="newest", step=1,
          time_waits=False, verify_width=1):
    cfg = CacheConfig(mode=mode, type_k=types[0], type_v=types[1], ring_pages=ring, residency=residency,
                      residency_step=step, time_waits=time_waits)
    fixed = mib is not None and model.device.type == "cuda"
    return make_cache(cfg, ArenaConfig(mib="auto" if mib is None else str(mib)), model, max_tokens, CHUNK,
                      verify_width=verify_width, slabs=slabs(model, ring, max_tokens, types, verify_width) if fixed else None)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 357, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def resident_logits(model, tokens):
    return run(model, paged(model, "resident"), tokens)


def small_arena_mib(model, pages_per_layer, ring, max_tokens=2048):
    """An arena whose decode layout holds exactly ``pages_per_layer`` resident pages per layer
    (the decode slab as the cache reserves it: measured on CUDA)."""
    slab = slabs(model, ring, max_tokens)["decode"]
    return ArenaPlan(slab, ring, pair_bytes()).mib(model.cfg.n_layers * pages_per_layer)


def test_stream_one_round_is_bit_identical_to_resident(model, tokens, resident_logits):
    # 4 resident pages per layer, ring 8 (halves of 4): the 4 streamed pages fit one round,
    # so each layer is one attention call over the same bytes as in resident mode
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    logits = run(model, cache, tokens)
    assert cache.capacity == 4 and cache.stats.streamed_pages == 4 and cache.stats.rounds == 1
    assert torch.equal(logits, resident_logits)


RESIDENCY_DECODE, RESIDENCY_MAX = 700, 3072  # 700 decode steps after the prompt open pages 8, 9 and 10


@pytest.fixture(scope="module")
def residency_run(model):
    """The residency-step test's tokens and the resident cache's logits over them (one run for its cases)."""
    toks = torch.randint(0, 357, (PROMPT + RESIDENCY_DECODE,), generator=torch.Generator().manual_seed(3)).tolist()
    return toks, run(model, paged(model, "resident", max_tokens=RESIDENCY_MAX), toks, RESIDENCY_DECODE)


@pytest.mark.parametrize("ring, step, plans", [(16, 1, 4), (16, 3, 2), (4, 1, 4), (4, 3, 2)])
def test_a_residency_step_keeps_the_plan_across_page_openings_exactly(model, residency_run, ring, step, plans):
    """700 decode steps open pages 8, 9 and 10, with 6 resident pages per layer. With residency
    step 3 the oldest pages leave 3 at a time: the plan (all a captured step depends on) changes
    once in the decode instead of three times, in one round (ring 16) and in 2-3 rounds (ring 4,
    2 streamed pages a round: the last round's split count does not follow the pages). The
    logits equal the resident cache's bit for bit in both (one attention call over the same
    bytes, or its splits carried across the rounds)."""
    (toks, ref), decode, max_tokens = residency_run, RESIDENCY_DECODE, RESIDENCY_MAX
    cache = paged(model, "stream", mib=small_arena_mib(model, 6, ring, max_tokens), ring=ring, max_tokens=max_tokens,
                  step=step)
    keys, rounds, begin = set(), set(), cache.begin

    def tracked(n):
        pos = begin(n)
        if cache.phase == "decode":
            keys.add(cache.plan_key())
            rounds.add(len(cache.rounds))
        return pos

    cache.begin = tracked
    got = run(model, cache, toks, decode)
    assert cache.capacity == 6 and len(keys) == plans
    assert (rounds == {1}) if ring == 16 else max(rounds) >= 3
    assert torch.equal(got, ref)


def test_a_plan_that_comes_back_after_a_rollback_is_a_new_plan(model):
    """A plan is a version, not its pages: one that comes back (A, then B, then A again after a
    rollback, as a rejected draft gives) has a new key, so a graph kept from its first time
    re-points its copies to it (the round keys, rewritten in place, are B's meanwhile)."""
    cache = paged(model, "stream", mib=small_arena_mib(model, 6, 4, 3072), ring=4, max_tokens=3072, step=3)
    toks = torch.randint(0, 357, (2310,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        prefill(model, cache, toks[:2300], CHUNK)  # 9 pages
        cache.set_phase("decode")
        keys = []
        for n in (1, 5):  # 9 pages (A: 2 rounds), then 10 (B: the oldest resident pages leave, 3 of them)
            cache.truncate(2300)
            for t in toks[2300:2300 + n]:
                model(torch.tensor([t]), cache)
            keys.append((cache.plan_key(), list(cache.rounds)))
        cache.truncate(2300)
        model(torch.tensor(toks[2300:2301]), cache)  # A again
    (a, rounds_a), (b, rounds_b) = keys
    assert [r[2] for r in rounds_a] != [r[2] for r in rounds_b] and len(rounds_a) > 1 and cache.rounds == rounds_a
    assert len({a, b, cache.plan_key()}) == 3


def test_auto_ring_streams_each_layer_in_one_round(model, tokens, resident_logits):
    # an arena for ~4 resident pages per layer plus 8 ring slots: auto sizes the ring so that a
    # half holds every page a layer streams at full context (2048 tokens = 8 pages)
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring="auto")
    logits = run(model, cache, tokens)
    assert cache.ring_pages == 2 * (cache.max_pages - cache.capacity) or cache.capacity == cache.max_pages
    assert cache.stats.streamed_pages > 0 and cache.stats.rounds == 1
    assert torch.equal(logits, resident_logits)


def test_sink_residency_streams_the_middle_exactly(model, tokens, resident_logits):
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8, residency="sink_newest")
    logits = run(model, cache, tokens)
    assert sorted(cache.slot) == [0, 5, 6, 7]  # the sink page and the newest three
    assert cache.stats.streamed_pages == 4 and cache.stats.rounds == 1
    assert torch.equal(logits, resident_logits)


def test_stream_many_rounds_matches_resident(model, tokens, resident_logits):
    # 4 resident pages, ring of 2 (one page per round): several rounds per layer, the same
    # computation as one pass over the rounds' keys side by side: bit for bit
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 2), ring=2)
    logits = run(model, cache, tokens)
    assert cache.stats.rounds == 4
    assert torch.equal(logits, resident_logits)


@pytest.fixture(scope="module")
def model3(tmp_path_factory):
    """Three layers: layers x rounds can be odd, so a step's last round and the next step's first
    share ring half 0 (a step copies the next one's first round under its own tail)."""
    spec = TinySpec(**{**SPEC.__dict__, "n_layers": 3})
    return load_model(write_tiny_model(tmp_path_factory.mktemp("paged3") / "m.gguf", spec))


def verify_like(model, cache, tokens, widths=(3, 1, 5, 2, 1, 1, 4)):
    """Prefill, then 12 steps of several widths, each rolled back to keep its first token (as a
    rejected draft is): the first row of each step's logits."""
    cache.verify_width = max(widths)
    out, pos = [prefill(model, cache, tokens[:PROMPT], CHUNK)], PROMPT
    cache.set_phase("decode")
    with torch.inference_mode():
        for i in range(12):
            start, w = cache.length, widths[i % len(widths)]
            out.append(model(torch.tensor(tokens[pos:pos + w], device=model.device), cache, all_logits=True)[0])
            cache.truncate(start + 1)
            pos += 1
    return torch.stack(out)


@pytest.fixture(scope="module")
def resident3(model3, tokens):
    return verify_like(model3, paged(model3, "resident"), tokens)


@pytest.mark.parametrize("ring, pages", [(8, 4), (2, 5), (4, 3)])  # 1, 3 and 3 rounds per layer
def test_odd_layers_x_rounds_with_rollback_match_resident(model3, tokens, resident3, ring, pages):
    cache = paged(model3, "stream", mib=small_arena_mib(model3, pages, ring), ring=ring)
    got = verify_like(model3, cache, tokens)
    assert cache.stats.streamed_pages > 0 and len(cache.rounds) * 3 % 2 == 1
    assert torch.equal(got, resident3)  # one round or several: the resident computation, bit for bit


@pytest.mark.parametrize("n_layers, fit, group", [(28, 100, 14), (28, 10, 7), (28, 4, 3), (28, 1, 1), (3, 2, 2),
                                                   (2, 5, 1), (24, 5, 4), (1, 9, 1)])
def test_group_size_gives_an_even_number_of_groups_that_fit(n_layers, fit, group):
    g = group_size(n_layers, fit)
    assert g == group and g <= max(1, fit)
    assert g == 1 or -(-n_layers // g) % 2 == 0  # halves alternate from step to step


class _Gaps:
    """Resident: the newest odd pages; the even ones stream, each its own copy run."""

    def resident(self, n_pages, capacity):
        return [p for p in range(n_pages) if p % 2][-capacity:]


@pytest.mark.parametrize("residency, pages", [(None, 5), (_Gaps(), 4)], ids=["newest", "gaps"])
def test_layer_groups_share_copies_and_match_resident(model3, tokens, resident3, residency, pages):
    # ring halves of 8 slots, 3 or 4 streamed pages per layer: layers 0-1 share each copy, layer 2
    # has its own; the newest pages resident: one run, one K and one V copy per group; _Gaps: a
    # copy per streamed page, still a row per layer of the group
    cache = paged(model3, "stream", mib=small_arena_mib(model3, pages, 16), ring=16)
    if residency is not None:
        cache.residency = residency
    got = verify_like(model3, cache, tokens)
    runs = len(copy_runs(cache.rounds[0][2]))
    assert cache.group == 2 and cache.stats.rounds == 1 and runs == (1 if residency is None else 4)
    assert [[dst.shape[0] for dst, _, _ in cache.ring_copies(layer, 0)] for layer in (0, 2)] == [[2] * 2 * runs,
                                                                                                 [1] * 2 * runs]
    assert torch.equal(got, resident3)  # one round per layer: the resident computation on the same bytes


def test_auto_ring_widens_into_bytes_no_resident_page_can_use(model3, tokens, resident3):
    # room for 25 page pairs: 7 resident pages per layer (21) and one streamed page; the two
    # pairs left over widen the ring from 2 to 4 slots, so two layers share each copy
    cache = paged(model3, "stream", mib=small_arena_mib(model3, 3, 16), ring="auto")
    got = verify_like(model3, cache, tokens)
    S = cache.max_pages - cache.capacity
    assert S == 1 and cache.ring_pages == 2 * 2 * S and cache.group == 2
    assert torch.equal(got, resident3)


def test_auto_ring_never_costs_a_resident_page():
    # 28 layers of 1.5B-sized pages, 16 per layer: for every arena from 84 to 460 page pairs,
    # the automatic ring leaves the most resident pages per layer that a ring of two halves of
    # one layer's streamed pages would, so capacity grows with the arena, never shrinks
    k, v = PageFormat("q8_0", 2, 128), PageFormat("q4_0", 2, 128)
    pair = k.page_bytes + v.page_bytes
    cache = PagedCache(n_layers=28, n_kv_heads=2, head_dim=128, max_tokens=16 * PAGE_TOKENS, type_k="q8_0",
                       type_v="q4_0", mode="stream", arena=Arena(ArenaPlan(0, 0, pair).bytes(460), torch.device("cpu")),
                       ring_pages=None, slabs={"prefill": 0, "decode": 0})
    cache.set_phase("decode")
    caps = [cache.capacity_if_pinned((460 - n) * pair) for n in range(84, 461)]
    best = [max(c for c in range(2, 17) if 28 * c + 2 * max(1, 16 - c) <= n) for n in range(84, 461)]
    assert caps == best


def test_f16_pages_match_the_contiguous_cache(model, tokens):
    ref = run(model, model.new_cache(2048), tokens)
    got = run(model, paged(model, "resident", types=("f16", "f16")), tokens)
    # the only difference is K/V rounded to fp16 in the pages (the model runs fp32): at most 2^-11
    # (4.9e-4) relative per value, which moves the logits by less than that of their scale (3e-5 seen)
    assert (got - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_decode_fuses_rope_into_the_store_and_equals_rope_then_attend(model, tokens):
    """A decode pass's ``attend_rope`` rotates and stores in one call (``KVOps.rope_store``: the
    Triton kernel on CUDA, its reference here); the same decode through ``CacheBase.attend_rope``
    (RoPE, then ``attend``'s two stores) gives the same logits and the same page bytes, bit for bit."""
    from kvstream.cache.contiguous import CacheBase

    fused, plain = paged(model, "resident"), paged(model, "resident")
    plain.attend_rope = lambda *a, **kw: CacheBase.attend_rope(plain, *a, **kw)
    calls = []
    rope_store = fused.ops.rope_store
    fused.ops.rope_store = lambda *a: calls.append(a[0].shape[0]) or rope_store(*a)
    a, b = run(model, fused, tokens, decode=6), run(model, plain, tokens, decode=6)
    assert calls == [1] * 5 * SPEC.n_layers  # every decode step of every layer, no prefill chunk
    assert torch.equal(a, b)
    L, n = fused.length, -(-fused.length // PAGE_TOKENS)  # every committed row (the pools' other bytes are stale memory)
    for c in (fused, plain):
        assert c.length == L and torch.equal(c.tables[:, :n], fused.tables[:, :n])
    for layer in range(SPEC.n_layers):
        pages = fused.tables[layer, :n].long()
        for space, fmt in (("kspace", fused.k_fmt), ("vspace", fused.v_fmt)):
            assert torch.equal(committed(getattr(fused, space)[pages], L, fmt), committed(getattr(plain, space)[pages], L, fmt))


@pytest.mark.parametrize("mode", ["resident", "stream"])
def test_decode_hands_the_output_projection_its_q8_blocks(tmp_path_factory, tokens, monkeypatch, mode):
    """``model.weights=q8_0_int8`` with ``model.gemv``: a decode pass's attention gives the output projection its
    output rows' q8_0 blocks (the merge writes them on CUDA, the reference codec here; streamed: the last round's
    merge), and the decode equals the one whose projection quantizes its row itself, bit for bit (one codec)."""
    m = load_model(write_tiny_model(tmp_path_factory.mktemp("q8") / "m.gguf", SPEC), weights="q8_0_int8", gemv=True)
    make = lambda: paged(m, mode, mib=small_arena_mib(m, 6, 2), ring=2) if mode == "stream" else paged(m, mode)
    given = []
    attend_rope = PagedCache.attend_rope

    def spy(self, *a, **kw):
        res = attend_rope(self, *a, **kw)
        if kw.get("q8"):
            given.append(res[1] is not None)
        return res

    monkeypatch.setattr(PagedCache, "attend_rope", spy)
    cache = make()
    with_blocks = run(m, cache, tokens, decode=6)
    assert given == [True] * 5 * SPEC.n_layers  # every decode pass of every layer, no prefill chunk
    if mode == "stream":
        assert cache.stats.rounds > 1  # the blocks came from a carried call's last round
    monkeypatch.setattr(PagedCache, "attend_rope", lambda self, *a, q8=False: (attend_rope(self, *a), None)
                        if q8 else attend_rope(self, *a))
    assert torch.equal(run(m, make(), tokens, decode=6), with_blocks)


def committed(pool_pages, L, fmt):
    """Dequantized committed rows [L, H, D] of logical pages given as a [n, page_bytes] tensor."""
    return reference.gather(pool_pages, torch.arange(pool_pages.shape[0]), L, fmt, torch.float32)


def test_host_store_holds_every_committed_row(model, tokens):
    # streamed run (one round: the same K/V as resident mode) vs the resident run's device pages
    stream = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    resident = paged(model, "resident")
    run(model, stream, tokens, decode=5)
    run(model, resident, tokens, decode=5)
    L, n = stream.length, -(-stream.length // PAGE_TOKENS)
    for layer in range(SPEC.n_layers):
        table = resident.tables[layer, :n].long()
        for host, space, fmt in ((stream.host.k, resident.kspace, stream.k_fmt),
                                 (stream.host.v, resident.vspace, stream.v_fmt)):
            assert torch.equal(host[layer, :n - 1], space[table[:-1]])  # full pages byte for byte
            assert torch.equal(committed(host[layer, :n], L, fmt), committed(space[table], L, fmt))


@pytest.mark.parametrize("types", [("q8_0", "q4_0"), ("f16", "q8_0")])
def test_row_copies_are_the_copies_of_the_row_views(model, tokens, types):
    """The commit's copy descriptors on CUDA (``_row_copies``, computed from addresses) are exactly
    ``cudart.rows_of`` of the views the CPU path copies (``_page_rows``), for whole pages, single
    rows and ranges; and one layer's copies have pitches equal to their width (a 1-row copy)."""
    from kvstream.cache.cudart import rows_of

    # streaming (ring slots before the pool's) for the default pair, resident for f16 pages
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8) if types == ("q8_0", "q4_0") \
        else paged(model, "resident", types=types)
    run(model, cache, tokens, decode=3)
    for p in cache.slot:
        for lo, hi in [(0, 256), (0, 1), (17, 18), (5, 200), (255, 256)]:
            assert cache._row_copies(p, lo, hi) == [rows_of(h, s) for h, s in cache._page_rows(p, lo, hi)], (p, lo, hi)
    one = cache._row_copies(next(iter(cache.slot)), 3, 4)
    assert all(c[5] == SPEC.n_layers > 1 for c in one)
    cache.n_layers = 1  # (the descriptors' rows = layers; a one-layer cache, an MTP head's)
    assert all(c[1] == c[3] == c[4] and c[5] == 1 for c in cache._row_copies(next(iter(cache.slot)), 3, 4))


def test_rollback_then_decode_equals_a_fresh_run(model, tokens):
    BACK = 640  # a prefill-chunk boundary (the fresh run computes the same rows in the same batches)
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 4), ring=4)
    prefill(model, cache, tokens[:PROMPT], CHUNK)
    with torch.inference_mode():
        for t in tokens[PROMPT:PROMPT + 8]:  # 8 speculative tokens...
            model(torch.tensor([t]), cache)
        cache.truncate(BACK)  # ...and a rollback across a page boundary
        a = model(torch.tensor(tokens[BACK:BACK + 10]), cache, all_logits=True)
    fresh = paged(model, "stream", mib=small_arena_mib(model, 4, 4), ring=4)
    prefill(model, fresh, tokens[:BACK], CHUNK)
    with torch.inference_mode():
        b = model(torch.tensor(tokens[BACK:BACK + 10]), fresh, all_logits=True)
    assert torch.equal(a, b)


def test_arena_size_changes_what_streams(model, tokens):
    small = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    big = paged(model, "stream", mib=small_arena_mib(model, 8, 8), ring=8)
    run(model, small, tokens, decode=2)
    run(model, big, tokens, decode=2)
    assert (small.capacity, big.capacity) == (4, 8)
    assert small.stats.streamed_pages == 4 and big.stats.streamed_pages == 0
    # the plan's first decode step also copies its own first round (begin), then every layer's set
    # (layer 0's for the next step, at its end); a steady step only the latter
    assert small.stats.h2d_bytes == (SPEC.n_layers + 1) * 4 * pair_bytes() and big.stats.h2d_bytes == 0
    with torch.inference_mode():
        model(torch.tensor([tokens[PROMPT + 1]]), small)
    assert small.stats.h2d_bytes == SPEC.n_layers * 4 * pair_bytes()


def test_pinning_shrinks_capacity_and_reset_restores_it_exactly():
    arena = Arena(8 * MIB, "cpu")
    pb = (40_000, 20_000)
    before = arena.lay_out(1 * MIB, 4, *pb, min_pool_pages=2)
    with pytest.raises(ArenaTooSmall, match="pinning 'draft' needs 3.00 MiB but only"):
        arena.pin("draft", (3 * MIB,), torch.uint8)  # the layout holds that space
    for _ in range(1000):  # re-enable / eject cycles leave the accounting exactly as it was
        arena.release_layout()
        m = arena.mark()
        w = arena.pin("draft", (3 * MIB,), torch.uint8)
        assert w.data_ptr() == arena.buf.data_ptr() + arena.top
        with_draft = arena.lay_out(1 * MIB, 4, *pb, min_pool_pages=2)
        arena.release_layout()
        assert arena.reset(m) == 3 * MIB
        assert arena.lay_out(1 * MIB, 4, *pb, min_pool_pages=2) == before
    assert arena.pinned_bytes == 0
    # the draft's bytes are what the pool loses: 3 MiB / 60,000-byte page pairs
    assert before.pool_pages - with_draft.pool_pages in (3 * MIB // sum(pb), -(-3 * MIB // sum(pb)))
    assert with_draft.mib()["pinned"] == pytest.approx(3.0)


def test_capacity_if_pinned_predicts_a_pinned_reservation(model):
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    cache.set_phase("decode")
    pair = pair_bytes()
    assert cache.capacity_if_pinned(0) == cache.layout.pool_pages // SPEC.n_layers
    assert cache.capacity_if_pinned(SPEC.n_layers * 2 * pair) == cache.layout.pool_pages // SPEC.n_layers - 2
    assert cache.capacity_if_pinned(-SPEC.n_layers * 3 * pair) == cache.layout.pool_pages // SPEC.n_layers + 3


def test_views_share_the_one_allocation(model):
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    base, end = cache.arena.buf.data_ptr(), cache.arena.buf.data_ptr() + cache.arena.nbytes
    for t in (cache.kspace, cache.vspace):
        assert base <= t.data_ptr() and t.data_ptr() + t.numel() <= end


def test_gates_name_the_numbers(model):
    with pytest.raises(ArenaTooSmall, match=r"too small: slab .* need .* MiB; give arena.mib >= \d+"):
        paged(model, "stream", mib=0.5, ring=8)
    with pytest.raises(ArenaTooSmall, match=r"cache.mode=resident, 2048 tokens x 2 layers"):
        paged(model, "resident", mib=small_arena_mib(model, 4, 0))
    with pytest.raises(ValueError, match="cache.type_k='q5_0'; choose one of f16, q8_0, q4_0"):  # at the config
        paged(model, "resident", types=("q5_0", "q4_0"))
    with pytest.raises(ValueError, match="exceeds the model's 4096"):
        paged(model, "resident", max_tokens=5000)
    cache = paged(model, "resident", max_tokens=300)
    with pytest.raises(ContextOverflow, match="301 tokens exceeds the cache's 300"):
        prefill(model, cache, list(range(301)), CHUNK)
    with pytest.raises(ValueError, match="ring_pages=1"):
        paged(model, "stream", ring=1)


def test_a_host_store_beyond_the_hosts_memory_is_refused(monkeypatch):
    """Pinned pages cannot swap: a store larger than the host's available memory is refused
    with both numbers before anything is allocated."""
    from kvstream.cache import host_store

    monkeypatch.setattr(host_store, "available_host_bytes", lambda: 64 * 2**20)
    fmt = PageFormat("q8_0", 2, 128)
    with pytest.raises(MemoryError, match=r"needs 182 MiB \(28 layers x 64 pages x 104 KiB of K\+V\) but the "
                                          r"host has 64 MiB available"):
        host_store.HostStore(28, 64, fmt, PageFormat("q4_0", 2, 128), pin=False)
    assert host_store.HostStore(2, 4, fmt, fmt, pin=False).nbytes == 2 * 4 * 2 * fmt.page_bytes


def test_decode_batch_wider_than_the_verify_width_is_refused(model, tokens):
    cache = paged(model, "resident")  # reserved for verify batches of 1
    prefill(model, cache, tokens[:300], CHUNK)
    cache.set_phase("decode")
    with pytest.raises(ValueError, match="decode batch of 5 tokens is wider than the reserved verify width 1"):
        with torch.inference_mode():
            model(torch.tensor(tokens[300:305]), cache)


def test_generate_records_one_telemetry_row_per_decode_step(model, tokens):
    from kvstream.engine.generate import generate
    from kvstream.model.sampling import Sampler, SamplingParams

    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    g = generate(model, cache, tokens[:PROMPT], 6, Sampler(SamplingParams()), prefill_chunk=CHUNK)
    assert [r.step for r in g.records] == list(range(5))
    last = g.records[-1]
    assert (last.context, last.pages_per_layer, last.new_tokens) == (PROMPT + 5, 8, 1)
    assert (last.resident_pages, last.streamed_pages) == (4, 4) and last.h2d_bytes == 4 * 2 * pair_bytes()


def test_run_ahead_generation_equals_step_by_step_and_rolls_back_after_a_stop(model, tokens):
    """generate(run_ahead=True), what CUDA runs, queues each step before reading the token that
    feeds it; on a stop token the step queued after it is rolled back."""
    from kvstream.engine.generate import generate
    from kvstream.model.sampling import Sampler, SamplingParams

    def gen(ahead, stop=()):
        cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
        g = generate(model, cache, tokens[:PROMPT], 12, Sampler(SamplingParams()), prefill_chunk=CHUNK,
                     stop_ids=stop, run_ahead=ahead)
        return g, cache

    (plain, c0), (ahead, c1) = gen(False), gen(True)
    assert ahead.tokens == plain.tokens and len(ahead.records) == len(plain.records) == 11
    assert [r.context for r in ahead.records] == [r.context for r in plain.records]
    assert c1.length == c0.length == PROMPT + 11
    k = 5
    t = plain.tokens[k]
    k = plain.tokens.index(t)  # its first occurrence stops the run
    class Counting:  # the model, counting its forward passes
        def __init__(self):
            self.calls = 0

        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return model(*args, **kwargs)

    for run_ahead in (False, True):
        counted = Counting()
        cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
        g = generate(counted, cache, tokens[:PROMPT], 12, Sampler(SamplingParams()), prefill_chunk=CHUNK,
                     stop_ids=[t], run_ahead=run_ahead)
        assert (g.tokens, g.stopped_on) == (plain.tokens[:k + 1], t)
        assert cache.length == PROMPT + k and len(g.records) == k  # the stop token is never fed
        assert counted.calls == PROMPT // CHUNK + k + run_ahead  # prefill chunks, steps, the one queued ahead
    assert generate(model, paged(model, "resident"), tokens[:PROMPT], 0, Sampler(SamplingParams()),
                    prefill_chunk=CHUNK, run_ahead=True).tokens == []


def test_pages_being_written_stay_resident_whatever_the_policy(model, tokens):
    """sink_newest with 2 pages per layer keeps page 0 and the tail; a batch that writes the
    last rows of one page and the first of the next needs both in the pool (the store kernel and
    the write-back address them there): the engine makes them resident for that step."""
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8, residency="sink_newest")
    ref = paged(model, "resident")
    with torch.inference_mode():
        logits = []
        for c in (cache, ref):
            prefill(model, c, tokens[:506], CHUNK)  # prefill phase throughout: its smaller pool
            model(torch.tensor(tokens[506:515]), c)  # rows 506..514: pages 1 and 2
            logits.append(model(torch.tensor(tokens[515:516]), c))
    assert cache.capacity == 2 and set(cache.slot) == {1, 2}  # the policy alone would keep {0, 2}
    for host, other in ((cache.host.k, ref.host.k), (cache.host.v, ref.host.v)):
        assert torch.equal(host[:, 1], other[:, 1])  # page 1, completed by the crossing batch
    # page 1 streams in the last step, in rounds: the one call's computation, bit for bit
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("n, L", [(1, 40), (7, 300), (40, 40)])
def test_causal_attention_equals_softmax_under_an_explicit_mask(n, L):
    """The lower-right causal bias against plain fp64 arithmetic: query i (position L - n + i) sees
    keys 0 .. L - n + i; GQA 6 query heads per KV head."""
    g = torch.Generator().manual_seed(n * 1000 + L)
    q, k, v = (torch.randn(m, h, 64, generator=g) for m, h in ((n, 12), (L, 2), (L, 2)))
    kk, vv = (t.double().repeat_interleave(6, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) / 8.0
    visible = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vv)
    # fp32 SDPA vs an fp64 reference: fp32 rounding of 64-term dots and an L-term softmax sum
    assert torch.allclose(causal_attention(q, k, v).double(), ref, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("layers, max_pages, capacity, ring, residency", [
    (28, 128, 26, 64, "newest"), (28, 128, 10, 8, "newest"), (7, 64, 20, None, "newest"),
    (3, 16, 4, 16, "sink_newest"), (2, 16, 3, 2, "newest")])
def test_page_tables_map_every_page_where_the_plan_puts_it(layers, max_pages, capacity, ring, residency):
    """The tables, built a column per page for all layers at once, against the rule page by
    page: a resident page of layer l sits in the pool at ring + l * capacity + its slot; a
    streamed page of round r at its place in the round's ring half (a group's layers side by
    side), the halves taken in turn by the copies in the order they run (group by group, round
    by round: a counter here, not the cache's formula). Integers: equal or not."""
    pair = pair_bytes()
    arena = Arena(ArenaPlan(0, ring or 2 * max_pages, pair).bytes(layers * capacity), "cpu")
    cache = PagedCache(n_layers=layers, n_kv_heads=SPEC.n_kv_heads, head_dim=SPEC.head_dim,
                       max_tokens=max_pages * PAGE_TOKENS, type_k="q8_0", type_v="q4_0", mode="stream", arena=arena,
                       ring_pages=ring, slabs={"prefill": 0, "decode": 0}, residency=RESIDENCY[residency]())
    for n in (max_pages // 2, max_pages // 2 + 1, max_pages):  # a plan, then a page opening, then the full context
        cache.length = (n - 1) * PAGE_TOKENS
        cache._plan(n, upload_below=n - 1, writing=range(n - 1, n))
        half, copies = max(1, cache.ring_pages // 2), 0
        for g in range(0, layers, cache.group):  # the copies in the order they run: each takes the other half
            for r, (_, _, pages) in enumerate(cache.rounds):
                # a group's one run of pages is copied with the half's share per layer (padded)
                one_run = bool(pages) and pages[-1] - pages[0] == len(pages) - 1
                pitch = half // cache.group if cache.group > 1 and one_run and \
                    pages[0] + half // cache.group <= max_pages else len(pages)
                for l in range(g, min(g + cache.group, layers)):
                    base = (copies % 2) * half + (l - g) * pitch
                    for i, p in enumerate(pages):
                        assert cache.tables_host[l, p] == base + i
                copies += 1
        for l in range(layers):
            for p, j in cache.slot.items():
                assert cache.tables_host[l, p] == cache.ring_pages + l * cache.capacity + j
        assert torch.equal(cache.tables, cache.tables_host)


def test_a_re_layout_that_keeps_the_streamed_set_copies_the_first_round_again(model):
    """A re-layout (a pin, as a draft's re-enable makes) that leaves the one-round plan's
    streamed pages as they were still moves the ring's V rows (they follow the pool): the next
    step must copy its first round again, not trust the one the last step's end copied. Eager
    decode across it equals the resident cache bit for bit."""
    decode, max_tokens = 40, 3072
    toks = torch.randint(0, 357, (PROMPT + decode,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = run(model, paged(model, "resident", max_tokens=max_tokens), toks, decode)
    cache = paged(model, "stream", mib=small_arena_mib(model, 6, 16, max_tokens), ring=16, max_tokens=max_tokens,
                  step=3)
    out = [prefill(model, cache, toks[:PROMPT], CHUNK)]
    cache.set_phase("decode")
    streamed, v_offset = list(cache.rounds[0][2]), cache.layout.v_offset
    with torch.inference_mode():
        for i, t in enumerate(toks[PROMPT:PROMPT + decode - 1]):
            if i == decode // 2:  # one page pair pinned: a resident page per layer fewer, same streamed pages
                cache.rearrange(lambda: cache.arena.pin("extra", (pair_bytes() * 2,), torch.uint8))
            out.append(model(torch.tensor([t], device=model.device), cache)[-1])
            if i == decode // 2:
                assert cache.capacity == 5 and list(cache.rounds[0][2]) == streamed
                assert cache.layout.v_offset != v_offset
    assert torch.equal(torch.stack(out), ref)


@torch.inference_mode()
def test_a_pass_staged_ahead_is_the_pass_begin_would_stage(model, tokens):
    """``stage_ahead(n)`` then ``begin(m)``, m <= n: the positions, slots and lengths a begin that
    stages itself writes, with no staging in the begin; a begin at another length, or wider than
    the staged pass, or after a plan (a page opening: the new page's slots were not in the tables
    when it was staged) stages anew."""
    c = paged(model, "resident", verify_width=8)
    run(model, c, tokens[:250], decode=0)
    c.set_phase("decode")
    calls, stage_step = [], c._stage_step
    c._stage_step = lambda n: (calls.append(n), stage_step(n))[1]

    def staged(length, m, ahead=None):
        c.length = length  # (no rows are written or read here: the staging is a function of the length and tables)
        if ahead is not None:
            c.stage_ahead(ahead)
        before = len(calls)
        c.begin(m)
        out = c._step.clone(), c.pos.clone(), c.slots.clone(), int(c.seq_len), len(calls) - before
        c._n = 0  # nothing to commit
        return out

    for length, m, n in [(240, 3, 8), (250, 1, 1), (248, 4, 6), (244, 2, 8)]:
        step, pos, slots, seq_len, n_staged = staged(length, m, ahead=n)
        fresh = staged(length, m)
        assert n_staged == 0 and fresh[4] == 1, (length, m, n)
        assert torch.equal(pos, fresh[1]) and torch.equal(slots, fresh[2]) and seq_len == fresh[3] == length + m
        assert torch.equal(step, fresh[0]) or m < n  # a wider staged pass leaves more rows (unread)
    c.stage_ahead(4)
    assert staged(241, 3)[4] == 1  # another length
    c.stage_ahead(2)
    assert staged(241, 3)[4] == 1  # wider than staged
    got = staged(249, 8, ahead=8)  # rows 249..256 staged before page 1 had a slot in the tables
    assert got[4] == 1  # page 1 opens in the begin (new tables): staged anew
    fresh = staged(249, 8)  # (the tables now hold page 1)
    assert torch.equal(got[2], fresh[2]) and int(got[2][0, -1]) // PAGE_TOKENS != int(got[2][0, 0]) // PAGE_TOKENS


@torch.inference_mode()
def test_a_pass_staged_on_the_device_is_used_once_its_length_is_claimed(model, tokens):
    """``stage_ahead_on_device(length, most, n)`` (a length only the device knows, as a draft model's
    next one hangs on the verify's accepted count): after ``claim_staged`` tells that length, a
    ``begin`` there stages nothing and its positions, slots and lengths are those of a begin that
    stages itself. Unclaimed, after another begin, at another length, after a plan, or with rows
    that could pass the cache's end, it is not used."""
    c = paged(model, "resident", verify_width=8)
    run(model, c, tokens[:250], decode=0)
    c.set_phase("decode")
    calls, stage_step = [], c._stage_step
    c._stage_step = lambda n: (calls.append(n), stage_step(n))[1]

    def begin(length, m):
        c.length = length  # (no rows are written or read: the staging is a function of the length and tables)
        before = len(calls)
        c.begin(m)
        # the static buffers a captured pass reads (positions, slots, the lengths after each row: the
        # kernels' seq_len on CUDA) and what begin hands the layers
        out = (c._pos[:m].clone(), c._slots[:, :m].clone(), c._lens[:m].clone()), c.pos.clone(), c.slots.clone(), \
            int(c.seq_len), len(calls) - before
        c._n = 0  # nothing to commit
        return out

    def on_device(length, most, n, claim=None, offset=0):
        c.stage_ahead_on_device(torch.tensor([length - offset]), most, n, offset=offset)
        if claim is not None:
            c.claim_staged(claim)

    for length, most, m, n, offset in [(240, 243, 3, 8, 0), (247, 250, 2, 6, 245), (250, 250, 1, 1, 0)]:
        on_device(length, most, n, claim=length, offset=offset)  # (a draft: the accepted count + the rows before)
        got = begin(length, m)
        fresh = begin(length, m)
        assert got[4] == 0 and fresh[4] == 1, (length, m, n)
        assert torch.equal(got[1], fresh[1]) and torch.equal(got[2], fresh[2]) and got[3] == fresh[3] == length + m
        assert all(torch.equal(a, b) for a, b in zip(got[0], fresh[0]))
        assert torch.equal(got[0][2], torch.arange(length + 1, length + m + 1))
    on_device(240, 243, 4)  # unclaimed
    assert begin(240, 3)[4] == 1
    on_device(240, 243, 4, claim=241)  # claimed at another length than the begin's
    assert begin(240, 3)[4] == 1
    on_device(240, 243, 4)
    begin(240, 3)  # another begin between the staging and its claim
    c.claim_staged(240)
    assert begin(240, 3)[4] == 1
    on_device(249, 249, 8, claim=249)  # rows 249..256 staged before page 1 had a slot in the tables
    assert begin(249, 8)[4] == 1  # page 1 opens in the begin: staged anew
    on_device(240, c.max_tokens - 2, 4, claim=240)  # rows that might pass the end: not staged at all
    assert begin(240, 3)[4] == 1


@pytest.mark.parametrize("ops", ["reference", "kernel"])
@pytest.mark.parametrize("mode", ["resident", "stream"])
@torch.inference_mode()
def test_a_step_that_stages_its_successor_leaves_the_host_nothing_to_stage(model, mode, ops):
    """A one-row pass ending with ``stage_next_on_device`` (a greedy step's graph), then its commit and
    ``claim_next``: the next ``begin(1)`` stages nothing, and its positions, slots and lengths are the
    host tables' (checked against numpy, not against ``_stage_step``), except at a page opening, where
    the begin re-plans and stages itself; a rollback makes the next begin stage too. ``kernel``: the
    staging by ``kernels.stage`` (CUDA's; here under the interpreter) instead of its torch reference."""
    c = paged(model, mode, **({} if mode == "resident" else {"mib": small_arena_mib(model, 4, 4), "ring": 4}))
    if ops == "kernel":
        if torch.cuda.is_available():  # (the interpreter runs it on these CPU tensors only where it is on)
            pytest.skip("the kernel on a CPU cache needs the Triton interpreter; test_cuda's greedy decode runs it")
        from kernels.stage import stage_rows
        c.ops.stage_rows = stage_rows
    prefill(model, c, torch.zeros(1000, dtype=torch.long).tolist(), CHUNK)
    c.set_phase("decode")
    calls, stage_step = [], c._stage_step
    c._stage_step = lambda n: (calls.append(c.length), stage_step(n))[1]
    for _ in range(300):  # 1000 -> 1300: pages open at 1024 and 1280
        c.begin(1)
        p = c.length
        slots = c.tables_host.numpy()[:, p // PAGE_TOKENS] * PAGE_TOKENS + p % PAGE_TOKENS
        want = np.concatenate([[p], slots, [p + 1]])
        assert c._pos[:1].tolist() + c._slots[:, 0].tolist() + c._lens[:1].tolist() == want.tolist(), p
        assert c.pos.tolist() == [p] and int(c.seq_len) == p + 1
        c.stage_next_on_device()
        c.commit()
        c.claim_next()
    assert calls == [1000, 1024, 1280]
    assert c.stats.streamed_pages == (0 if mode == "resident" else 2)  # (the stream case streams)
    c.truncate(1290)
    c.begin(1)
    assert calls[-1] == 1290
