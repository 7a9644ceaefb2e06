"""kvstream against what a user would run instead, on the same GGUF, machine, prompt and run:
llama.cpp (through llama-cpp-python: q8_0 K / q4_0 V, flash attention, every layer on the
GPU) and HF transformers with its static cache. Greedy decode of ``--new-tokens`` after a
``--context``-token prompt (standard-library source + a review instruction, chat template).

    python experiments/bench_peers.py --model qwen2.5-coder-0.5b --device cpu --contexts 1024 --new-tokens 64
    python experiments/bench_peers.py --model qwen2.5-coder-1.5b --device cuda --contexts 4096 32768

Arms: ``kvstream-resident`` (every page in the arena), ``kvstream-stream`` (stream mode with
an arena that holds everything: streaming overhead when nothing streams), ``llama.cpp``,
``transformers-static``. An arm whose package is missing is reported as skipped. Writes
``<out>/<device>_<model>.csv`` and a PNG; decode tok/s counts the tokens after the first
(the first comes from the prefill's logits) over the time after the prefill.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from experiments.draft_threshold import review_prompt
from kvstream.config import ArenaConfig, CacheConfig, GenerateConfig, Hardware
from kvstream.loader import open_gguf
from kvstream.model import load_model
from kvstream.registry import resolve_model
from kvstream.runner import run_decode
from kvstream.tokenizer import Tokenizer

INSTRUCTION = "Review the code above: point out bugs, unclear names and missing tests."


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kvstream_arm(path, prompt, new, device, mode):
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    cfg = GenerateConfig(hardware=Hardware(device, dtype), cache=CacheConfig(mode=mode), arena=ArenaConfig("auto"),
                         max_new_tokens=new, ignore_eos=True)
    reader = open_gguf(path)
    model, tok = load_model(reader, cfg.hardware.torch_dtype, device), Tokenizer.from_gguf(reader)
    run_decode(replace(cfg, max_new_tokens=8), model, tok, prompt[:512])  # warm-up
    g = run_decode(cfg, model, tok, prompt).generation
    return g.stats.decode_tok_s, g.stats.prefill_tok_s, g.tokens


def llama_cpp_arm(path, prompt, new, device):
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + new + 16, n_gpu_layers=-1 if device.startswith("cuda") else 0,
                          flash_attn=True, type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q4_0,
                          n_batch=512, logits_all=False, verbose=False)
    import numpy as np

    vocab = llm.n_vocab()
    last = lambda: int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    out = [last()]
    t2 = time.perf_counter()
    for _ in range(new - 1):  # greedy, one token per eval: the same loop as kvstream's decode
        llm.eval([out[-1]])
        out.append(last())
    t3 = time.perf_counter()
    return (new - 1) / (t3 - t2), len(prompt) / (t1 - t0), out


def transformers_arm(path, prompt, new, device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                 dtype=dtype).to(device)
    ids = torch.tensor([prompt], device=device)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    model.generate(ids[:, :512], max_new_tokens=8, **kw)  # warm-up
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
    "kvstream-stream": lambda p, pr, n, d: kvstream_arm(p, pr, n, d, "stream"),
    "llama.cpp": llama_cpp_arm,
    "transformers-static": transformers_arm,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    ap.add_argument("--out", default="results/peers")
    args = ap.parse_args()
    path = resolve_model(args.model)
    tok = Tokenizer.from_gguf(path)
    rows = []
    for context in args.contexts:
        prompt = review_prompt(tok, context, INSTRUCTION)
        for arm in args.arms:
            try:
                decode, prefill, tokens = ARMS[arm](path, prompt, args.new_tokens, args.device)
            except ImportError as e:
                print(f"{arm}: skipped ({e})")
                continue
            rows.append({"arm": arm, "model": args.model, "device": args.device, "context": context,
                         "new_tokens": args.new_tokens, "decode_tok_s": decode, "prefill_tok_s": prefill,
                         "first_tokens": " ".join(map(str, tokens[:16]))})
            print(f"{arm:20s} context {context:6d}: decode {decode:7.2f} tok/s, prefill {prefill:8.1f} tok/s", flush=True)
    df = pd.DataFrame(rows)
    base = df[df.arm == "kvstream-resident"].set_index("context")["decode_tok_s"]
    df["kvstream_resident_over_arm"] = df.apply(lambda r: base.get(r.context, float("nan")) / r.decode_tok_s, axis=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.device.split(':')[0]}_{args.model}"
    df.to_csv(out / f"{name}.csv", index=False)
    print(df.drop(columns=["first_tokens"]).to_string(index=False))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    df.pivot(index="context", columns="arm", values="decode_tok_s").plot.bar(ax=ax)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{args.model} on {args.device}: {args.new_tokens} greedy tokens")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
