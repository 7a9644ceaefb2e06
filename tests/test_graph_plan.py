"""What a captured decode step reads of a streaming plan (kvstream.engine.graphs): the copies a
step issues, their shape across page openings, and the padded group copies' exactness (CPU:
the eager path that the captured one replays; tests/test_cuda.py replays it on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvstream.cache.arena import MIB, ArenaPlan, pair_bytes
from kvstream.cache.cudart import rows_of
from kvstream.cache.factory import make_cache, phase_slabs
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.engine.generate import prefill
from kvstream.model.qwen import load_model
from tiny_gguf import TinySpec, write_tiny_model

# four layers, so a ring half can hold a group of two layers' streamed pages
SPEC = TinySpec(arch="qwen2", hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn=128, n_layers=4,
                context_length=4096)
PROMPT, WIDTH, STEPS, CHUNK, MAX_TOKENS = 1000, 5, 400, 64, 3072  # decode from 4 pages to 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("plan") / "m.gguf", SPEC))


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 357, (PROMPT + WIDTH * STEPS,), generator=torch.Generator().manual_seed(5)).tolist()


def cache_for(model, mode, resident=2, ring=16):
    cfg = CacheConfig(mode=mode, type_k="q8_0", type_v="q4_0", ring_pages=ring if mode == "stream" else "auto")
    if mode != "stream":
        return make_cache(cfg, ArenaConfig("auto"), model, MAX_TOKENS, CHUNK, verify_width=WIDTH)
    slabs = phase_slabs(cfg, model, MAX_TOKENS, CHUNK, WIDTH)
    if model.device.type == "cuda":  # measured slabs: the decode phase keeps the prefill's (test_paged_cache.slabs)
        slabs = {k: max(slabs.values()) for k in slabs}
    # exactly ``resident`` pages per layer in the decode layout (the prefill's fits)
    pair = pair_bytes("q8_0", "q4_0", SPEC.n_kv_heads, SPEC.head_dim)
    nbytes = max(ArenaPlan(slabs["decode"], ring, pair).bytes(SPEC.n_layers * resident),
                 ArenaPlan(slabs["prefill"], ring, pair).bytes(SPEC.n_layers * 2))
    return make_cache(cfg, ArenaConfig(str(nbytes / MIB)), model, MAX_TOKENS, CHUNK, verify_width=WIDTH,
                      slabs=slabs if model.device.type == "cuda" else None)


def decode(model, cache, tokens, each_step=None):
    """Prefill, then STEPS batches of WIDTH tokens; the logits of every batch."""
    prefill(model, cache, tokens[:PROMPT], CHUNK)
    cache.set_phase("decode")
    out = []
    with torch.inference_mode():
        for i in range(STEPS):
            batch = torch.tensor(tokens[PROMPT + i * WIDTH:PROMPT + (i + 1) * WIDTH], device=model.device)
            out.append(model(batch, cache, all_logits=True))
            if each_step is not None:
                each_step(cache)
    return torch.cat(out)


@pytest.fixture(scope="module")
def resident_logits(model, tokens):
    """A resident cache's logits over ``tokens`` (``decode``): the reference of the streaming cases."""
    return decode(model, cache_for(model, "resident"), tokens)


@pytest.mark.parametrize("ring", [16, 40])
def test_step_copies_are_the_copies_a_step_issues_and_group_copies_keep_the_logits(model, tokens, resident_logits,
                                                                                   ring):
    """Across page openings from 1 to 9 streamed pages per layer, ``step_plan`` lists exactly the
    copies each eager step issues, in order: what a captured step's memcpy nodes are matched
    with and re-pointed to. Ring 16 (halves of 8; the layout can stream 10 pages per layer): one
    layer per copy, then two rounds. Ring 40 (halves of 20): groups of two layers whose padded
    copies move 10 pages per layer, whatever the count streamed. The logits equal a resident
    cache's bit for bit (one attention call over the same bytes, the padded pages' ring copies
    unread)."""
    cache = cache_for(model, "stream", ring=ring)
    issued, begin, copy = [], cache.begin, cache.copier.copy
    seen = []  # (plan_key, shape, group, pitch, streamed) per decode step

    def tracked_begin(n):
        pos = begin(n)
        if cache.phase == "decode":
            shape, rows = cache.step_plan()
            seen.append((cache.plan_key(), shape, cache.group, cache._pitch(0), len(cache.rounds[0][2]), rows))
            issued.clear()  # begin's own copy of a new plan's first round is eager, not the step's
        return pos

    def tracked_copy(dst, src, half):
        issued.append(rows_of(dst, src))
        copy(dst, src, half)

    def check(_):
        assert issued == seen[-1][-1]
        if len(seen) > 1 and seen[-1][0] == seen[-2][0]:  # (a new plan's first round is copied again by begin)
            assert cache.stats.h2d_bytes == sum(c[4] * c[5] for c in issued)  # the step's copies counted

    cache.begin, cache.copier.copy = tracked_begin, tracked_copy
    got = decode(model, cache, tokens, check)
    assert torch.equal(got, resident_logits)
    groups = {(g, pitch, s) for _, _, g, pitch, s, _ in seen}
    plans, shapes = {k[0] for k in seen}, {k[1] for k in seen}
    assert len(plans) >= 8, len(plans)  # 8 page openings
    if ring == 16:  # one shape per round count (one round, two) and wrap
        assert {g for g, _, _ in groups} == {1} and max(len(k[1][0]) for k in seen) == 2
        assert len(shapes) <= 3, shapes
    else:  # one group and one padded pitch throughout: one shape
        assert {(g, pitch) for g, pitch, _ in groups} == {(2, 10)} and len(shapes) == 1, (groups, shapes)


@pytest.mark.parametrize("ring", [12, 40])
def test_page_openings_keep_the_step_shape(model, tokens, ring):
    """Ring 12 (halves of 6; the layout can stream 10 pages per layer, more than half a half): one
    layer per copy from the first streamed page; with 1-6 streamed pages in one round, every page
    opening is a new plan of one shape, its copies 1-D (re-pointed in a graph, not captured).
    Ring 40 (halves of 20): 1-9 streamed pages in groups of two layers whose 2-D copies move 10
    pages each: nine plans, one shape and the very same copies."""
    cache = cache_for(model, "stream", resident=2, ring=ring)
    seen = []
    decode(model, cache, tokens, lambda c: seen.append((c.plan_key(), *c.step_plan(), c.group, len(c.rounds))))
    if ring == 12:
        one = [(k, shape) for k, shape, _, g, r in seen if g == 1 and r == 1]
        assert len({k for k, _ in one}) == 6 and len({s for _, s in one}) == 1
        assert all(c is None for c in one[0][1][3])  # every copy 1-D
    else:
        assert len({k for k, *_ in seen}) == 9 and len({shape for _, shape, *_ in seen}) == 1
        assert len({tuple(rows) for _, _, rows, *_ in seen}) == 1 and all(r[-1] == 2 for r in seen[0][2])


def test_a_capture_runs_with_cycle_collection_off():
    """``graphs._no_collection`` (around every capture): no collection inside, so no dropped cache's
    finalizer gives its memory pool back mid-capture (that aborts the process on CUDA); collection is
    back after, an exception included, and stays off where it was off."""
    import gc

    from kvstream.engine.graphs import _no_collection

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with _no_collection():
            assert not gc.isenabled()
            raise RuntimeError("a capture that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
