"""Where a greedy decode step's time goes: the host's part of it against the GPU's.

    python -m experiments.bench_step --model qwen2.5-coder-1.5b --device cuda --context 4096 --steps 128

Prefills a review prompt (resident cache, arena auto), then runs ``--steps`` greedy steps as
``generate`` runs them (read the token back, make its tensor, call the model, which on CUDA
replays the captured step), timing each host phase with the clock, ``cache.begin`` and
``cache.commit`` included (wrapped). Then replays the captured step ``--steps`` times back to
back: the GPU time of one step with no host in between. The step's wall time minus that GPU
time is what the host adds to every token (the device waits for it: the token is read back
before the next step starts). Writes ``<out>/step_<device>_<model>_<context>.csv`` (one row
per step, seconds) and prints the medians.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.bench_peers import INSTRUCTION, kvstream_config, kvstream_model
from experiments.draft_threshold import review_prompt
from kvstream.cache_factory import make_cache
from kvstream.cuda_graph import GraphedModel
from kvstream.generate import prefill_phase, warm_up
from kvstream.registry import resolve_model
from kvstream.sampling import Sampler

PHASES = ("sample", "token", "begin", "commit", "call")


def _timed(fn, times: dict, key: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[key] = times.get(key, 0.0) + time.perf_counter() - t0
        return out
    return wrapper


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(path, context: int, steps: int, device: str) -> pd.DataFrame:
    cfg = kvstream_config(device, "resident", steps + 1)
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
    _sync(model.device)
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
    _sync(model.device)
    df = pd.DataFrame(rows)
    df["wall"] = df[["sample", "token", "call"]].sum(axis=1)
    df["gpu"] = float("nan")
    if isinstance(step, GraphedModel):  # the captured step alone, back to back
        graph, _ = step.graphs[(1, False)]
        _sync(model.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        _sync(model.device)
        df["gpu"] = (time.perf_counter() - t0) / steps
    return df


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="results/step")
    args = ap.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps must be >= 2 (got {args.steps}): the first step is not counted")
    df = measure(resolve_model(args.model), args.context, args.steps, args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"step_{args.device.split(':')[0]}_{Path(args.model).name}_{args.context}.csv"
    df.to_csv(out / name, index=False)
    med = df.iloc[1:].median()  # the first step carries the warm-up's tail
    host = med["wall"] - med["gpu"]
    print(f"{args.model} {args.device} context {args.context}: median step {1e3 * med['wall']:.3f} ms, "
          f"GPU alone {1e3 * med['gpu']:.3f} ms, host adds {1e3 * host:.3f} ms per token")
    print("host phases (median ms): " + ", ".join(f"{p} {1e3 * med[p]:.3f}" for p in PHASES if p in med))
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
