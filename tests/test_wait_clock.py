"""Transfer-wait telemetry (kvstream.cache.wait_clock): what a pass waited for, split out of its step."""

from __future__ import annotations

import time

import pytest
import torch

from kernels.stamp import stamp
from kvstream.engine.generate import generate
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.telemetry import StepRecord, StepStats
from kvstream.cache.wait_clock import WaitClock
from test_paged_cache import CHUNK, PROMPT, model, paged, small_arena_mib, tokens  # noqa: F401 (fixtures)


def test_cpu_clock_counts_what_a_pass_times():
    clock, a, b = WaitClock(torch.device("cpu")), StepStats(), StepStats()
    clock.open_pass()
    with clock.timing():
        time.sleep(0.02)
    clock.close_pass(a)
    clock.open_pass()
    clock.close_pass(b)
    # sleep returns no earlier than asked; 0.2 s bounds a loaded CI machine's oversleep
    assert 0.02 <= a.wait_s < 0.2
    assert b.wait_s == 0.0


def test_a_wait_inside_a_pass_that_raises_is_still_closed():
    clock, s = WaitClock(torch.device("cpu")), StepStats()
    clock.open_pass()
    with pytest.raises(RuntimeError), clock.timing():
        time.sleep(0.01)
        raise RuntimeError("a copy failed")
    clock.close_pass(s)
    assert 0.01 <= s.wait_s < 0.2


def test_the_step_time_splits_into_draft_wait_and_target():
    timed = StepRecord(0, 300, 2, 2, 0, 1, 0, 0, 1, step_s=1.0, draft_s=0.25, stats=StepStats(wait_ns=500_000_000))
    untimed = StepRecord(0, 300, 2, 2, 0, 1, 0, 0, 1, step_s=1.0, draft_s=0.25, stats=StepStats(wait_ns=None))
    assert (timed.wait_s, timed.target_s) == (0.5, 0.25)
    assert (untimed.wait_s, untimed.target_s) == (None, 0.75)  # the wait is in the target's part
    assert timed.row()["wait_s"] == 0.5 and "stats" not in timed.row()


def test_a_cpu_clock_always_times_and_one_switched_off_reports_no_wait():
    clock, s = WaitClock(torch.device("cpu"), enabled=False), StepStats()
    assert clock.enabled  # reading the host's clock costs nothing: cache.time_waits is for CUDA
    clock.enabled = False  # as bench_stream switches it between captures
    clock.open_pass()
    with clock.timing():
        time.sleep(0.001)
    clock.close_pass(s)
    assert s.wait_s is None


def test_stamp_refuses_a_counter_it_cannot_use():
    with pytest.raises(ValueError, match="CUDA int64 counter"):
        stamp(torch.zeros(1, dtype=torch.int64), -1)


@pytest.mark.parametrize("timed", [True, False])
def test_records_split_each_step_into_target_draft_and_wait(model, tokens, timed):
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    cache.clock.enabled = timed
    g = generate(model, cache, tokens[:PROMPT], 6, Sampler(SamplingParams()), prefill_chunk=CHUNK)
    assert g.records and all(r.streamed_pages == 4 for r in g.records)
    for r in g.records:
        row = r.row()
        assert row["wait_s"] == r.wait_s and row["target_s"] == r.target_s
        if timed:  # 4 pages of each layer copied host -> ring, synchronously on the CPU: time spent
            assert 0 < r.wait_s < r.step_s
        else:
            assert r.wait_s is None


def test_switching_the_timing_asks_for_new_graphs(model):
    """A captured step keeps the stamps it was captured with: the plan key says whether it has them."""
    cache = paged(model, "stream", mib=small_arena_mib(model, 4, 8), ring=8)
    key = cache.plan_key()
    cache.clock.enabled = not cache.clock.enabled
    assert cache.plan_key() != key
