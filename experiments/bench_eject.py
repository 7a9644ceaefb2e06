"""Eject / re-enable at real shapes: what one transition costs, what it gives back, and that a
thousand cycles leave the arena accounting and the device memory exactly as they were.

    python -m experiments.bench_eject experiment=draft_threshold_h200_synthetic context=16384 +cycles=1000

Takes a study config (target, draft, cache, arena), prefills ``context`` tokens, pins the draft,
then times ``cycles`` eject + re-enable pairs (``PagedCache.rearrange``: the target's resident
pages are re-uploaded from the host store each time, the draft's weights re-pinned from the host
copy and its KV re-uploaded from its host store). Also times one eager decode step with and
without the draft and profiles where a step's time goes (host vs device). Writes
``<results>/eject/<device>.csv`` and ``profile.csv``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_module
from tqdm import tqdm

from experiments.common import load_target, review_prompt
from experiments.draft_threshold import StudyConfig
from kvstream.cache.factory import make_cache
from kvstream.config import to_typed
from kvstream.engine.draft_control import DraftControl
from kvstream.engine.generate import prefill_phase
from kvstream.engine.runner import DRAFT_HOSTS
from kvstream.speculators.draft import DraftModel
from policies.eject import Never


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def memory(dev) -> int | None:
    """Device bytes torch holds (None off CUDA: not measured there)."""
    return torch.cuda.memory_allocated() if dev.type == "cuda" else None


def step_profile(fn, dev) -> dict:
    """Host wall time of ``fn`` against the device time of its kernels (torch.profiler)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync(dev)
    wall = time.perf_counter() - t0
    ev = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in ev) if dev.type == "cuda" else 0
    launches = sum(e.count for e in ev if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    return {"wall_ms_profiled": wall * 1e3, "device_ms": device_us / 1e3, "kernel_launches": launches}


def main() -> None:
    argv = sys.argv[1:]
    cycles = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("+cycles=")), 1000)
    with initialize_config_module("conf", version_base=None):
        cfg = to_typed(compose("draft_threshold", overrides=[a for a in argv if not a.startswith("+")]), StudyConfig)
    model, tok, _ = load_target(cfg)
    dev, d = model.device, cfg.spec.draft
    max_tokens = cfg.context + 64
    cache = make_cache(cfg.cache, cfg.arena, model, max_tokens, cfg.prefill_chunk, verify_width=1 + cfg.spec.n_max)
    prompt = review_prompt(tok, cfg.context, cfg.instruction)
    host = DRAFT_HOSTS.get_host(d.source, tok, model.dtype, dev)
    draft = DraftModel(host, dev, max_tokens=max_tokens, type_k=d.type_k, type_v=d.type_v, window=d.window, chunk=d.chunk)
    control = DraftControl(draft, cache, Never())
    with torch.inference_mode():
        prefill_phase(model, cache, prompt, cfg.prefill_chunk)
        draft.begin(prompt)
        tokens = torch.tensor(prompt[-1 - cfg.spec.n_max:], device=dev)

        def target_step(width):
            start = cache.length
            model(tokens[:width], cache, all_logits=True)
            cache.truncate(start)

        def draft_token():
            start = draft.cache.length
            draft.model(tokens[:1], draft.cache)
            draft.cache.truncate(start)

        rows = []
        for state in ("with draft", "ejected"):
            for width in (1, 1 + cfg.spec.n_max):
                for _ in range(3):
                    target_step(width)  # warm-up (compiles)
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(10):
                    target_step(width)
                sync(dev)
                rows.append({"what": f"target step, width {width}, {state}", "ms": (time.perf_counter() - t0) * 100,
                             "streamed_pages": cache.stats.streamed_pages, "capacity": cache.capacity,
                             **step_profile(lambda: target_step(width), dev)})
            if state == "with draft":
                for _ in range(3):
                    draft_token()
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(10):
                    draft_token()
                sync(dev)
                rows.append({"what": "draft token", "ms": (time.perf_counter() - t0) * 100,
                             **step_profile(draft_token, dev)})
                cache.rearrange(lambda: draft.eject(cache.arena))
        cache.rearrange(lambda: draft.pin(cache.arena))

        arena = cache.arena
        state0, mem0 = (arena.top, list(arena.pinned), cache.layout), memory(dev)
        ej, re = [], []
        for _ in tqdm(range(cycles), desc="eject/re-enable", unit="cycle"):
            sync(dev)
            t0 = time.perf_counter()
            cache.rearrange(lambda: draft.eject(arena))
            sync(dev)
            t1 = time.perf_counter()
            cache.rearrange(lambda: draft.pin(arena))
            sync(dev)
            ej.append(t1 - t0)
            re.append(time.perf_counter() - t1)
        same = (arena.top, arena.pinned, cache.layout) == state0
        flat = same and (mem0 is None or memory(dev) == mem0)
    s = pd.Series
    rows += [{"what": "eject (median)", "ms": s(ej).median() * 1e3, "capacity": control.capacity_without},
             {"what": "re-enable (median)", "ms": s(re).median() * 1e3, "capacity": control.capacity_with},
             {"what": f"{cycles} cycles: accounting " + ("and device memory unchanged" if mem0 is not None else
                                                          "unchanged (device memory: not measured off CUDA)"),
              "ms": float("nan"),
              "flat": flat, "draft_mib": control.bytes / 2**20, "device_bytes_before": mem0,
              "device_bytes_after": memory(dev)}]
    out = Path(cfg.results) / "eject"
    out.mkdir(parents=True, exist_ok=True)
    name = (torch.cuda.get_device_name() if dev.type == "cuda" else "cpu").replace(" ", "_")
    df = pd.DataFrame(rows).assign(context=cfg.context, model=cfg.model.source, draft=d.source, dtype=cfg.hardware.dtype)
    df.to_csv(out / f"{name}.csv", index=False)
    print(df.drop(columns=["model", "draft"]).to_string())


if __name__ == "__main__":
    main()
