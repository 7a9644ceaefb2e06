"""kvstream against what a user would run instead, on the same GGUF, machine, prompt and run:
llama.cpp (through llama-cpp-python: q8_0 K / q4_0 V, flash attention, every layer on the
GPU) and HF transformers with its static cache. Greedy decode of ``--new-tokens`` after a
``--context``-token prompt (standard-library source + a review instruction, chat template).

    python -m experiments.bench_peers --model qwen2.5-coder-0.5b --device cpu --contexts 1024 --new-tokens 64
    python -m experiments.bench_peers --model qwen2.5-coder-1.5b --device cuda --contexts 4096 32768

Arms: ``kvstream-resident`` (every page in the arena; CUDA-graph decode steps on CUDA),
``kvstream-resident-eager`` (the same, ``engine.cuda_graphs=false``: the graph speed-up),
``kvstream-stream`` (stream mode with an arena that holds everything: streaming overhead when
nothing streams), ``kvstream-gemv`` (resident with ``model.gemv``: decode rows by kernels/gemv.py
and gemv_mma.py, PDL launches; on CPU the resident arm's path), ``kvstream-q8`` (that, with
``model.weights=q8_0_int8``: the matrices in q8_0 blocks, as the GGUF's q8_0 peers read them;
the fastest decode), ``llama.cpp``,
``transformers-static``. An arm whose package is missing is reported as skipped. Writes
``<out>/<device>_<model>.csv`` and a PNG; decode tok/s counts the tokens after the first (the
first comes from the prefill's logits) over the time after the prefill. ``--profile`` adds ``<out>/profile_<device>_<model>_<context>.csv``: the CUDA time of
one eager kvstream decode step per kernel (torch.profiler), the explanation of the speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from experiments.common import INSTRUCTION, kvstream_config, kvstream_model, provenance, review_prompt
from kvstream.model.loader import is_skeleton, open_gguf
from kvstream.model.registry import MODELS as REGISTERED, resolve_model, sha256_file
from kvstream.engine.runner import run_decode
from kvstream.model.tokenizer import Tokenizer


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kvstream_arm(path, prompt, new, device, mode, graphs=True, gemv=False, weights="dense"):
    cfg = kvstream_config(device, mode, new, graphs, weights=weights, gemv=gemv)
    model, tok = kvstream_model(path, cfg)
    run_decode(replace(cfg, max_new_tokens=8), model, tok, prompt[:512])  # warm-up (compiles, captures)
    g = run_decode(cfg, model, tok, prompt).generation
    return g.stats.decode_tok_s, g.stats.prefill_tok_s, g.tokens


def kvstream_profile(path, prompt, device, steps=8) -> pd.DataFrame:
    """CUDA time per eager decode step, by kernel (the profile that explains the tok/s)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = kvstream_config(device, "resident", steps + 1, graphs=False)
    model, tok = kvstream_model(path, cfg)
    run_decode(replace(cfg, max_new_tokens=2), model, tok, prompt[:512])  # warm-up
    short = prompt[:len(prompt) - 1]
    run_decode(replace(cfg, max_new_tokens=1), model, tok, short)  # the same prefill, to subtract
    with profile(activities=[ProfilerActivity.CUDA]) as prof_prefill:
        run_decode(replace(cfg, max_new_tokens=1), model, tok, short)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_decode(cfg, model, tok, short)
    def table(p):
        return {e.key: (e.device_time_total, e.count) for e in p.key_averages() if e.device_time_total > 0}
    pre, full = table(prof_prefill), table(prof)
    rows = [{"kernel": k, "us_per_step": (t - pre.get(k, (0, 0))[0]) / steps,
             "calls_per_step": (c - pre.get(k, (0, 0))[1]) / steps} for k, (t, c) in full.items()]
    df = pd.DataFrame(rows).sort_values("us_per_step", ascending=False)
    return df[df.calls_per_step > 0]


def plot(df: pd.DataFrame, png: Path, title: str) -> None:
    """Decode tok/s per context, one bar per arm (legend beside the axes: bars stay visible)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    df.pivot(index="context", columns="arm", values="decode_tok_s").plot.bar(ax=ax, rot=0)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def llama_cpp_arm(path, prompt, new, device):
    """llama.cpp in a child process (experiments/peer_llama_cpp.py says why)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ImportError("llama_cpp (llama-cpp-python) is not installed")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompt, f)
        f.flush()
        run = subprocess.run([sys.executable, "-m", "experiments.peer_llama_cpp", str(path), f.name, str(new), device],
                             capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"llama.cpp child failed ({run.returncode}): {run.stderr[-2000:]}")
    r = json.loads(run.stdout.strip().splitlines()[-1])
    return r["decode_tok_s"], r["prefill_tok_s"], r["tokens"]


def transformers_arm(path, prompt, new, device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                 dtype=dtype).to(device)
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    for n in (1, new):  # warm-up at the measured shapes: compilation stays out of the timings
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    sync(device)
    t1 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    sync(device)
    t2 = time.perf_counter()
    prefill = t1 - t0
    return (new - 1) / (t2 - t1 - prefill), len(prompt) / prefill, out[0, len(prompt):].tolist()


ARMS = {
    "kvstream-resident": lambda p, pr, n, d: kvstream_arm(p, pr, n, d, "resident"),
    "kvstream-resident-eager": lambda p, pr, n, d: kvstream_arm(p, pr, n, d, "resident", graphs=False),
    "kvstream-stream": lambda p, pr, n, d: kvstream_arm(p, pr, n, d, "stream"),
    "kvstream-gemv": lambda p, pr, n, d: kvstream_arm(p, pr, n, d, "resident", gemv=True),
    "kvstream-q8": lambda p, pr, n, d: kvstream_arm(p, pr, n, d, "resident", gemv=True, weights="q8_0_int8"),
    "llama.cpp": llama_cpp_arm,
    "transformers-static": transformers_arm,
}


def save(rows: list[dict], path: Path) -> pd.DataFrame:
    """The rows so far as a CSV, with each arm's ratio to kvstream resident at its context."""
    df = pd.DataFrame(rows).reindex(columns=list(dict.fromkeys(
        ["arm", "model", "device", "context", "new_tokens", "decode_tok_s", "prefill_tok_s", "first_tokens"]
        + [k for r in rows for k in r])))
    base = df[df.arm == "kvstream-resident"].set_index("context")["decode_tok_s"]
    df["kvstream_resident_over_arm"] = [base.get(c, float("nan")) / d for c, d in zip(df.context, df.decode_tok_s)]
    df.to_csv(path, index=False)
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    ap.add_argument("--out", default="results/peers")
    ap.add_argument("--profile", action="store_true", help="also write each context's eager per-kernel profile")
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = Tokenizer.from_gguf(path)
    # what produced the rows: code, machine, versions, the exact model file, random weights or not
    run_info = {**provenance(), "model_sha256": REGISTERED[args.model].sha256 if args.model in REGISTERED
                else sha256_file(path), "random_weights": is_skeleton(open_gguf(path))}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.device.split(':')[0]}_{Path(args.model).name}"
    rows = []
    for context in args.contexts:
        prompt = review_prompt(tok, context, INSTRUCTION)
        for arm in args.arms:
            row = {"arm": arm, "model": args.model, "device": args.device, "context": context,
                   "new_tokens": args.new_tokens, **run_info}
            try:
                decode, prefill, tokens = ARMS[arm](path, prompt, args.new_tokens, args.device)
            except ImportError as e:
                print(f"{arm}: skipped ({e})")
                continue
            except Exception as e:  # a peer's crash must not take the other arms' rows with it
                print(f"{arm:24s} context {context:6d}: FAILED ({type(e).__name__}: {e})", flush=True)
                rows.append({**row, "decode_tok_s": float("nan"), "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            rows.append({**row, "decode_tok_s": decode, "prefill_tok_s": prefill,
                         "first_tokens": " ".join(map(str, tokens[:16]))})
            print(f"{arm:24s} context {context:6d}: decode {decode:7.2f} tok/s, prefill {prefill:8.1f} tok/s", flush=True)
            save(rows, out / f"{name}.csv")  # after every arm: a later crash loses no row
        if args.profile and args.device.startswith("cuda"):
            prof = kvstream_profile(path, prompt, args.device)
            prof.to_csv(out / f"profile_cuda_{Path(args.model).name}_{context}.csv", index=False)
            print(prof.head(12).to_string(index=False))
            print(f"sum {prof.us_per_step.sum():.0f} us of CUDA time per eager step, "
                  f"{prof.calls_per_step.sum():.0f} kernels", flush=True)
    if not rows:
        raise SystemExit(f"no arm ran (arms: {', '.join(args.arms)})")
    df = save(rows, out / f"{name}.csv")
    print(df[["arm", "context", "decode_tok_s", "prefill_tok_s", "kvstream_resident_over_arm"]].to_string(index=False))
    plot(df, out / f"{name}.png", f"{args.model} on {args.device}: {args.new_tokens} greedy tokens")

if __name__ == "__main__":
    main()
