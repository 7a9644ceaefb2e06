"""Perplexity at long context with and without YaRN (issue #30): one chunk per context, the
second half scored, on long code: this interpreter's standard-library ``*.py`` files in sorted
order (``kvstream.eval.corpus.python_sources``), concatenated until the text holds the largest
context.

    python -m experiments.long_context_ppl --model qwen2.5-coder-1.5b --ctx 16384,32768,65536,131072 \\
        --device cuda --dtype bfloat16 --out results/long_context

Arms: ``rope`` (the GGUF's plain RoPE; past its context with ``model.max_context``, on purpose)
and ``yarn`` (``model.rope_scaling=yarn model.rope_factor=4``, the model card's 128K). Every run
is ``kvstream-ppl`` with the contiguous cache. Rows are appended to ``<out>/ppl.csv`` as they
finish; a re-run skips the (arm, ctx) pairs the file holds for the same model and text.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import matplotlib
import pandas as pd

from experiments.common import provenance, run_ppl
from kvstream.eval.corpus import python_sources
from kvstream.model.loader import open_gguf, read_config
from kvstream.model.registry import resolve_model
from kvstream.model.tokenizer import Tokenizer

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ARMS = {"rope": ["model.rope_scaling=none"], "yarn": ["model.rope_scaling=yarn", "model.rope_factor=4"]}


def long_text(tok: Tokenizer, n_tokens: int, path: Path) -> tuple[str, int]:
    """Write stdlib files in name order to ``path`` until they hold ``n_tokens`` tokens (and a
    file more: a chunk needs its BOS); returns (the last file's name, the tokens written)."""
    parts, count, last = [], 0, ""
    for name, file in python_sources(("stdlib",)).items():
        text = file.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        count += len(tok.encode(text)) + 1
        last = name
        if count > n_tokens + 64:
            break
    else:
        raise ValueError(f"this interpreter's standard library holds {count} tokens, fewer than the {n_tokens} asked")
    path.write_text("\n\n".join(parts), encoding="utf-8")
    return last, count


def plot(df: pd.DataFrame, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, g in df.groupby("arm"):
        g = g.sort_values("ctx")
        ax.errorbar(g["ctx"], g["ppl"], yerr=g["ppl_err"], marker="o", capsize=3, label=arm)
    ax.axvline(df["orig_ctx"].iloc[0], color="grey", ls=":", label="trained context")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(df["ctx"].unique()), [f"{c // 1024}K" for c in sorted(df["ctx"].unique())])
    ax.set_xlabel("chunk (tokens; the second half scored)")
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
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=2048, help="tokens per forward pass")
    ap.add_argument("--out", default="results/long_context")
    args = ap.parse_args()
    ctxs, arms = [int(c) for c in args.ctx.split(",")], args.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        ap.error(f"--arms {','.join(sorted(unknown))}: choose from {', '.join(ARMS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model(args.model)
    reader = open_gguf(path)
    orig = read_config(reader).context_length
    text_file = out / "text.tmp.py"  # the text is rebuilt from this machine's stdlib: never committed
    last, n = long_text(Tokenizer.from_gguf(reader), max(ctxs), text_file)
    text_sha = hashlib.sha1(text_file.read_bytes()).hexdigest()[:12]
    print(f"text: stdlib files up to {last} ({n:,} tokens, sha1 {text_sha})", flush=True)
    csv = out / "ppl.csv"
    done = pd.read_csv(csv) if csv.exists() else pd.DataFrame(columns=["arm", "ctx", "text_sha1", "model"])
    for ctx in ctxs:
        for arm in arms:
            if ((done["arm"] == arm) & (done["ctx"] == ctx) & (done["text_sha1"] == text_sha)
                    & (done["model"] == str(args.model))).any():
                continue
            extra = [f"model.max_context={ctx}"] if arm == "rope" and ctx > orig else []
            r = run_ppl([f"model.source={path}", f"hardware.device={args.device}", f"hardware.dtype={args.dtype}",
                         "cache=contiguous", f"ctx={ctx}", "n_chunks=1", f"batch={min(args.batch, ctx)}",
                         f"text_file={text_file}", "progress=false", *ARMS[arm], *extra])
            row = dict(arm=arm, ctx=ctx, orig_ctx=orig, ppl=r["ppl"], ppl_err=r["ppl_err"],
                       model=str(args.model), text=f"stdlib to {last}", text_sha1=text_sha, **provenance())
            pd.DataFrame([row]).to_csv(csv, mode="a", header=not csv.exists(), index=False)
    text_file.unlink()
    df = pd.read_csv(csv)
    print(df.pivot_table(index="ctx", columns="arm", values="ppl").round(4).to_string())
    plot(df, out)


if __name__ == "__main__":
    main()
