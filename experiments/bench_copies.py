"""How a decode step's host -> ring copies should be issued: the copy rate of one step's
streamed pages (every layer's oldest ``S`` pages of K and V) against the pinned ceiling, per
way of issuing them, each replayed from a CUDA graph as the graphed step issues them.

    python -m experiments.bench_copies --out results/stream

Ways: ``per_layer`` (one K and one V copy per layer, one stream: the runtime before
grouping), ``two_streams`` (the same copies, K on one stream and V on another, so two copy
engines overlap their per-copy latency), ``group_G`` (G layers' pages in one 2-D copy each
for K and V: rows are layers, the host store's layer pitch on one side, the ring's on the
other), ``kernel_layer`` (one ``kernels.copy_pages`` launch per layer moving its K and V
pages: SM loads from pinned host memory, zero-copy, no copy engine) and ``kernel_step`` (one
launch for every layer's pages), each for several program counts (column ``programs``). The
kernel ways read other host pages in each replay (the step's pages shift by S, wrapping in the
host store's P pages): the L2 may cache system memory, and the copy engine ways read from the
host anyway. Each kernel way's first (eager) run is checked byte for byte. Page sizes are the
Qwen2.5-Coder-1.5B layer's (2 KV heads x 128, q8_0 K / q4_0 V).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

from experiments.bench_stream import QWEN15, pinned_ceiling
from kernels.copy_pages import copy_jobs
from kernels.formats import PageFormat
from kvstream.cudart import copy_rows

K_PAGE, V_PAGE = (PageFormat(t, QWEN15.n_kv_heads, QWEN15.head_dim).page_bytes for t in ("q8_0", "q4_0"))
LAYERS = QWEN15.n_layers
MODEL = "Qwen2.5-Coder-1.5B page sizes (28 layers, 2 KV heads x 128, q8_0 K / q4_0 V)"
KERNEL_WAYS = ("kernel_layer", "kernel_step")


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


def kernel_rows(way: str, S: int, P: int, shift: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(host rows, ring slots) [layers, S] int32 of a kernel way's step: layer l's pages
    (shift + j) % P of the host store viewed as [layers * P, bytes]; ``kernel_layer`` alternates
    ring halves of S slots, ``kernel_step`` gives every layer its own S slots."""
    j = torch.arange(S)
    src = torch.arange(LAYERS)[:, None] * P + (shift + j) % P
    dst = (torch.arange(LAYERS)[:, None] % 2 if way == "kernel_layer" else torch.arange(LAYERS)[:, None]) * S + j
    return src.int().to(device), dst.int().to(device)


def issue_kernel(way: str, host: tuple, ring: tuple, rows: tuple, programs: int) -> None:
    """One step's copies by the copy kernel on the current stream: ``host`` (K, V) [layers * P,
    bytes] pinned, ``ring`` (K, V) [slots, bytes], ``rows`` from ``kernel_rows``."""
    (hk, hv), (rk, rv), (src, dst) = host, ring, rows
    if way == "kernel_step":
        copy_jobs([(hk, rk, src.view(-1), dst.view(-1)), (hv, rv, src.view(-1), dst.view(-1))], programs)
        return
    for l in range(LAYERS):
        copy_jobs([(hk, rk, src[l], dst[l]), (hv, rv, src[l], dst[l])], programs)


def check_kernel_way(way: str, host: tuple, ring: tuple, rows: tuple) -> None:
    """The ring holds the host rows the step's last launches copied (every layer's for
    ``kernel_step``; the last two layers' for ``kernel_layer``, which reuses two halves)."""
    torch.cuda.synchronize()
    src, dst = (r.cpu().long() for r in rows)
    layers = range(LAYERS - 2, LAYERS) if way == "kernel_layer" else range(LAYERS)
    for h, r in zip(host, ring):
        r = r.cpu()
        for l in layers:
            if not torch.equal(r[dst[l]], h[src[l]]):
                raise RuntimeError(f"{way}: ring slots {dst[l].tolist()} differ from host rows {src[l].tolist()}")


def time_way(way: str, host, ring, S: int, reps: int = 20, programs: int | None = None) -> float:
    """Median ms of one step's copies replayed from a CUDA graph; ``programs`` for the kernel ways."""
    main = torch.cuda.Stream()
    streams = [main, torch.cuda.Stream()]
    kernel = way in KERNEL_WAYS
    if kernel:
        P = host[0].shape[1]
        host = tuple(h.view(LAYERS * P, h.shape[2]) for h in host)
        tables = [kernel_rows(way, S, P, (i * S) % P, ring[0].device) for i in range(reps + 2)]
        rows = tuple(t.clone() for t in tables[0])
        with torch.cuda.stream(main):
            issue_kernel(way, host, ring, rows, programs)  # compiles outside the capture
        check_kernel_way(way, host, ring, rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        streams[1].wait_stream(main)
        if kernel:
            issue_kernel(way, host, ring, rows, programs)
        else:
            issue(way, host, ring, S, streams)
        main.wait_stream(streams[1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 2):
        if kernel:  # other host pages each replay (L2 may cache system memory); not timed
            for r, t in zip(rows, tables[i]):
                r.copy_(t)
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
    ap.add_argument("--programs", type=int, nargs="*", default=[8, 16, 32, 64, 132],
                    help="program counts of the kernel ways (none: skip them)")
    ap.add_argument("--out", default="results/stream")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceiling = pinned_ceiling(dev)
    P = max(args.pages)
    host = tuple(torch.randint(0, 255, (LAYERS, P, b), dtype=torch.uint8).pin_memory() for b in (K_PAGE, V_PAGE))
    ways = [(w, None) for w in ["per_layer", "two_streams"] + [f"group_{g}" for g in args.groups]]
    ways += [(w, p) for w in KERNEL_WAYS for p in args.programs]
    rows = []
    for S in args.pages:
        for way, programs in ways:
            G = int(way.split("_")[1]) if way.startswith("group") else 1
            slots = LAYERS * S if way == "kernel_step" else 2 * G * S
            ring = tuple(torch.empty((slots, b), dtype=torch.uint8, device=dev) for b in (K_PAGE, V_PAGE))
            ms = time_way(way, host, ring, S, programs=programs)
            nbytes = LAYERS * S * (K_PAGE + V_PAGE)
            gbps = nbytes / ms / 1e6
            rows.append(dict(pages_per_layer=S, way=way, ms=ms, bytes=nbytes, gbps=gbps, frac_of_pinned_ceiling=gbps / ceiling,
                             ring_mib=slots * (K_PAGE + V_PAGE) / 2**20, pinned_ceiling_gbps=ceiling,
                             programs=programs))
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    df = pd.DataFrame(rows).astype({"programs": "Int64"})  # empty for the copy engine ways
    df = df.assign(model=MODEL, gpu=torch.cuda.get_device_name(), commit=commit or "unknown",
                   command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "copy_ways.csv", index=False)
    label = df.way.where(df.programs.isna(), df.way + "_p" + df.programs.astype(str))
    print(df.assign(way=label).pivot(index="pages_per_layer", columns="way", values="frac_of_pinned_ceiling")
          .round(3).to_string())


if __name__ == "__main__":
    main()
