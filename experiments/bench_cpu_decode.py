"""Decode tok/s of kvstream against HF transformers on the same GGUF, same prompt, same run.

    python experiments/bench_cpu_decode.py --model qwen2.5-coder-0.5b --new-tokens 64 --reps 3

Both sides run fp32 on the CPU, greedy, for exactly ``--new-tokens`` tokens (EOS ignored).
Decode time excludes the prefill on both sides: kvstream times its decode loop; for
transformers, a 1-token ``generate`` (prefill + first token) is subtracted from an N-token one.
The arms alternate within each repetition so that machine drift hits both; medians are reported.
Writes ``<out>/cpu_decode.csv`` with the command, commit and machine in every row.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.common import git_state
from kvstream.engine.generate import generate
from kvstream.model.loader import open_gguf
from kvstream.model.qwen import load_model
from kvstream.model.registry import resolve_model
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.model.tokenizer import Tokenizer

PROMPT = '"""Utilities for parsing and validating configuration files."""\nimport json\nimport os\n\n\ndef load_config(path):\n'


def hf_decode_s(hf, ids: torch.Tensor, n: int) -> float:
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    t2 = time.perf_counter()
    assert out.shape[1] == ids.shape[1] + n
    return (t2 - t1) - (t1 - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="results/cpu_decode")
    args = ap.parse_args()
    import transformers

    path = resolve_model(args.model)
    reader = open_gguf(path)
    prompt = Tokenizer.from_gguf(reader).encode(PROMPT)
    ours = load_model(reader, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    n = args.new_tokens
    rows = []
    with torch.inference_mode():
        # warm-up: page faults, allocator, first-call dispatch
        generate(ours, ours.new_cache(len(prompt) + n), prompt, n, Sampler(SamplingParams()))
        hf_decode_s(hf, ids, n)
        for rep in range(args.reps):
            g = generate(ours, ours.new_cache(len(prompt) + n), prompt, n, Sampler(SamplingParams()))
            rows.append(dict(rep=rep, arm="kvstream", decode_tok_s=(n - 1) / g.stats.decode_s))
            rows.append(dict(rep=rep, arm="transformers", decode_tok_s=(n - 1) / hf_decode_s(hf, ids, n)))
            print(rows[-2], rows[-1], flush=True)
    commit, dirty = git_state()
    df = pd.DataFrame(rows).assign(
        model=args.model, prompt_tokens=len(prompt), new_tokens=n, threads=torch.get_num_threads(),
        torch=torch.__version__, transformers=transformers.__version__, cpu=platform.processor() or platform.machine(),
        commit=commit, dirty=dirty, command=" ".join(["python"] + sys.argv),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "cpu_decode.csv", index=False)
    med = df.groupby("arm")["decode_tok_s"].median()
    wide = df.pivot(index="rep", columns="arm", values="decode_tok_s")
    paired = (wide["kvstream"] / wide["transformers"]).median()  # same-rep pairs share machine drift
    print(f"median decode tok/s: kvstream {med['kvstream']:.2f}, transformers {med['transformers']:.2f}; "
          f"median paired ratio {paired:.2f}x  ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
