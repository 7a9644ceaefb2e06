"""Perplexity at long context with and without YaRN (issue #30), one chunk per context, on long
code: this interpreter's standard-library ``*.py`` files in name order
(``kvstream.eval.corpus.python_sources``), concatenated until the text holds the largest context.

    python -m experiments.long_context_ppl --model qwen2.5-coder-1.5b --ctx 16384,32768,65536,131072 \\
        --device cuda --dtype bfloat16 --tail 8192 --out results/long_context/1.5b

What is scored:
- ``--tail N`` (N > 0): the same last N tokens of the text at every context, each preceded by
  ctx - N tokens of it. A row then differs from another only in how much context its tokens had.
- ``--tail 0``: llama-perplexity's method, the first ctx tokens of the text with their second half
  scored. The scored tokens then differ between contexts.

Arms: ``rope`` (the GGUF's plain RoPE; past its context with ``model.max_context``, on purpose)
and ``yarn`` (``model.rope_scaling=yarn model.rope_factor=4``, the model card's 128K). The cache is
the contiguous one. Rows are appended to ``<out>/ppl.csv`` as they finish; a re-run skips the
(arm, ctx, tail) rows the file holds for the same model and text.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import torch

from experiments.common import provenance
from kvstream.cache.factory import make_cache
from kvstream.config import ArenaConfig, CacheConfig, Hardware
from kvstream.eval.corpus import python_sources
from kvstream.eval.perplexity import ppl_estimate, scored_logprobs
from kvstream.model.loader import open_gguf, read_config
from kvstream.model.qwen import load_model
from kvstream.model.registry import resolve_model
from kvstream.model.tokenizer import Tokenizer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARMS = {"rope": dict(rope_scaling="none"), "yarn": dict(rope_scaling="yarn", rope_factor=4.0)}


def long_text(tok: Tokenizer, n_tokens: int) -> tuple[list[int], str, str]:
    """(tokens, the last file's name, sha1 of the text): stdlib files in name order until they hold
    ``n_tokens`` tokens."""
    parts, count, last = [], 0, ""
    for name, file in python_sources(("stdlib",)).items():
        parts.append(file.read_text(encoding="utf-8", errors="replace"))
        count += len(tok.encode(parts[-1])) + 1
        last = name
        if count > n_tokens + 64:
            break
    else:
        raise ValueError(f"this interpreter's standard library holds {count} tokens, fewer than the {n_tokens} asked")
    text = "\n\n".join(parts)
    return tok.encode(text), last, hashlib.sha1(text.encode()).hexdigest()[:12]


def chunk_ppl(model, tok: Tokenizer, tokens: list[int], ctx: int, tail: int, batch: int) -> tuple[float, float, int]:
    """(PPL, its standard error, tokens scored) of one chunk: the text's first ctx tokens with the
    second half scored (tail 0), or the ctx tokens ending where the text ends, the last ``tail`` scored."""
    chunk = torch.tensor(tokens[:ctx] if tail == 0 else tokens[len(tokens) - ctx:], device=model.device)
    if tok.add_bos and tok.bos_id is not None:
        chunk[0] = tok.bos_id  # as split_chunks does: every chunk opens with BOS
    first = ctx // 2 if tail == 0 else ctx - 1 - tail
    cache = make_cache(CacheConfig(mode="contiguous"), ArenaConfig(), model, ctx, batch, all_logits=True)
    nll = [-lp.gather(1, chunk[row + 1:row + 1 + lp.shape[0], None])[:, 0].double().cpu()
           for row, lp in scored_logprobs(model, cache, chunk, batch, first)]
    nll = torch.cat(nll).numpy()
    return *ppl_estimate(nll), len(nll)


def plot(df: pd.DataFrame, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (arm, tail), g in df.groupby(["arm", "tail"]):
        g = g.sort_values("ctx")
        label = f"{arm}, " + (f"last {tail} tokens" if tail else "second half")
        ax.errorbar(g["ctx"], g["ppl"], yerr=g["ppl_err"], marker="o", capsize=3, label=label)
    ax.axvline(df["orig_ctx"].iloc[0], color="grey", ls=":", label="trained context")
    ticks = sorted(df["ctx"].unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{c // 1024}K" for c in ticks])
    ax.set_xlabel("context (tokens in the chunk)")
    ax.set_ylabel("perplexity (± 1 s.e.)")
    ax.set_title(f"{Path(df['model'].iloc[0]).name}, {df['device_name'].iloc[0]}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ppl.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a registered name or a GGUF path")
    ap.add_argument("--ctx", default="16384,32768,65536,131072", help="chunk sizes, comma-separated")
    ap.add_argument("--arms", default="rope,yarn", help=f"of {', '.join(ARMS)}")
    ap.add_argument("--tail", type=int, default=0, help="score the text's last N tokens at every context (0: "
                                                        "each chunk's second half)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=2048, help="tokens per forward pass")
    ap.add_argument("--out", default="results/long_context")
    args = ap.parse_args()
    ctxs, arms = [int(c) for c in args.ctx.split(",")], args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        ap.error(f"--arms {','.join(sorted(unknown))}: choose from {', '.join(ARMS)}")
    if args.tail and args.tail >= min(ctxs):
        ap.error(f"--tail {args.tail} must be below the smallest context, {min(ctxs)}")
    hw = Hardware(args.device, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model(args.model)
    reader = open_gguf(path)
    orig = read_config(reader).context_length
    tok = Tokenizer.from_gguf(reader)
    tokens, last, text_sha = long_text(tok, max(ctxs))
    print(f"text: stdlib files up to {last} ({len(tokens):,} tokens, sha1 {text_sha})", flush=True)
    csv = out / "ppl.csv"
    done = pd.read_csv(csv) if csv.exists() else pd.DataFrame(columns=["arm", "ctx", "tail", "text_sha1", "model"])
    if "tail" not in done:  # a file from before --tail: second halves
        done["tail"] = 0
    key = lambda arm, ctx: ((done["arm"] == arm) & (done["ctx"] == ctx) & (done["tail"] == args.tail)
                            & (done["text_sha1"] == text_sha) & (done["model"] == str(args.model))).any()
    for arm in arms:
        todo = [c for c in ctxs if not key(arm, c)]
        if not todo:
            continue
        model = load_model(reader, hw.torch_dtype, hw.device, max_context=max(todo), **ARMS[arm])
        for ctx in todo:
            ppl, err, n = chunk_ppl(model, tok, tokens, ctx, args.tail, min(args.batch, ctx))
            print(f"{arm:5s} ctx {ctx:>7}: PPL {ppl:.4f} ± {err:.4f} over {n} tokens", flush=True)
            row = dict(arm=arm, ctx=ctx, tail=args.tail, orig_ctx=orig, ppl=ppl, ppl_err=err, scored=n,
                       model=str(args.model), text=f"stdlib to {last}", text_sha1=text_sha, **provenance(),
                       command=" ".join(["python -m experiments.long_context_ppl", *sys.argv[1:]]))
            # the whole file again: a row may carry columns an older file lacks (the command)
            done = pd.concat([done, pd.DataFrame([row])], ignore_index=True)
            done.to_csv(csv, index=False)
        del model
    df = pd.read_csv(csv)
    if "tail" not in df:
        df["tail"] = 0
    print(df.pivot_table(index=["tail", "ctx"], columns="arm", values="ppl").round(4).to_string())
    plot(df, out)


if __name__ == "__main__":
    main()
