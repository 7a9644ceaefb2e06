"""Where a greedy decode step's time goes: the host's part of it against the GPU's.

    python -m experiments.bench_step --model qwen2.5-coder-1.5b --device cuda --context 4096 --steps 128

Prefills a review prompt (resident cache, arena auto), then runs ``--steps`` greedy steps as
``generate`` runs them (read the token back, make its tensor, call the model, which on CUDA
replays the captured step), timing each host phase with the clock, ``cache.begin`` and
``cache.commit`` included (wrapped). Then replays the captured step ``--steps`` times back to
back: the GPU time of one step with no host in between. The step's wall time minus that GPU
time is what the host adds to every token (the device waits for it: the token is read back
before the next step starts). Last, ``generate`` itself decodes ``--steps`` tokens on a fresh
cache (on CUDA with the host a step ahead, so its part overlaps the GPU's): ``generate_s``,
the step time a user gets; and its greedy step's graph (``GraphedModel.next_token``: the argmax
and the next step's staging inside) replayed ``--steps`` times back to back: ``gpu_greedy``
(each replay one position further on, as it stages its successor: the rows past the cache's
end overwrite rows of its pool, which nothing reads after). Writes
``<out>/step_<device>_<model>_<context>.csv`` (one row
per step, seconds) and prints the medians. ``--profile`` (CUDA) adds
``<out>/kernels_<model>_<context>.csv``: the GPU time of one captured step by kernel
(torch.profiler over replays), the explanation of the GPU part; and
``<out>/decode_<model>_<context>.csv``: ``generate()``'s device work per decode step by name,
what runs between the graphs' replays included, and its busy time (``decode_table``).

    python -m experiments.bench_step --report results/step/rope_store/*/step_*.csv   # a table, no GPU

``--report``: one row per step CSV (medians; the kernel totals from the ``kernels_`` CSV beside it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.common import INSTRUCTION, kvstream_config, kvstream_model, provenance, review_prompt
from kvstream.cache.factory import make_cache
from kvstream.engine.graphs import GraphedModel
from kvstream.engine.generate import generate, prefill_phase, sync_device, warm_up
from kvstream.model.registry import resolve_model
from kvstream.model.sampling import Sampler

PHASES = ("sample", "token", "begin", "commit", "call")


def _timed(fn, times: dict, key: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[key] = times.get(key, 0.0) + time.perf_counter() - t0
        return out
    return wrapper


@torch.inference_mode()
def measure(path, context: int, steps: int, device: str, profile: bool = False, weights: str = "dense",
            gemv: bool = False):
    cfg = kvstream_config(device, "resident", steps + 1, weights=weights, gemv=gemv)
    model, tok = kvstream_model(path, cfg)
    prompt = review_prompt(tok, context, INSTRUCTION)
    cache = make_cache(cfg.cache, cfg.arena, model, len(prompt) + steps + 1, cfg.prefill_chunk)
    step = GraphedModel(model) if model.device.type == "cuda" else model
    logits, _ = prefill_phase(step, cache, prompt, cfg.prefill_chunk)
    warm_up(step, cache, [(1, False)])
    times: dict[str, float] = {}
    cache.begin = _timed(cache.begin, times, "begin")  # instance attributes: this cache only
    cache.commit = _timed(cache.commit, times, "commit")
    sampler = Sampler(cfg.sampling, cfg.hardware.device)
    rows = []
    sync_device(model.device)
    for i in range(steps):
        times.clear()
        t0 = time.perf_counter()
        t = int(sampler(logits))  # waits for the previous step's GPU work
        t1 = time.perf_counter()
        ids = torch.tensor([t], device=model.device)
        t2 = time.perf_counter()
        logits = step(ids, cache)[-1]
        t3 = time.perf_counter()
        rows.append({"step": i, "sample": t1 - t0, "token": t2 - t1, "call": t3 - t2, **times})
    sync_device(model.device)
    df = pd.DataFrame(rows)
    df["wall"] = df[["sample", "token", "call"]].sum(axis=1)
    df["gpu"] = float("nan")
    if isinstance(step, GraphedModel):  # the captured step alone, back to back
        graph = next(e.graph for key, e in step.graphs.items() if key[:2] == (1, False))
        sync_device(model.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        sync_device(model.device)
        df["gpu"] = (time.perf_counter() - t0) / steps
    new_cache = lambda n: make_cache(cfg.cache, cfg.arena, model, len(prompt) + n + 1, cfg.prefill_chunk)
    run = lambda n, c=None: generate(step, c or new_cache(n), prompt, n + 1, sampler, prefill_chunk=cfg.prefill_chunk)
    gen_cache = new_cache(steps)  # kept: its greedy graph is timed next (a cache that goes drops its graphs)
    df["generate_s"] = run(steps, gen_cache).stats.decode_s / steps
    df["gpu_greedy"] = float("nan")
    greedy = [e.graph for key, e in getattr(step, "graphs", {}).items() if key[3] == "greedy"]
    if greedy:  # generate()'s own graph (argmax and the next step's staging inside), back to back
        sync_device(model.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            greedy[0].replay()
        sync_device(model.device)
        df["gpu_greedy"] = (time.perf_counter() - t0) / steps
    if profile and isinstance(step, GraphedModel):
        return df, kernel_table(graph, steps), decode_table(run, steps)
    return df, None, None


def kernel_table(graph, replays: int) -> pd.DataFrame:
    """GPU time per replay of ``graph`` by kernel name: microseconds and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key, "us_per_step": e.device_time_total / replays, "calls_per_step": e.count / replays}
            for e in prof.key_averages() if e.device_time_total > 0]
    return pd.DataFrame(rows).sort_values("us_per_step", ascending=False)


def decode_table(run, steps: int) -> pd.DataFrame:
    """The device's work per ``generate()`` decode step by name (kernels, copies; the graph's kernels
    and what runs between replays), and ``(busy)``: the union of its intervals. Two profiled runs,
    of ``steps`` and of 1 decode step, whose difference over ``steps - 1`` leaves the decode's steps
    alone (the prompt, the warm-up and the first step are in both). The step's wall time minus
    ``(busy)`` is the device idle between steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def totals(n: int) -> pd.Series:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(n)
        ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
        t = pd.Series({e.name: 0.0 for e in ev})
        busy, end = 0.0, float("-inf")
        for e in ev:
            t[e.name] += e.time_range.elapsed_us()
            busy += max(0.0, e.time_range.end - max(e.time_range.start, end))
            end = max(end, e.time_range.end)
        t["(busy)"] = busy
        return t

    per_step = totals(steps).sub(totals(1), fill_value=0.0) / (steps - 1)
    out = per_step.rename("us_per_step").rename_axis("name").reset_index()
    return out.sort_values("us_per_step", ascending=False)


def report(paths: list[str]) -> pd.DataFrame:
    """The committed step CSVs as one table: median step, GPU alone, ``generate()``, and the
    captured step's kernel time and launches where its ``kernels_`` CSV lies beside it."""
    rows = []
    for p in map(Path, paths):
        df = pd.read_csv(p)
        med = df.iloc[1:][["wall", "gpu", "generate_s", *(["gpu_greedy"] if "gpu_greedy" in df else [])]].median()
        row = {"file": f"{p.parent.name}/{p.name}", "code": p.parent.parent.name, "model": Path(df["model"].iloc[0]).name,
               "gemv": bool(df["gemv"].iloc[0]) if "gemv" in df else False, "context": int(df["context"].iloc[0]),
               "step_ms": 1e3 * med["wall"], "gpu_ms": 1e3 * med["gpu"],
               "greedy_gpu_ms": 1e3 * med.get("gpu_greedy", float("nan")), "generate_ms": 1e3 * med["generate_s"],
               "tok_s": 1 / med["generate_s"]}
        k = p.with_name(p.name.replace("step_cuda_", "kernels_", 1))
        if k != p and k.exists():
            kt = pd.read_csv(k)
            row |= {"kernel_us": kt["us_per_step"].sum(), "launches": kt["calls_per_step"].sum()}
        rows.append(row)
    return pd.DataFrame(rows)


def compare(table: pd.DataFrame) -> pd.DataFrame:
    """``report``'s runs with ``model.gemv`` against those without, per model and context: the runs'
    mean GPU step and ``generate()`` tok/s, and the ratios to the plain arm (every folder's plain
    runs together: with gemv off the code path is the same). Grouped by ``code`` (the folder two
    above a CSV), so runs of different code stay apart."""
    t = table.groupby(["model", "context", "gemv", "code"], as_index=False).agg(
        runs=("gpu_ms", "size"), gpu_ms=("gpu_ms", "mean"), gpu_min=("gpu_ms", "min"), gpu_max=("gpu_ms", "max"),
        tok_s=("tok_s", "mean"))
    base = table[~table.gemv].groupby(["model", "context"]).agg(plain_gpu_ms=("gpu_ms", "mean"),
                                                                plain_tok_s=("tok_s", "mean"))
    t = t[t.gemv].join(base, on=["model", "context"])
    return t.assign(gpu_ratio=t.gpu_ms / t.plain_gpu_ms, speedup=t.tok_s / t.plain_tok_s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", nargs="+", metavar="CSV", help="tabulate committed step CSVs and exit (no GPU)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="results/step")
    ap.add_argument("--profile", action="store_true", help="also the captured step's GPU time by kernel (CUDA)")
    ap.add_argument("--weights", default="dense", choices=["dense", "q8_0", "q8_0_int8"], help="model.weights: the matrices' format")
    ap.add_argument("--gemv", action="store_true", help="model.gemv: decode matmuls by kernels/gemv.py with PDL")
    args = ap.parse_args(argv)
    if args.report:
        table = report(args.report)
        print(table.drop(columns=["model"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        if table.gemv.any() and not table.gemv.all():
            print("\nmodel.gemv against plain (means of the runs):")
            print(compare(table).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        return
    if args.steps < 2:
        raise SystemExit(f"--steps must be >= 2 (got {args.steps}): the first step is not counted")
    df, kernels, decode = measure(resolve_model(args.model), args.context, args.steps, args.device, args.profile, args.weights,
                          args.gemv)
    meta = dict(model=args.model, weights=args.weights, gemv=args.gemv, context=args.context, **provenance(),
                command=" ".join(["python"] + sys.argv))  # every CSV names what produced it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = ("" if args.weights == "dense" else f"_{args.weights}") + ("_gemv" if args.gemv else "")
    name = f"step_{args.device.split(':')[0]}_{Path(args.model).name}_{args.context}{tag}.csv"
    df.assign(**meta).to_csv(out / name, index=False)
    med = df.iloc[1:].median()  # the first step carries the warm-up's tail
    host = med["wall"] - med["gpu"]
    print(f"{args.model} {args.device} context {args.context}: median step {1e3 * med['wall']:.3f} ms, "
          f"GPU alone {1e3 * med['gpu']:.3f} ms, host adds {1e3 * host:.3f} ms per token")
    greedy = "" if pd.isna(med["gpu_greedy"]) else f"; its greedy graph alone {1e3 * med['gpu_greedy']:.3f} ms"
    print(f"generate(): {1e3 * med['generate_s']:.3f} ms per step ({1 / med['generate_s']:.1f} tok/s){greedy}")
    print("host phases (median ms): " + ", ".join(f"{p} {1e3 * med[p]:.3f}" for p in PHASES if p in med))
    print(f"wrote {out / name}")
    if kernels is not None:
        kname = out / f"kernels_{Path(args.model).name}_{args.context}{tag}.csv"
        kernels.assign(**meta).to_csv(kname, index=False)
        print(f"GPU time by kernel ({kernels.us_per_step.sum():.0f} us/step in {kernels.calls_per_step.sum():.0f} "
              f"launches), the top 25:")
        print(kernels.head(25).to_string(index=False, float_format=lambda v: f"{v:.1f}"))
        print(f"wrote {kname}")
        dname = out / f"decode_{Path(args.model).name}_{args.context}{tag}.csv"
        decode.assign(**meta).to_csv(dname, index=False)
        busy = decode.set_index("name").us_per_step["(busy)"]
        print(f"generate()'s device per decode step: busy {busy:.0f} us of {1e6 * med['generate_s']:.0f}; "
              f"not among the captured logits step's kernels (a greedy step's argmax is), by name:")
        inside = set(kernels.kernel)
        print(decode[~decode.name.isin(inside)].head(15).to_string(index=False, float_format=lambda v: f"{v:.1f}"))
        print(f"wrote {dname}")


if __name__ == "__main__":
    main()
