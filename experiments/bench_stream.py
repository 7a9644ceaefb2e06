"""Streaming decode on the GPU: tok/s vs context for several arena sizes, resident vs stream.

    python experiments/bench_stream.py --out results/stream [--contexts 4096 16384 32768]

Random weights with the real Qwen2.5-Coder-1.5B shapes (timing does not depend on the values),
bf16, q8_0 K / q4_0 V pages (``--types``: other pairs), CUDA-graph decode steps (``--eager``: without), the ring
automatic (one round per layer) unless ``--ring N``. For each context: resident
mode (the whole context in the arena), then stream mode with arenas holding a fraction of the
pages. Reported per run: decode tok/s (steps back to back, the host preparing one while the
device runs the one before, as a decode loop does; ``step_synced_ms``: each step alone, its host
work included), pages streamed per layer, host->device bytes per step
and their rate against the pinned-copy ceiling measured in the same run, the host store's
size, the chunked prefill's rate and peak reserved device memory, the step time against
max(compute-only = resident step, transfer-only = the step's copies alone), and device memory in
use during decode (as the driver counts it, less the CUDA context) against weights + arena. The
transfer-only time replays the step's copies from a CUDA graph, as the graphed step issues them
(``transfer_eager_ms``: issued from Python one by one, host-bound for small sets). The
telemetry's transfer wait per step (``wait_ms``, median over the back-to-back steps; its share of
the step) and what timing it costs: ``timing_cost`` = tok/s with graphs captured without the
stamp kernels (``tok_s_untimed``) / with - 1; ``stamp_pair_us``: the wait reported for a wait of
nothing (two stamps back to back).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.common import QWEN15, git_state, pinned_ceiling
from kvstream.cache.arena import MIB, ArenaPlan, pair_bytes
from kvstream.cache.factory import make_cache, phase_slabs
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.engine.graphs import GraphedModel
from kvstream.cache.cudart import copy_rows
from kvstream.model.loader import ModelConfig, random_weights
from kvstream.model.qwen import Qwen

def random_model(cfg: ModelConfig, device, dtype) -> Qwen:
    return Qwen(cfg, random_weights(cfg, dtype, device))


def _issue_copies(cache, stream) -> None:
    """The host -> ring copies of one decode step: the runtime's own (same rows, same order)."""
    for layer in range(0, cache.n_layers, cache.group):
        for r in range(len(cache.rounds)):
            for dst, src, _ in cache.ring_copies(layer, r):
                copy_rows(dst, src, stream)


@torch.inference_mode()  # the ring is an inference tensor
def transfer_only_ms(cache, graphed: bool = True, reps: int = 5) -> float:
    """The host -> ring copies one decode step issues, alone on a stream, timed with events: the
    transfer-only time of a step. ``graphed``: replayed from a CUDA graph, as the graphed decode
    step issues them (copy nodes, no host in between); else issued one by one from Python, where
    a small copy waits ~8 us for the host (56 copies of a few hundred KB: the host's rate, not
    the copy engine's)."""
    if not any(r[2] for r in cache.rounds):
        return 0.0
    stream = torch.cuda.Stream()
    graph = None
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _issue_copies(cache, stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start.record(stream)
            graph.replay() if graph is not None else _issue_copies(cache, stream)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    cache.forget_ring()  # its first ring half now holds the last layer's pages
    return statistics.median(times[1:])


def stamp_pair_us(device, pairs: int = 64) -> float:
    """What the wait telemetry reports for a wait of nothing: two stamps back to back in a graph
    (the gap between two launches, and the timer's resolution), per pair, in us."""
    from kernels.stamp import stamp

    acc = torch.zeros(1, dtype=torch.int64, device=device)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        stamp(acc, -1)  # compiled outside the capture
        stamp(acc, 1)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(pairs):
                stamp(acc, -1)
                stamp(acc, 1)
    acc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return int(acc) / pairs / 1e3


def device_used_mib() -> float:
    """Device memory in use, as the driver counts it (torch's pools, ours and the context)."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / MIB


def back_to_back(step, cache, tok: torch.Tensor, steps: int) -> tuple[float, torch.Tensor, list]:
    """``steps`` decode steps queued back to back (one sync at the end): seconds per step, the
    last token, and each step's ``StepStats``."""
    stats = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        tok = step(tok, cache)[-1].argmax().reshape(1)
        stats.append(cache.stats)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps, tok, stats


def decode_run(model, cache, context: int, steps: int, graphs: bool = True) -> dict:
    torch.manual_seed(0)
    with torch.inference_mode():
        prompt = torch.randint(0, model.cfg.vocab_size, (context,), device=model.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for lo in range(0, context, 1024):  # chunked prefill, its K/V written through to the host store
            model(prompt[lo:lo + 1024], cache)
        torch.cuda.synchronize()
        prefill_s, prefill_peak_mib = time.perf_counter() - t, torch.cuda.max_memory_reserved() / MIB
        cache.set_phase("decode")
        step = GraphedModel(model) if graphs else model
        tok = torch.tensor([1], device=model.device)
        times = []
        for i in range(steps + 3):  # each step alone: the host's work for it is in its time
            torch.cuda.synchronize()
            t = time.perf_counter()
            tok = step(tok, cache)[-1].argmax().reshape(1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        # back to back, one sync: the host prepares a step while the device runs the one before,
        # as in a decode loop (the next token stays on the device); the decode rate, and each
        # step's transfer wait as the telemetry reports it (kvstream.cache.wait_clock)
        step_s, tok, stats = back_to_back(step, cache, tok, steps)
        waits = [s.wait_s for s in stats]
        # the same without timing the waits (new graphs, captured without the stamp kernels)
        timed, cache.clock.enabled = cache.clock.enabled, False
        untimed = GraphedModel(model) if graphs else model
        for _ in range(3):  # captured here, not in the timed steps
            tok = untimed(tok, cache)[-1].argmax().reshape(1)
        untimed_s, tok, _ = back_to_back(untimed, cache, tok, steps)
        cache.clock.enabled = timed
    st = cache.stats
    wait = dict(wait_ms=statistics.median(waits) * 1e3, wait_max_ms=max(waits) * 1e3) if None not in waits else {}
    return dict(step_ms=step_s * 1e3, tok_s=1 / step_s, tok_s_untimed=1 / untimed_s, **wait,
                prefill_s=prefill_s, prefill_tok_s=context / prefill_s, prefill_peak_reserved_mib=prefill_peak_mib,
                step_synced_ms=statistics.median(times[3:]) * 1e3,
                streamed_pages=st.streamed_pages, resident_pages=st.resident_pages,
                rounds=st.rounds, group=cache.group, h2d_bytes=st.h2d_bytes, transfer_only_ms=transfer_only_ms(cache, graphs),
                transfer_eager_ms=transfer_only_ms(cache, False), device_used_mib=device_used_mib(),
                torch_reserved_mib=torch.cuda.memory_reserved() / MIB)


MODEL = "Qwen2.5-Coder-1.5B shapes, random weights, bf16"


def plot(df: pd.DataFrame, png: Path) -> None:
    """Decode tok/s per context and arena (left); streamed pages' copy rate against the pinned
    ceiling per streamed pages per layer (right); the GPU, commit and command in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    types = df["types"] + " " if "types" in df and df["types"].nunique() > 1 else ""
    arm = types + df["mode"] + df["fraction"].map(lambda f: "" if pd.isna(f) else f" {f:g} of the pages")
    for name, g in df.assign(arm=arm).groupby("arm", sort=False):
        ax.plot(g["context"], g["tok_s"], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    s = df[df["streamed_pages"] > 0]
    bx.plot(s["streamed_pages"], 100 * s["frac_of_pinned_ceiling"], "o")
    for _, r in s.iterrows():
        bx.annotate(f"{r['context'] // 1024}K, x{r['overlap_ratio']:.2f}", (r["streamed_pages"], 100 * r["frac_of_pinned_ceiling"]),
                    fontsize=7, xytext=(4, -10), textcoords="offset points")
    bx.axhline(85, color="grey", ls="--", label="goal 85%")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("streamed pages per layer (label: context, step / max(compute, transfer))")
    bx.set_ylabel(f"copy rate, % of the {df['pinned_ceiling_gbps'].iloc[0]:.1f} GB/s pinned ceiling")
    bx.legend(fontsize=8)
    meta = df.iloc[0]
    fig.suptitle(f"streaming decode on {meta['gpu']}: {MODEL}\n{meta['command']} (commit {meta['commit']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ring", default="auto", help="ring slots, or auto (one round per layer)")
    ap.add_argument("--eager", action="store_true", help="decode steps without CUDA graphs")
    ap.add_argument("--types", nargs="+", default=["q8_0/q4_0"], help="K/V page types, K/V each")
    ap.add_argument("--out", default="results/stream")
    ap.add_argument("--plot", type=Path, help="only redraw the figure of this stream_decode.csv (no GPU)")
    args = ap.parse_args()
    if args.plot:
        plot(pd.read_csv(args.plot), args.plot.with_suffix(".png"))
        return
    dev = torch.device("cuda")
    ceiling = pinned_ceiling(dev)
    torch.cuda.empty_cache()
    context_mib = device_used_mib()  # the CUDA context and loaded kernels: not the run's
    model = random_model(QWEN15, dev, torch.bfloat16)
    weights_mib = torch.cuda.memory_allocated() / MIB
    rows = []
    for types, ctx in [(t, c) for t in args.types for c in args.contexts]:
        type_k, type_v = types.split("/")
        max_tokens = ctx + 3 * args.steps + 16
        arms = [("resident", None)] + [("stream", f) for f in args.fractions]
        base_step = None
        for mode, frac in arms:
            cc = CacheConfig(mode=mode, type_k=type_k, type_v=type_v, ring_pages=args.ring if mode == "stream" else "0",
                             time_waits=True)
            slabs = phase_slabs(cc, model, max_tokens, 1024)
            if frac is None:
                mib = "auto"
            else:  # prefill slab + ring + frac of every layer's pages (decode frees the slab's excess)
                per_layer = -(-max_tokens // 256)
                ring = 2 * (per_layer - int(frac * per_layer)) if args.ring == "auto" else int(args.ring)
                plan = ArenaPlan(slabs["prefill"], ring, pair_bytes(type_k, type_v, QWEN15.n_kv_heads, QWEN15.head_dim))
                mib = str(plan.mib(QWEN15.n_layers * int(frac * per_layer)))
            gc.collect()  # the previous arm's cache and the reserve passes' scratch caches
            torch.cuda.empty_cache()
            before_mib = torch.cuda.memory_reserved() / MIB  # weights (and their allocator slack)
            cache = make_cache(cc, ArenaConfig(mib=mib), model, max_tokens, 1024, slabs=slabs)
            r = decode_run(model, cache, ctx, args.steps, graphs=not args.eager)
            arena_mib = cache.arena.nbytes / MIB
            if mode == "resident":
                base_step = r["step_ms"]
            transfer_ms = r["transfer_only_ms"]
            copy_gbps = r["h2d_bytes"] / transfer_ms / 1e6 if transfer_ms else float("nan")
            r.update(context=ctx, types=types, host_store_mib=cache.host.nbytes / MIB, mode=mode, fraction=frac, arena_mib=arena_mib, capacity=cache.capacity,
                     weights_mib=weights_mib, copy_gbps=copy_gbps, frac_of_pinned_ceiling=copy_gbps / ceiling,
                     overlap_ratio=r["step_ms"] / max(base_step, transfer_ms), pinned_ceiling_gbps=ceiling,
                     bound_mib=weights_mib + arena_mib, mem_device_mib=r["device_used_mib"] - context_mib,
                     slab_mib=cache.layout.slab / MIB, slab_used_mib=cache.slab_pool.segments.bytes / MIB,
                     torch_before_mib=before_mib)
            # what the run holds beyond its arena (torch's segments, less the slab pool's, which
            # lie inside the arena): the logits handed to the caller, a new stream's cuBLAS
            # workspace; and the whole device (driver count, kernel code included) beyond bound
            run_mib = r["torch_reserved_mib"] - cache.slab_pool.segments.bytes / MIB - before_mib
            r.update(run_beyond_arena_mib=run_mib - arena_mib, device_beyond_mib=r["mem_device_mib"] - r["bound_mib"])
            r.update(wait_share=r.get("wait_ms", float("nan")) / r["step_ms"],
                     timing_cost=r["tok_s_untimed"] / r["tok_s"] - 1)
            rows.append(r)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            del cache
    commit, dirty = git_state()
    df = pd.DataFrame(rows).assign(stamp_pair_us=stamp_pair_us(dev), model=MODEL, gpu=torch.cuda.get_device_name(),
                                   torch=torch.__version__, commit=commit, dirty=dirty,
                                   command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "stream_decode.csv", index=False)
    cols = ["types", "context", "mode", "fraction", "arena_mib", "capacity", "streamed_pages", "rounds", "group", "tok_s", "step_synced_ms",
            "transfer_only_ms", "transfer_eager_ms", "copy_gbps", "wait_ms", "wait_share", "timing_cost",
            "frac_of_pinned_ceiling", "overlap_ratio", "slab_mib", "slab_used_mib", "host_store_mib", "prefill_tok_s", "prefill_peak_reserved_mib", "run_beyond_arena_mib", "torch_before_mib", "bound_mib", "device_beyond_mib"]
    print(df[cols].round(3).to_string(index=False))
    print(f"pinned ceiling {ceiling:.1f} GB/s")
    plot(df, out / "stream_decode.png")


if __name__ == "__main__":
    main()
