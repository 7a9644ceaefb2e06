"""experiments/profile_round: the split of a trace's device idle time by the host's labels, and
the labels a profiled decode carries."""

from __future__ import annotations

import pytest
import torch

from experiments.profile_round import OTHER, ROUND, HostClock, labelled, split_idle
from kvstream.engine.draft_control import DraftControl
from kvstream.engine.speculative import speculative_generate
from kvstream.model.sampling import Sampler
from kvstream.speculators.chain import Chain
from kvstream.speculators.draft import DraftModel
from policies.eject import Never
from test_draft import CHUNK, GREEDY, PROMPT, arena_mib, files, model, new_draft, target_cache  # noqa: F401
from kvstream.model.tokenizer import Tokenizer
from kvstream.speculators.draft import load_host


def span(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 0, "tid": tid}


def test_idle_time_goes_to_the_innermost_host_label():
    """Rounds every 100 us, each labelled for 80 us (the first skipped, the last only ends the
    window): per period the device runs 60 us and idles 40 while the host is in "read" (10 us),
    a torch op inside "record" (6 + 4 us) and nothing labelled (20 us, the engine loop)."""
    ev = []
    for r in (0, 100, 200, 300):
        ev += [span(ROUND, r, 80), span(ROUND, r, 60, cat="gpu_user_annotation", tid=7), span("kernel", r, 60, cat="kernel", tid=7), span("read", r + 60, 10),
               span("record", r + 70, 10), span("aten::copy_", r + 72, 4, cat="cpu_op"),
               span("other thread", r + 60, 40, tid=2)]
    table, s = split_idle(ev, skip=1)
    idle = dict(zip(table.label, table.idle_ms * 1e3))
    assert s["rounds"] == 2 and s["round_ms"] == pytest.approx(0.1) and s["busy_ms"] == pytest.approx(0.06)
    assert idle == pytest.approx({"read": 10, "record": 6, "aten::copy_": 4, OTHER: 20, ROUND: 0})
    host = dict(zip(table.label, table.host_ms * 1e3))
    assert host == pytest.approx({ROUND: 60, "read": 10, "record": 6, "aten::copy_": 4, OTHER: 20})


def test_too_few_rounds_is_one_clear_error():
    with pytest.raises(ValueError, match="2 device rounds in the trace: two are needed past the 5 skipped"):
        split_idle([span(ROUND, 0, 10), span(ROUND, 10, 10)])


def test_a_profiled_device_round_carries_the_labels(model, files):
    """A CPU decode with device rounds under the profiler: the wrapped functions show up as
    labels, and leaving ``labelled`` puts the originals back."""
    before = (DraftModel.read_device_round, Chain.propose_device)
    host = load_host(files[0], Tokenizer.from_gguf(files[0]).token_texts, torch.float32, "cpu")
    cache = target_cache(model, arena_mib(model, host, 2))
    draft = new_draft(host, p_min=0.0, sampling=GREEDY)
    with labelled(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        speculative_generate(model, cache, PROMPT, 24, Sampler(GREEDY), Chain([draft]), n_max=4, prefill_chunk=CHUNK,
                             control=DraftControl(draft, cache, Never()), device_rounds=True)
    names = {e.name for e in prof.events()}
    assert {ROUND, "propose_device", "accept_on_device", "readback.read", "read_device_round", "step record",
            "control.after_step", "length policy", "cache.begin"} <= names
    assert (DraftModel.read_device_round, Chain.propose_device) == before


def test_the_host_clock_counts_from_the_first_device_round(model, files):
    """Unprofiled host times: every wrapped label of a device round, counted from the first
    round (the prefill's cache.begin calls are not), inclusive (a round contains its parts)."""
    host = load_host(files[0], Tokenizer.from_gguf(files[0]).token_texts, torch.float32, "cpu")
    cache = target_cache(model, arena_mib(model, host, 2))
    draft = new_draft(host, p_min=0.0, sampling=GREEDY)
    clock = HostClock()
    with labelled(clock.wrap):
        g = speculative_generate(model, cache, PROMPT, 24, Sampler(GREEDY), Chain([draft]), n_max=4, prefill_chunk=CHUNK,
                                 control=DraftControl(draft, cache, Never()), device_rounds=True)
    assert clock.armed and {ROUND, "propose_device", "accept_on_device", "cache.begin", "step record"} <= set(clock)
    # a round's draft is launched ahead of the last round's bookkeeping (the first one's from its run)
    assert 0 < clock["accept_on_device"] < clock[ROUND] and clock["propose_device"] < clock["round.launch"]
    assert len(g.tokens) == 24


def test_the_critical_path_is_read_to_chain_and_chain_to_verify():
    """Two rounds of calls in order: the intervals from a readback's end to the next chain's start
    (2 and 4 ms) and from a chain's end to the verify's start (1 and 3 ms); medians 3 and 2."""
    clock = HostClock()
    clock.calls = [("readback.read", 0.000, 0.010), ("cache.begin", 0.011, 0.012), ("chain graph", 0.012, 0.013),
                   ("graphed step", 0.014, 0.016), ("readback.read", 0.016, 0.020), ("chain graph", 0.024, 0.025),
                   ("graphed step", 0.028, 0.029)]
    assert clock.critical_path() == pytest.approx({"read -> chain": 3.0, "chain -> verify": 2.0})


def test_round_options_name_their_files_and_refuse_bad_acceptance():
    """``--alpha real`` is the target's own verification (None), a probability otherwise; the file
    name says every option off its default, so runs of different settings never share a CSV."""
    import argparse

    from experiments.bench_round import round_arguments, tag

    ap = round_arguments(argparse.ArgumentParser())
    base = ["--target", "t.gguf", "--mtp", "random"]
    assert tag(ap.parse_args(base)) == "4096_k4_mtp"
    real = ap.parse_args(base + ["--alpha", "real", "--prompt", "review", "--k", "2"])
    assert real.alpha is None and tag(real) == "4096_k2_mtp_areal_review"
    assert tag(ap.parse_args(base + ["--alpha", "0.5", "--cache", "stream"])) == "4096_k4_mtp_a0.5_stream"
    assert tag(ap.parse_args(base + ["--gemv"])) == "4096_k4_mtp_gemv"
    with pytest.raises(SystemExit):  # argparse's one-line error: not a probability
        ap.parse_args(base + ["--alpha", "1.5"])


def test_round_report_takes_each_arms_medians_over_reps(tmp_path):
    """``bench_round --reps``: one row per rep and arm; the report gives each arm's medians and the
    range of its excess over the parts (a committed run, its excess shifted per rep)."""
    from pathlib import Path

    import pandas as pd

    from experiments.bench_round import report

    d = pd.read_csv(Path(__file__).parents[1] / "results/round/round_4096_k4_mtp_1.5b_gemv_be77453_1.csv")
    reps = pd.concat([d.assign(rep=i, excess_ms=d.excess_ms + 0.01 * i) for i in range(3)])
    reps.to_csv(tmp_path / "r.csv", index=False)
    table = report([str(tmp_path / "r.csv")])
    device = d[d.arm == "device"].iloc[0]
    assert f"device, median of 3 reps (excess {device.excess_ms:+.3f} to {device.excess_ms + 0.02:+.3f})" in table
    assert f"{device.excess_ms + 0.01:+.3f} ms" in table and "k = 4 |" in table


def test_round_report_shows_a_draft_models_two_row_catch_up_outside_its_parts(tmp_path):
    """A draft model's row may carry its two-row catch-up (``feed_ms``): the report shows it beside the
    parts, whose sum (#28's verify + k x step) it does not enter; CSVs without it show no note."""
    from pathlib import Path

    import pandas as pd

    from experiments.bench_round import report

    path = Path(__file__).parents[1] / "results/round/round_4096_k4_gemv_489ae50_1.csv"
    d = pd.read_csv(path)
    d.assign(feed_ms=0.8).to_csv(tmp_path / "r.csv", index=False)
    table, before = report([str(tmp_path / "r.csv")]), report([str(path)])
    device = d[d.arm == "device"].parts_ms.median()
    assert f"= {device:.3f} ms (its 2-row catch-up: 0.800 ms) |" in table and "catch-up" not in before
