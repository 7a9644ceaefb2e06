"""What a new streaming plan costs a graphed decode step: a capture's parts, or an update of the
captured copies, timed; synchronised per step and run ahead as a decode runs.

    python -m experiments.bench_capture --model .models/qwen2.5-coder-1.5b.skeleton.gguf \
        --context 16384 --resident 26 --ring-pages 64 --width 5 --pages 4 [--residency-step 1 4]

A streaming plan's copies change when a page opens (every 256 tokens; in one round, every
``--residency-step`` pages). ``GraphedModel`` re-points the captured step's copies when the
plan keeps the step's shape, and captures anew when it does not. This prefills ``--context``
random tokens into a stream cache in an arena that holds ``--resident`` pages per layer, then
decodes steps of ``--width`` tokens across ``--pages`` page openings twice: ``synced`` (the
device synchronised after each step, so a step's host and device parts add up) timing what a
plan change runs (the functions are wrapped, so the times are the real calls'): ``cache.begin``
(with the residency plan and the eager first-round copy), a capture's warm-up body, entry,
captured body and instantiation, the copy-node update, and the rest; and ``ahead`` (the host
queues each step before waiting for the one before, as ``generate`` does), where a row's time
runs from one step's launch and wait to the next's: what a step costs a decode that runs ahead. Writes ``<out>/capture_<model>_<context>_w<width>.csv``
(one row per step and mode, with the model, the command, the commit, the GPU and the versions)
and prints the steady step, each plan-change step and its excess by part; ``--profile`` adds a
cProfile of the plan-change steps.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.common import provenance
from kvstream.cache.arena import MIB, ArenaPlan, pair_bytes
from kvstream.cache.factory import make_cache, phase_slabs
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.engine.graph_copies import CopyNodes
from kvstream.engine.graphs import GraphedModel
from kvstream.model.qwen import load_model

SYNC = torch.cuda.synchronize  # this script's own waits, not counted as a capture's

PARTS = ("begin", "plan", "warm_body", "sync", "empty_cache", "host_empty_cache", "capture_body",
         "capture_end", "instantiate", "update", "commit")


class Clock:
    """Wall seconds per named part within the current step (wrapped callables add to it)."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.bodies = 0

    def wrap(self, fn, key):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0
        return timed


def instrument_torch(clock: Clock) -> None:
    """Wrap torch's parts of a capture (this process only: a benchmark)."""
    torch.cuda.synchronize = clock.wrap(torch.cuda.synchronize, "sync")
    torch.cuda.empty_cache = clock.wrap(torch.cuda.empty_cache, "empty_cache")
    torch._C._host_emptyCache = clock.wrap(torch._C._host_emptyCache, "host_empty_cache")
    torch.cuda.CUDAGraph.capture_end = clock.wrap(torch.cuda.CUDAGraph.capture_end, "capture_end")
    torch.cuda.CUDAGraph.instantiate = clock.wrap(torch.cuda.CUDAGraph.instantiate, "instantiate")
    CopyNodes.update = clock.wrap(CopyNodes.update, "update")


def instrument(clock: Clock, graphed: GraphedModel, cache) -> None:
    """Wrap the cache's and the graphed model's parts of a step."""
    cache.begin = clock.wrap(cache.begin, "begin")
    cache._plan = clock.wrap(cache._plan, "plan")
    cache.commit = clock.wrap(cache.commit, "commit")
    body = graphed.model.body

    def counted_body(*args, **kwargs):  # a capture runs it eagerly (the warm-up), then capturing
        warm = not torch.cuda.is_current_stream_capturing()
        return clock.wrap(body, "warm_body" if warm else "capture_body")(*args, **kwargs)

    graphed.model = copy.copy(graphed.model)  # this run's wrapper only
    graphed.model.body = counted_body


@torch.inference_mode()
def measure(model, clock: Clock, context: int, width: int, pages: int, resident: int, ring_pages: int,
            residency_step: int = 1, profiler: cProfile.Profile | None = None) -> pd.DataFrame:
    """One decode across ``pages`` page openings; a row per step."""
    new = pages * 256 + 2 * width
    cc = CacheConfig(mode="stream", ring_pages=str(ring_pages), residency_step=residency_step)
    slabs = phase_slabs(cc, model, context + new, 512, width)
    # an arena whose decode layout holds ``resident`` pages per layer (the rest streams), and
    # whose prefill layout holds the prefill slab and a few pages per layer
    c, pair = model.cfg, pair_bytes(cc.type_k, cc.type_v, model.cfg.n_kv_heads, model.cfg.head_dim)
    nbytes = max(ArenaPlan(slabs["decode"], ring_pages, pair).bytes(c.n_layers * resident),
                 ArenaPlan(slabs["prefill"], ring_pages, pair).bytes(c.n_layers * 4))
    cache = make_cache(cc, ArenaConfig(str(nbytes / MIB)), model, context + new, 512, verify_width=width, slabs=slabs)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=g)
    for a in range(0, context, 512):
        model(prompt[a:a + 512].cuda(), cache)
    cache.set_phase("decode")
    print(f"arena {nbytes / MIB:.0f} MiB: {cache.capacity} resident pages per layer, ring {cache.ring_pages}")
    graphed = GraphedModel(model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    step = lambda: graphed(torch.randint(0, model.cfg.vocab_size, (width,), device="cuda", generator=gen), cache,
                           width > 1)
    for _ in range(3):  # compile and capture this width at this plan
        step()
    SYNC()
    instrument(clock, graphed, cache)
    rows, start = [], cache.length
    for mode in ("synced", "ahead"):
        cache.truncate(start)  # the same steps again: the plans come back, their graphs are kept
        done, last = None, time.perf_counter()
        for i in range(new // width - 3):
            clock.t.clear()
            before, updates = graphed.captures, graphed.updates
            t0 = time.perf_counter()
            opens = cache.length // 256 != (cache.length + width) // 256
            if profiler is not None and opens and mode == "synced":
                profiler.enable()
                step()
                profiler.disable()
            else:
                step()
            st = cache.stats
            if mode == "synced":
                SYNC()
                wall = time.perf_counter() - t0
            else:  # queued: from the last row's wait to this one's (step i launched, step i - 1 seen done):
                # the device's step time while the host keeps ahead; more where step i's host part
                # (a plan change) outlasts step i - 1 on the device
                end = torch.cuda.Event()
                end.record()
                if done is not None:
                    done.synchronize()
                now = time.perf_counter()
                wall, last, done = now - last, now, end
            rows.append({"mode": mode, "step": i, "length": cache.length, "streamed_pages": st.streamed_pages,
                         "rounds": st.rounds, "captured": graphed.captures - before,
                         "updated": graphed.updates - updates, "plan_change": st.plan_change, "plan_s": st.plan_s,
                         "wall_s": wall, **{p: clock.t.get(p, 0.0) for p in PARTS}})
        SYNC()
    print(f"{graphed.captures} captures, {graphed.updates} updates in all")
    return pd.DataFrame(rows)


def report(df: pd.DataFrame, label: str) -> None:
    for mode, d in df.groupby("mode", sort=False):
        changed = d.plan_change.isin(["capture", "update"]) & (d.step > 0)
        steady, change = d[~changed & (d.plan_change == "")], d[changed]
        base = steady.wall_s.median()
        print(f"{label}, {mode}: steady step {1e3 * base:.2f} ms (median of {len(steady)}), {len(change)} plan "
              f"changes ({int(change.captured.sum())} captured), their step {1e3 * change.wall_s.median():.2f} ms "
              f"= {change.wall_s.median() / base:.2f}x steady")
        for _, r in change.iterrows():
            parts = {p: r.get(p, 0.0) for p in PARTS}
            print(f"  at {int(r.length)} ({int(r.streamed_pages)} streamed, {int(r.rounds)} rounds, {r.plan_change}): "
                  f"step {1e3 * r.wall_s:.2f} ms = {r.wall_s / base:.2f}x, "
                  + ", ".join(f"{p} {1e3 * v:.2f}" for p, v in parts.items() if v > 1e-4))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF (a skeleton gives random weights: times only)")
    ap.add_argument("--report", nargs="+", metavar="CSV", help="print the report of written CSVs instead (no GPU)")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--width", type=int, default=5, help="tokens per step (1 + draft tokens)")
    ap.add_argument("--pages", type=int, default=4, help="page openings to decode across")
    ap.add_argument("--resident", type=int, default=26,
                    help="resident pages per layer the arena holds (26: the 1.5B's beside the 0.5B draft in 1390 MiB, its compute slabs then outside)")
    ap.add_argument("--ring-pages", type=int, default=64)
    ap.add_argument("--residency-step", type=int, nargs="+", default=[1],
                    help="cache.residency_step; several: one decode each, in this process")
    ap.add_argument("--out", default="results/capture")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the page-opening steps (<csv name>.profile.txt)")
    args = ap.parse_args(argv)
    if args.report:
        for name in args.report:
            df = pd.read_csv(name, keep_default_na=False)
            if "mode" not in df:  # written before the run-ahead decode and the update path: captures only
                df = df.assign(mode="synced", updated=0, plan_change=df.captured.map({1: "capture"}).fillna(""))
            report(df, name)
        return
    if args.model is None:
        ap.error("--model is required (or --report CSV ...)")
    if not torch.cuda.is_available():
        raise SystemExit("bench_capture times CUDA-graph captures: it needs a GPU")
    model = load_model(args.model, torch.bfloat16, "cuda")
    clock = Clock()
    instrument_torch(clock)
    profiler = cProfile.Profile() if args.profile else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for step in args.residency_step:  # one process, one model: the steps compare within the run
        df = measure(model, clock, args.context, args.width, args.pages, args.resident, args.ring_pages, step, profiler)
        tag = f"_step{step}" if step > 1 else ""
        name = out / f"capture_{Path(args.model).name.split('.skeleton')[0]}_{args.context}_w{args.width}{tag}.csv"
        df.assign(model=args.model, command=" ".join(["python -m experiments.bench_capture", *sys.argv[1:]]),
                  **provenance()).to_csv(name, index=False)
        report(df, f"context {args.context}, width {args.width}, residency step {step}")
        for mode, d in df.groupby("mode", sort=False):
            print(f"{mode}: {len(d)} steps in {d.wall_s.sum():.3f} s ({d.wall_s.mean() * 1e3:.2f} ms per step, "
                  f"{int(d.captured.sum())} captures, {int(d.updated.sum())} updates)")
        print(f"wrote {name}")
    name = name.with_name(name.name.replace(tag, ""))  # the profile covers every step's decode
    if profiler is not None:
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(45)
        (out / name.with_suffix(".profile.txt").name).write_text(text.getvalue())
        print(f"wrote {name.with_suffix('.profile.txt')}")


if __name__ == "__main__":
    main()
