"""Where a device round's time goes: a torch.profiler trace of ``bench_round``'s decode (device
rounds), the device's idle time per round, and what the host was doing while the device waited.

    python -m experiments.profile_round --target .models/qwen2.5-coder-1.5b.skeleton.gguf \
        --draft .models/qwen2.5-coder-0.5b.skeleton.gguf --context 4096 --k 4
    python -m experiments.profile_round --target .models/qwen2.5-coder-1.5b.skeleton.gguf --mtp random --k 4
    python -m experiments.profile_round --report results/round/profile/*.csv      # their table (no GPU)

The engine's round functions are wrapped in ``record_function`` labels (``_labels``) for the
profiled run only. In the trace, every microsecond of the main thread gets its innermost label
(a wrapped function, a torch op, a CUDA runtime call; "engine loop" where none), and each device
idle gap (no kernel, copy or memset running) is split by those labels: the host work the device
waited for. The profiler slows the host, so the shares matter more than the absolute times; a
round's unprofiled time is ``bench_round``'s. Writes ``<out>/profile_<bench_round's tag>.csv``:
per label, host ms per round and device-idle ms per round while the host was in it (profiled),
and host ms per round inclusive of what it calls (`host_unprofiled_ms`, timed with perf_counter
in a run without the profiler; "graph launch" is `CUDAGraph.replay`), with the medians of the
two host intervals the device may wait through (``HostClock.critical_path``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import inspect
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments.bench_round import load_round, round_arguments, round_config, write_csv
from experiments.common import provenance
from kvstream.config import EngineConfig
from kvstream.engine.runner import run_decode

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
ROUND = "round.run"
OTHER = "engine loop"


def _labels():
    """(owner, attribute, label) of what the profiled run wraps: a round's phases."""
    from kvstream.cache.paged import PagedCache
    from kvstream.cache.paged_staging import PinnedUpload
    from kvstream.engine import speculative
    from kvstream.engine.draft_control import DraftControl
    from kvstream.engine.graphs import ChainGraphs, GraphedModel
    from kvstream.engine.readback import Readback
    from kvstream.speculators.chain import Chain
    from kvstream.speculators.draft import DraftModel
    from kvstream.speculators.mtp import MTPDraft
    from kvstream.telemetry import StepRecord
    from policies import draft_length

    out = [(speculative._DeviceRound, "run", ROUND), (speculative._DeviceRound, "launch", "round.launch"),
           (speculative, "accept_on_device", "accept_on_device"),
           (Chain, "propose_device", "propose_device"), (Chain, "accepted", "chain.accepted"),
           (ChainGraphs, "run", "chain graph"), (GraphedModel, "__call__", "graphed step"),
           (PagedCache, "begin", "cache.begin"), (PagedCache, "commit", "cache.commit"),
           (PagedCache, "truncate", "cache.truncate"), (PagedCache, "_stage_step", "cache.stage_step"),
           (PinnedUpload, "stage", "upload.stage"), (PinnedUpload, "send", "upload.send"),
           (Readback, "start", "readback.start"), (Readback, "read", "readback.read"),
           (StepRecord, "of", "step record"), (DraftControl, "after_step", "control.after_step"),
           (DraftModel, "read_device_round", "read_device_round"), (MTPDraft, "read_device_round", "read_device_round"),
           (MTPDraft, "observe", "observe"), (MTPDraft, "prepare", "prepare"), (DraftModel, "prepare", "prepare"),
           (PagedCache, "stage_ahead", "cache.stage_ahead"),
           (PagedCache, "stage_ahead_on_device", "cache.stage_ahead")]
    out += [(cls, "decide", "length policy") for _, cls in inspect.getmembers(draft_length, inspect.isclass)
            if "decide" in vars(cls)]
    return out


def _record(fn, label):
    @functools.wraps(fn)
    def inner(*a, **k):
        with torch.profiler.record_function(label):
            return fn(*a, **k)
    return inner


class HostClock(dict):
    """Host seconds per label (inclusive: a label's time contains the labels it calls), taken
    with ``time.perf_counter`` around each call (no profiler, ~1 us a call), counted from the
    first device round on (not the prefill's or the warm-up's calls)."""

    armed = False

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, float, float]] = []  # (label, entered, left) in call order

    def wrap(self, fn, label):
        @functools.wraps(fn)
        def inner(*a, **k):
            if label == ROUND and not self.armed:
                self.clear()
                self.calls.clear()
                self.armed = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t1 = time.perf_counter()
                self[label] = self.get(label, 0.0) + t1 - t0
                self.calls.append((label, t0, t1))
        return inner

    def critical_path(self) -> dict[str, float]:
        """Median host ms, per round, of the two waits the device may sit through: from the
        round's readback back on the host to the next round's chain launched ("read -> chain"),
        and from the chain launched to the verify launched ("chain -> verify": the device idles
        where it is longer than the chain's device time)."""
        gaps = {"read -> chain": [], "chain -> verify": []}
        read_left = chain_left = None
        for label, t0, t1 in sorted(self.calls, key=lambda c: c[1]):
            if label == "readback.read":
                read_left = t1
            elif label == "chain graph" and read_left is not None:
                gaps["read -> chain"].append(t0 - read_left)
                read_left, chain_left = None, t1
            elif label == "graphed step" and chain_left is not None:
                gaps["chain -> verify"].append(t0 - chain_left)
                chain_left = None
        return {k: 1e3 * float(np.median(v)) if v else float("nan") for k, v in gaps.items()}


@contextlib.contextmanager
def labelled(wrap=_record, extra=()):
    """The round's functions wrapped by ``wrap(fn, label)`` while inside (default: a
    ``record_function`` label each); ``extra``: more (owner, attribute, label)."""
    saved = []
    for owner, attr, label in [*_labels(), *extra]:
        raw = inspect.getattr_static(owner, attr)
        fn = raw.__func__ if isinstance(raw, classmethod) else raw
        setattr(owner, attr, classmethod(wrap(fn, label)) if isinstance(raw, classmethod) else wrap(fn, label))
        saved.append((owner, attr, raw))
    try:
        yield
    finally:
        for owner, attr, raw in reversed(saved):
            setattr(owner, attr, raw)


def split_idle(events: list[dict], skip: int = 5) -> tuple[pd.DataFrame, dict]:
    """Per label: host ms a round, and device-idle ms a round while the main thread was in it.

    ``events``: a chrome trace's ``traceEvents``. The window runs from the start of the
    ``skip``-th ``round.run`` label to the start of the last (whole periods, rounds past the
    first); the main thread is that label's. Every microsecond of it gets its innermost label: wrapped functions
    (user annotations), torch ops and CUDA runtime calls, ``engine loop`` where none."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    # (the profiler also draws each label on the device's timeline, as a gpu_user_annotation)
    rounds = sorted((e for e in spans if e.get("name") == ROUND and e.get("cat") == "user_annotation"),
                    key=lambda e: e["ts"])
    if len(rounds) < skip + 2:
        raise ValueError(f"{len(rounds)} device rounds in the trace: two are needed past the {skip} skipped")
    rounds = rounds[skip:]
    lo, hi = rounds[0]["ts"], rounds[-1]["ts"]
    main = (rounds[0]["pid"], rounds[0]["tid"])
    n = int(np.ceil(hi - lo))  # one slot per microsecond
    names, host = [OTHER], np.zeros(n, dtype=np.int32)
    marks = [e for e in spans if (e["pid"], e["tid"]) == main and e.get("cat") in ("user_annotation", "cpu_op", "cuda_runtime",
                                                                                   "cuda_driver")]
    for e in sorted(marks, key=lambda e: -e["dur"]):  # outer first: inner labels overwrite
        a, b = int(max(e["ts"], lo) - lo), int(min(e["ts"] + e["dur"], hi) - lo)
        if b > a:
            if e["name"] not in names:
                names.append(e["name"])
            host[a:b] = names.index(e["name"])
    busy = np.zeros(n, dtype=bool)
    for e in spans:
        if e.get("cat") in GPU_CATEGORIES:
            a, b = int(max(e["ts"], lo) - lo), int(np.ceil(min(e["ts"] + e["dur"], hi) - lo))
            if b > a:
                busy[a:b] = True
    n_rounds = len(rounds) - 1
    host_us, idle_us = Counter(host.tolist()), Counter(host[~busy].tolist())
    table = pd.DataFrame([{"label": names[i], "host_ms": host_us[i] / 1e3 / n_rounds, "idle_ms": idle_us[i] / 1e3 / n_rounds}
                          for i in host_us]).sort_values("idle_ms", ascending=False, ignore_index=True)
    summary = {"rounds": n_rounds, "round_ms": n / 1e3 / n_rounds, "busy_ms": busy.sum() / 1e3 / n_rounds,
               "idle_ms": (~busy).sum() / 1e3 / n_rounds}
    return table, summary


WHERE = ("propose_device", "graphed step", "cache.begin", "cache.stage_step", "cache.commit", "upload.send",
         "accept_on_device", "control.after_step", "step record", "graph launch")


def report(paths: list[str]) -> str:
    """A markdown table of profile_round CSVs: the round, its critical path, unprofiled host ms of
    the round's main parts (inclusive, per round)."""
    lines = ["| file (code) | round | read -> chain | chain -> verify | " + " | ".join(WHERE) + " |",
             "|---" * (4 + len(WHERE)) + "|"]
    for p in paths:
        d = pd.read_csv(p).set_index("label")
        host = d.host_unprofiled_ms
        cells = [f"{host.get(k, float('nan')):.3f}" for k in WHERE]
        path = [f"{host.get(f'critical path: {k}', float('nan')):.3f}" for k in ("read -> chain", "chain -> verify")]
        lines.append(f"| `{Path(p).name}` | {d.round_ms.iloc[0]:.3f} | " + " | ".join(path + cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = round_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--top", type=int, default=20, help="labels printed")
    ap.add_argument("--trace", help="also write the trace's events here (gzipped JSON) for another look")
    ap.add_argument("--report", nargs="+", metavar="CSV", help="print the table of written CSVs (no GPU)")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    model, tok, prompt = load_round(ap, args, "profile_round traces")
    cfg = replace(round_config(args, model), engine=EngineConfig(device_rounds=True))
    plain = run_decode(cfg, model, tok, prompt)  # unprofiled: the round's own time, and every graph warm
    plain_ms = 1e3 * float(np.median([r.step_s for r in plain.generation.records if r.verify_width == 1 + args.k][5:]))
    del plain
    clock = HostClock()  # unprofiled host times, graph launches included
    with labelled(clock.wrap, extra=[(torch.cuda.CUDAGraph, "replay", "graph launch")]):
        timed = run_decode(cfg, model, tok, prompt)
    n_timed = sum(r.verify_width > 1 for r in timed.generation.records)
    del timed
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with labelled(), torch.profiler.profile(activities=acts) as prof:
        run_decode(cfg, model, tok, prompt)
    trace = Path(tempfile.mkdtemp(prefix="profile_round_")) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            json.dump(events, f)
    table, s = split_idle(events)
    command = " ".join(["python -m experiments.profile_round", *sys.argv[1:]])
    table["host_unprofiled_ms"] = [1e3 * clock.get(label, float("nan")) / n_timed for label in table.label]
    table = pd.concat([table, pd.DataFrame([{"label": k, "host_unprofiled_ms": 1e3 * v / n_timed}
                                            for k, v in clock.items() if k not in set(table.label)]),
                       pd.DataFrame([{"label": f"critical path: {k}", "host_unprofiled_ms": v}
                                     for k, v in clock.critical_path().items()])], ignore_index=True)
    df = table.assign(rounds=s["rounds"], profiled_round_ms=s["round_ms"], busy_ms=s["busy_ms"],
                      round_ms=plain_ms, context=args.context, k=args.k, command=command, **provenance())
    name = write_csv(df, args, "profile")
    print(f"round {plain_ms:.3f} ms unprofiled; profiled {s['round_ms']:.3f} ms: device busy {s['busy_ms']:.3f}, "
          f"idle {s['idle_ms']:.3f} ms ({s['rounds']} rounds)")
    print(table.head(args.top).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print("unprofiled host ms per round (inclusive), then the critical path's medians:")
    print(table.dropna(subset=["host_unprofiled_ms"]).sort_values("host_unprofiled_ms", ascending=False)
          [["label", "host_unprofiled_ms"]].to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"wrote {name}")


if __name__ == "__main__":
    main()
