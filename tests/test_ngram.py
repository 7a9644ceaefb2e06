"""n-gram drafters (llama.cpp semantics), the speculator chain, statistics and the registry.

Histories are crafted so that each rule is visible; two randomised tests compare the
incremental drafters with literal ports of llama.cpp's backward scans.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from kvstream.speculators import registry
from kvstream.speculators.base import Speculator, SpeculatorStats
from kvstream.speculators.chain import Chain, build_chain
from kvstream.speculators.registry import (
    UnknownSpeculatorError,
    create,
    known_names,
    parse_chain_spec,
)
from kvstream.speculators.ngram_map_k import NgramMapK
from kvstream.speculators.ngram_mod import NgramMod, NgramModTable
from kvstream.speculators.ngram_simple import NgramSimple

FILLER = list(range(1000, 1010))  # ten tokens that occur nowhere else


# --------------------------------------------------------------------------------------------
# literal ports of llama.cpp's scans (start 0 allowed, as in the drafters)
# --------------------------------------------------------------------------------------------


def ref_simple(h, n, m):
    """common_ngram_simple_draft, with inp = h[:-1], sampled = h[-1]."""
    inp, cur_len = h[:-1], len(h) - 1
    if cur_len <= n + m + 1:
        return []
    pattern = h[-n:]
    for j in range(cur_len - n - 1, -1, -1):
        if inp[j:j + n] == pattern:
            copy = min(m, cur_len - (j + n))
            return inp[j + n:j + n + copy] if copy >= n else []
    return []


class RefMapK:
    """common_ngram_map_draft / _accept (key_only) with an ideal (collision-free) key_map."""

    def __init__(self, n, m, min_hits=1):
        self.n, self.m, self.min_hits = n, m, min_hits
        self.key_map, self.last_idx, self.keys, self.last = {}, -1, {}, None

    def draft(self, h):
        n, m = self.n, self.m
        self.last = None
        inp, cur_len = h[:-1], len(h) - 1
        if cur_len < 2 * n + m:
            return []
        key = tuple(h[-n:])
        limit = cur_len - n - m - 1
        match = None
        if key in self.key_map and self.key_map[key] < limit:
            match = self.key_map[key]
        if match is None:
            for j in range(limit, self.last_idx, -1):
                if tuple(inp[j:j + n]) == key:
                    match = j
                    break
        for j in range(limit, self.last_idx, -1):  # descending, first writer wins
            self.key_map.setdefault(tuple(inp[j:j + n]), j)
        self.last_idx = max(limit, self.last_idx)
        if match is None:
            return []
        st = self.keys.setdefault(key, [0, m])
        st[0] = min(st[0] + 1, 16380)
        if st[0] < self.min_hits:
            return []
        self.last = st
        return inp[match + n:match + n + min(m, st[1])]

    def accept(self, n_acc):
        if self.last is not None and n_acc > 0:
            self.last[1] = n_acc


# --------------------------------------------------------------------------------------------
# ngram-simple
# --------------------------------------------------------------------------------------------


def test_simple_defaults_match_llama_cpp():
    s = NgramSimple()
    assert (s.n, s.m, s.max_draft, s.name) == (12, 48, 48, "ngram-simple")


def test_simple_match():
    h = FILLER + [1, 2, 3, 10, 11, 12, 13, 14, 15, 16] + [20, 21] + [1, 2, 3]
    assert NgramSimple(n=3, m=4).propose(h, 16) == [10, 11, 12, 13]


def test_simple_no_match():
    h = FILLER + [1, 2, 3, 10, 11, 12, 13, 14, 15, 16] + [20, 21] + [1, 2, 4]
    assert NgramSimple(n=3, m=4).propose(h, 16) == []


def test_simple_most_recent_match_wins():
    h = (FILLER + [1, 2, 3, 10, 11, 12, 13, 14] + [30, 31]
         + [1, 2, 3, 20, 21, 22, 23, 24] + [40, 41] + [1, 2, 3])
    assert NgramSimple(n=3, m=4).propose(h, 16) == [20, 21, 22, 23]


def test_simple_truncated_at_n_max_and_at_history_end():
    h = FILLER + [1, 2, 3, 10, 11, 12, 13, 14, 15, 16] + [20, 21] + [1, 2, 3]
    assert NgramSimple(n=3, m=4).propose(h, 2) == [10, 11]
    # the continuation runs into the current key: it stops before the sampled token
    h = FILLER + [1, 2, 3, 5, 6, 7] + [1, 2, 3]
    assert NgramSimple(n=3, m=8).propose(h, 16) == [5, 6, 7, 1, 2]


def test_simple_short_continuation_gives_no_draft_even_with_an_older_match():
    # llama.cpp takes the most recent occurrence only; fewer than n tokens after it: no draft
    h = [1, 2, 3, 40, 41, 42, 43, 44] + FILLER + [1, 2, 3, 1, 2, 3]
    assert NgramSimple(n=3, m=4).propose(h, 16) == []
    assert ref_simple(h, 3, 4) == []


def test_simple_needs_more_than_n_plus_m_plus_1_tokens():
    # cur_len = len(history) - 1 must exceed n + m + 1 (= 8 here)
    assert NgramSimple(n=3, m=4).propose([1, 2, 3, 10, 11, 12, 1, 2, 3], 16) == []
    assert NgramSimple(n=3, m=4).propose([9, 1, 2, 3, 10, 11, 12, 1, 2, 3], 16) == [10, 11, 12, 1]


def test_simple_match_at_start_zero_is_found():
    # deviation: llama.cpp's "match_pos == 0 means no match" sentinel would miss this one
    h = [1, 2, 3, 10, 11, 12, 13] + FILLER + [1, 2, 3]
    assert NgramSimple(n=3, m=4).propose(h, 16) == [10, 11, 12, 13]


def test_simple_incremental_equals_backward_scan():
    rng = random.Random(1)
    for n, m in ((2, 3), (3, 5), (4, 2)):
        s = NgramSimple(n=n, m=m)
        h = [rng.randrange(4) for _ in range(5)]
        for _ in range(400):
            h.extend(rng.randrange(4) for _ in range(rng.choice((1, 1, 1, 3))))
            assert s.propose(h, 100) == ref_simple(h, n, m)
        # an unrelated history is a new sequence: same answer as a fresh drafter
        h2 = [rng.randrange(4) for _ in range(60)]
        assert s.propose(h2, 100) == NgramSimple(n=n, m=m).propose(h2, 100) == ref_simple(h2, n, m)


# --------------------------------------------------------------------------------------------
# ngram-map-k
# --------------------------------------------------------------------------------------------


def test_map_k_defaults_match_llama_cpp():
    s = NgramMapK()
    assert (s.n, s.m, s.min_hits, s.name) == (12, 48, 1, "ngram-map-k")


def _map_k_history():
    # key (1, 2) followed by m = 3 tokens (plus one: starts need m + 1 tokens after the key)
    return FILLER + [1, 2, 7, 8, 9, 50] + [60, 61] + [1, 2]


def test_map_k_match_and_no_match():
    assert NgramMapK(n=2, m=3).propose(_map_k_history(), 16) == [7, 8, 9]
    assert NgramMapK(n=2, m=3).propose(_map_k_history()[:-1] + [3], 16) == []


def test_map_k_needs_m_plus_one_tokens_after_the_match():
    # the occurrence ends too close to the present (start > cur_len - n - m - 1): no draft
    h = FILLER + [1, 2, 7, 8] + [1, 2]
    assert NgramMapK(n=2, m=3).propose(h, 16) == []


def test_map_k_min_hits():
    d = NgramMapK(n=2, m=3, min_hits=2)
    h = _map_k_history()
    assert d.propose(h, 16) == []  # first hit of the key: not enough
    assert d.keys[(1, 2)].hits == 1
    h = h + [7, 8, 9, 1, 2]
    assert d.propose(h, 16) == [7, 8, 9]  # second hit
    assert d.keys[(1, 2)].hits == 2
    d3 = NgramMapK(n=2, m=3, min_hits=3)
    assert d3.propose(_map_k_history(), 16) == []
    assert d3.propose(_map_k_history() + [7, 8, 9, 1, 2], 16) == []
    assert d3.propose(_map_k_history() + [7, 8, 9, 1, 2, 7, 8, 9, 1, 2], 16) == [7, 8, 9]


def test_map_k_feedback_caps_the_keys_next_draft():
    d = NgramMapK(n=2, m=3)
    h = _map_k_history()
    assert d.propose(h, 16) == [7, 8, 9]
    d.accepted(3, 1)
    h = h + [7, 60, 1, 2]
    assert d.propose(h, 16) == [7]  # the key drafts as many as were accepted last time
    d.accepted(1, 0)  # 0 is never forwarded by llama.cpp: the key keeps its last value
    h = h + [70, 71, 1, 2]
    assert d.propose(h, 16) == [7]
    assert d.keys[(1, 2)].n_accepted == 1


def test_map_k_first_registered_occurrence_wins_across_calls():
    # llama.cpp's key_map: first writer wins, so once registered the key keeps its start
    d = NgramMapK(n=2, m=3)
    h = FILLER + [1, 2, 7, 8, 9, 50] + [60, 61, 62, 63]
    d.propose(h, 16)  # registers start 10 of (1, 2)
    h = h + [1, 2, 20, 21, 22, 23] + [64, 65, 66, 67] + [1, 2]
    assert d.propose(h, 16) == [7, 8, 9]
    # ...whereas among the starts added in one call the most recent is registered
    assert NgramMapK(n=2, m=3).propose(h, 16) == [20, 21, 22]


def test_map_k_incremental_equals_literal_port():
    rng = random.Random(2)
    for n, m, min_hits in ((2, 3, 1), (2, 2, 2), (3, 4, 1)):
        d, ref = NgramMapK(n=n, m=m, min_hits=min_hits), RefMapK(n, m, min_hits)
        h = [rng.randrange(3) for _ in range(3)]
        for _ in range(400):
            h.extend(rng.randrange(3) for _ in range(rng.choice((1, 1, 2))))
            got, want = d.propose(h, 100), ref.draft(h)
            assert got == want
            if got:
                acc = rng.randrange(len(got) + 1)
                d.accepted(len(got), acc)
                ref.accept(acc)


# --------------------------------------------------------------------------------------------
# ngram-mod
# --------------------------------------------------------------------------------------------


def test_mod_defaults_match_llama_cpp():
    d = NgramMod()
    assert (d.n, d.n_max, d.n_min, d.name) == (24, 64, 48, "ngram-mod")
    assert d.table.size == 4 * 1024 * 1024 and d.table.nbytes == 16 * 1024 * 1024
    assert (d.occupancy_limit, d.low_accept_frac, d.low_accept_rounds) == (0.25, 0.5, 3)


def test_mod_hash_is_llama_cpps_lcg_and_vectorised_insert_agrees():
    t = NgramModTable(n=3, size=1000)
    # h = ((0*K + a)*K + b)*K + c mod 2^64, then mod size
    K, M = 6364136223846793005, 2**64
    assert t.hash([5, 6, 7]) == ((5 * K + 6) * K + 7) % M
    assert t.slot([5, 6, 7]) == ((5 * K + 6) * K + 7) % M % 1000
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 150_000, size=300).tolist()
    t = NgramModTable(n=4, size=1 << 20)
    t.add_range(toks, 0, len(toks) - 4)
    want = {}
    for i in range(len(toks) - 4):  # scalar adds in order: last writer wins
        want[t.slot(toks[i:i + 4])] = toks[i + 4]
    assert t.used == len(want)
    for slot, tok in want.items():
        assert t.entries[slot] == tok


def test_mod_last_writer_wins():
    t = NgramModTable(n=2, size=1 << 16)
    t.add_range([1, 2, 3, 9, 9, 1, 2, 4], 0, 6)
    assert t.get([1, 2]) == 4
    assert t.get([5, 5]) == NgramModTable.EMPTY


def _cycle_history(n):
    # 40 distinct tokens, then the first 10 again: every n-gram of the cycle is known
    return list(range(100, 140)) + list(range(100, 110))


def test_mod_draft_follows_the_table():
    d = NgramMod(n=4, n_max=64, n_min=0, size=1 << 16)
    h = _cycle_history(4)
    assert d.propose(h, 10) == list(range(110, 120))
    # the walk continues past the end of the seen text through the table (cycle)
    got = d.propose(h, 64)
    assert got[:30] == list(range(110, 140)) and got[30:34] == [100, 101, 102, 103]
    assert len(got) == 64


def test_mod_no_draft_when_the_walk_stops_before_n_min():
    prompt = list(range(200, 230))  # begin adds its n-grams; (226..229) has no next token yet
    h = prompt + [1, 2, 3] + list(range(200, 205))  # too few new tokens for a chunk

    def fresh(n_min):
        d = NgramMod(n=4, n_max=64, n_min=n_min, size=1 << 16)
        d.begin(prompt)
        return d

    assert fresh(30).propose(h, 64) == []  # the walk stops after 25 tokens < n_min
    assert fresh(20).propose(h, 64) == list(range(205, 230))  # stops at the empty slot
    # n_min is capped by the call's budget: a budget below n_min still drafts
    assert fresh(48).propose(h, 8) == list(range(205, 213))


def test_mod_new_ngrams_are_added_in_chunks_of_32():
    d = NgramMod(n=2, n_max=8, n_min=1, size=1 << 16)
    h = [500 + i for i in range(10)]
    d.begin(h)
    assert d.i_last == 8
    h = h + [1, 2, 3, 4, 1, 2]
    assert d.propose(h, 8) == []  # i_last + 32 >= cur_len: (1, 2) not added yet
    assert d.i_last == 8
    h = h + [600 + i for i in range(40)] + [1, 2]
    # chunk added: (1, 2) -> 3, later overwritten by (1, 2) -> 600 (last writer wins)
    assert d.propose(h, 3) == [600, 601, 602]
    assert d.i_last == len(h) - 1 - 2


def test_mod_cleared_when_a_quarter_full_at_begin():
    d = NgramMod(n=2, n_max=8, n_min=1, size=64)
    d.begin(list(range(10)))  # 8 bigrams: 1/8 full, kept
    assert d.table.used == 8 and d.clears_full == 0
    d.begin(list(range(100, 120)))  # 18 more: 26/64 > 1/4 -> cleared
    assert d.table.used == 0 and d.clears_full == 1
    assert d.i_last == 18  # the prompt is not re-added after the clear


def test_mod_cleared_when_a_quarter_full_while_drafting():
    # deviation: also checked after the chunks added during decoding
    d = NgramMod(n=2, n_max=8, n_min=1, size=256)
    h = [7, 8, 9]
    d.begin(h)
    h = h + list(range(300, 400))  # > 64 new bigrams
    d.propose(h, 8)
    assert d.clears_full == 1 and d.table.used == 0


def _mod_round(d, h, acc):
    draft = d.propose(h, 8)
    assert draft
    d.accepted(len(draft), acc(len(draft)))


def test_mod_cleared_after_three_low_acceptance_rounds():
    d = NgramMod(n=4, n_max=8, n_min=1, size=1 << 16)
    h = _cycle_history(4)
    _mod_round(d, h, lambda k: 0)
    _mod_round(d, h, lambda k: k // 2 - 1)  # below 0.5
    assert d.n_low == 2 and d.table.used > 0
    _mod_round(d, h, lambda k: 1)
    assert d.clears_low == 1 and d.table.used == 0 and d.n_low == 0
    assert d.propose(h, 8) == []  # the table is empty; i_last kept: relearns from new tokens


def test_mod_good_round_breaks_the_low_streak():
    d = NgramMod(n=4, n_max=8, n_min=1, size=1 << 16)
    h = _cycle_history(4)
    for acc in (0, 0, 4, 0, 0):  # 4/8 = 0.5 is not low
        _mod_round(d, h, lambda k, a=acc: a)
    assert d.clears_low == 0 and d.n_low == 2 and d.table.used > 0
    _mod_round(d, h, lambda k: 0)
    assert d.clears_low == 1


def test_mod_reseed_after_reset_readds_the_history():
    d = NgramMod(n=4, n_max=8, n_min=1, size=1 << 16, reseed_after_reset=True)
    h = _cycle_history(4)
    for _ in range(3):
        _mod_round(d, h, lambda k: 0)
    assert d.clears_low == 1 and d.i_last == 0
    h = h + [110]  # next call: i_last + 32 < cur_len -> the whole history is added again
    assert d.propose(h, 4) == [111, 112, 113, 114]


def test_mod_shared_table():
    t = NgramModTable(n=4, size=1 << 16)
    a, b = NgramMod(n=4, n_min=1, table=t), NgramMod(n=4, n_min=1, table=t)
    a.begin(_cycle_history(4))
    assert b.propose([5, 6, 7, 100, 101, 102, 103], 3) == [104, 105, 106]
    with pytest.raises(ValueError):
        NgramMod(n=5, table=t)


# --------------------------------------------------------------------------------------------
# chain, statistics, registry
# --------------------------------------------------------------------------------------------


class Fixed(Speculator):
    """Drafts a fixed list; records the feedback it gets."""

    def __init__(self, name, draft):
        super().__init__()
        self.name, self.draft, self.feedback = name, list(draft), []

    def _propose(self, history, n_max, state):
        return self.draft

    def _accepted(self, n_drafted, n_accepted):
        self.feedback.append((n_drafted, n_accepted))


def test_chain_priority_and_only_the_winner_is_told():
    a, b, c = Fixed("a", []), Fixed("b", [5, 6, 7]), Fixed("c", [8])
    ch = Chain([a, b, c])
    assert ch.propose([1, 2, 3], 8) == [5, 6, 7]
    assert ch.last_winner is b and ch.last_probs is None
    ch.accepted(3, 2)
    assert b.feedback == [(3, 2)] and a.feedback == [] and c.feedback == []
    assert (a.stats.calls, b.stats.calls, c.stats.calls) == (1, 1, 0)
    # the first non-empty draft wins, also when a later one is longer
    ch.reorder(["c", "b", "a"])
    assert ch.propose([1], 8) == [8] and ch.last_winner is c
    ch.accepted(1, 1)
    assert c.feedback == [(1, 1)] and b.feedback == [(3, 2)]
    # a disabled speculator (an ejected draft) is skipped and not counted
    c.enabled = False
    assert ch.propose([1], 2) == [5, 6] and c.stats.calls == 1
    ch.accepted(2, 0)
    assert b.feedback[-1] == (2, 0)


def test_chain_feedback_errors_and_empty_rounds():
    ch = Chain([Fixed("a", [])])
    assert ch.propose([1], 4) == []
    ch.accepted(0, 0)  # nothing pending, nothing drafted: fine
    with pytest.raises(RuntimeError):
        ch.accepted(2, 1)
    ch = Chain([Fixed("a", [1, 2])])
    ch.propose([1], 4)
    with pytest.raises(ValueError):
        ch.accepted(3, 1)
    with pytest.raises(ValueError):
        ch.accepted(2, 3)
    with pytest.raises(ValueError):
        Chain([Fixed("a", []), Fixed("a", [1])])


def test_statistics_counts():
    a, b = Fixed("a", []), Fixed("b", [4, 5, 6, 7])
    ch = Chain([a, b])
    for acc in (4, 0, 2):
        assert ch.propose([1], 3) == [4, 5, 6]  # truncated to n_max
        ch.accepted(3, min(acc, 3))
    assert ch.stats()["b"].seconds > 0 and ch.stats()["a"].seconds > 0  # wall time of the proposals
    ch.stats()["a"].seconds = ch.stats()["b"].seconds = 0.0
    assert ch.stats()["b"] == SpeculatorStats(calls=3, drafts=3, drafted_tokens=9,
                                              accepted_tokens=5, accepted_drafts=2, feedbacks=3)
    assert ch.stats()["a"] == SpeculatorStats(calls=3)
    assert ch.stats()["b"].acceptance_rate == pytest.approx(5 / 9)
    assert ch.stats()["b"].as_dict()["drafted_tokens"] == 9
    assert ch.propose([1], 0) == [] and b.stats.calls == 3  # no budget: nobody is asked
    b.stats.clear()
    assert b.stats == SpeculatorStats()


def test_ngram_chain_end_to_end_stats():
    ch = build_chain("ngram-simple,ngram-mod", {"ngram-simple": {"n": 3, "m": 4},
                                                "ngram_mod": {"n": 2, "n_min": 1, "size": 1 << 16}})
    h = FILLER + [1, 2, 3, 10, 11, 12, 13, 14, 15, 16] + [20, 21] + [1, 2, 3]
    assert ch.propose(h, 8) == [10, 11, 12, 13] and ch.last_winner.name == "ngram-simple"
    ch.accepted(4, 4)
    h2 = [100, 101, 102, 103, 100, 101]  # a new sequence, too short for ngram-simple
    assert ch.propose(h2, 8) == [102, 103, 100] and ch.last_winner.name == "ngram-mod"
    ch.accepted(3, 3)
    st = ch.stats()
    assert (st["ngram-simple"].calls, st["ngram-simple"].drafts) == (2, 1)
    assert (st["ngram-mod"].calls, st["ngram-mod"].drafts, st["ngram-mod"].accepted_tokens) == (1, 1, 3)


def test_registry_builds_chains():
    assert build_chain("none").empty and build_chain("none").propose([1, 2], 4) == []
    assert build_chain("").empty and build_chain(None).empty
    ch = build_chain(" ngram_simple , ngram-map-k,NGRAM-MOD", {"ngram-mod": {"size": 1024}})
    assert ch.names == ["ngram-simple", "ngram-map-k", "ngram-mod"]
    assert [type(s) for s in ch] == [NgramSimple, NgramMapK, NgramMod]
    assert ch.get("ngram-mod").table.size == 1024
    assert create("ngram-simple", n=5).n == 5
    assert parse_chain_spec(["ngram-mod"]) == ["ngram-mod"]
    assert {"none", "ngram-simple", "ngram-map-k", "ngram-mod"} <= set(known_names())


def test_registry_errors():
    with pytest.raises(UnknownSpeculatorError) as e:
        build_chain("ngram-simple,eagle7")
    msg = str(e.value)
    assert "'eagle7'" in msg
    for name in ("none", "ngram-simple", "ngram-map-k", "ngram-mod"):
        assert name in msg
    with pytest.raises(ValueError, match="none"):
        build_chain("none,ngram-simple")
    with pytest.raises(ValueError, match="more than once"):
        build_chain("ngram-simple,ngram_simple")
    with pytest.raises(ValueError, match="empty entry"):
        build_chain("ngram-simple,,ngram-mod")
    with pytest.raises(ValueError, match="bad options"):
        build_chain("ngram-simple", {"ngram-simple": {"bogus": 1}})
    with pytest.raises(ValueError, match="already registered"):
        registry.register("ngram-simple", lambda: Fixed("x", []))


def test_registry_accepts_a_new_speculator(monkeypatch):
    """How a new speculator plugs in: register a factory, name it in a chain."""
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    seen = {}

    @registry.register("my-drafter")
    def make(**options):
        seen.update(options)
        return Fixed("my-drafter", [9, 9])

    ch = build_chain("ngram-simple,my-drafter", {"my-drafter": {"heads": 1}})
    assert ch.names == ["ngram-simple", "my-drafter"] and seen == {"heads": 1}
    state = object()  # e.g. a head's hidden state: passed through, ignored by n-grams
    assert ch.propose([1, 2, 3], 4, state) == [9, 9] and ch.last_winner.name == "my-drafter"


# --------------------------------------------------------------------------------------------
# cost on a long history
# --------------------------------------------------------------------------------------------


def test_drafters_are_fast_on_a_32k_history():
    rng = np.random.default_rng(3)
    text = rng.integers(0, 30_000, size=16_000).tolist()
    h = text + text[:16_000]  # 32K tokens, the second half repeats the first
    drafters = [NgramSimple(), NgramMapK(), NgramMod()]
    t0 = time.perf_counter()
    for d in drafters:
        d.begin(h[:-200])
    pos = len(h) - 200
    drafted = [0, 0, 0]
    while pos < len(h):
        for k, d in enumerate(drafters):
            draft = d.propose(h[:pos], 16)
            ok = 0
            while ok < len(draft) and pos + ok < len(h) and draft[ok] == h[pos + ok]:
                ok += 1
            drafted[k] += ok
            if draft:
                d.accepted(len(draft), ok)
        pos += 4
    elapsed = time.perf_counter() - t0
    assert all(x > 0 for x in drafted), drafted  # every drafter predicts the repeat
    assert elapsed < 5.0, elapsed  # against quadratic lookups: 0.08 s on the 2-core dev machine, 60x room for a loaded CI one
