"""How a decode step's host -> ring copies should be issued: the copy rate of one step's
streamed pages (every layer's oldest ``S`` pages of K and V) against the pinned ceiling, per
way of issuing them, each replayed from a CUDA graph as the graphed step issues them.

    python -m experiments.bench_copies --out results/stream

Ways: ``per_layer`` (one K and one V copy per layer, one stream), ``two_streams`` (the same
copies, K on one stream and V on another, so two copy engines overlap their per-copy latency),
``group_G`` (G layers' pages in one 2-D copy each for K and V: rows are layers, the host
store's layer pitch on one side, the ring's on the other: the runtime's way). Page sizes are
the Qwen2.5-Coder-1.5B layer's (2 KV heads x 128, q8_0 K / q4_0 V).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

from experiments.common import QWEN15, git_state, pinned_ceiling
from kernels.formats import PageFormat
from kvstream.cache.cudart import copy_rows

K_PAGE, V_PAGE = (PageFormat(t, QWEN15.n_kv_heads, QWEN15.head_dim).page_bytes for t in ("q8_0", "q4_0"))
LAYERS = QWEN15.n_layers
MODEL = "Qwen2.5-Coder-1.5B page sizes (28 layers, 2 KV heads x 128, q8_0 K / q4_0 V)"


def issue(way: str, host: tuple, ring: tuple, S: int, streams: list) -> None:
    """One step's copies: ``host`` (K, V) [layers, pages, bytes], ``ring`` (K, V) [slots, bytes]."""
    if way == "per_layer" or way == "two_streams":
        for l in range(LAYERS):
            for i, (h, r) in enumerate(zip(host, ring)):
                s = streams[i if way == "two_streams" else 0]
                with torch.cuda.stream(s):
                    r[(l % 2) * S:(l % 2) * S + S].copy_(h[l, :S], non_blocking=True)
        return
    G = int(way.split("_")[1])
    for g0 in range(0, LAYERS, G):
        n, half = min(G, LAYERS - g0), (g0 // G) % 2
        for h, r in zip(host, ring):
            dst = r[half * G * S:(half * G + n) * S].view(n, S * r.shape[1])
            copy_rows(dst, h[g0:g0 + n, :S].flatten(1), streams[0])


def time_way(way: str, host, ring, S: int, reps: int = 20) -> float:
    main = torch.cuda.Stream()
    streams = [main, torch.cuda.Stream()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        streams[1].wait_stream(main)
        issue(way, host, ring, S, streams)
        main.wait_stream(streams[1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        start.record(main)
        with torch.cuda.stream(main):
            graph.replay()
        end.record(main)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[2, 4, 6, 9, 15, 32, 64])
    ap.add_argument("--groups", type=int, nargs="+", default=[2, 4, 7, 14, 28])
    ap.add_argument("--out", default="results/stream")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceiling = pinned_ceiling(dev)
    P = max(args.pages)
    host = tuple(torch.randint(0, 255, (LAYERS, P, b), dtype=torch.uint8).pin_memory() for b in (K_PAGE, V_PAGE))
    ways = ["per_layer", "two_streams"] + [f"group_{g}" for g in args.groups]
    rows = []
    for S in args.pages:
        for way in ways:
            G = int(way.split("_")[1]) if way.startswith("group") else 1
            ring = tuple(torch.empty((2 * G * S, b), dtype=torch.uint8, device=dev) for b in (K_PAGE, V_PAGE))
            ms = time_way(way, host, ring, S)
            nbytes = LAYERS * S * (K_PAGE + V_PAGE)
            gbps = nbytes / ms / 1e6
            rows.append(dict(pages_per_layer=S, way=way, ms=ms, bytes=nbytes, gbps=gbps, frac_of_pinned_ceiling=gbps / ceiling,
                             ring_mib=2 * G * S * (K_PAGE + V_PAGE) / 2**20, pinned_ceiling_gbps=ceiling))
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    commit, dirty = git_state()
    df = pd.DataFrame(rows).assign(model=MODEL, gpu=torch.cuda.get_device_name(), commit=commit, dirty=dirty,
                                   command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "copy_ways.csv", index=False)
    print(df.pivot(index="pages_per_layer", columns="way", values="frac_of_pinned_ceiling").round(3).to_string())


if __name__ == "__main__":
    main()
