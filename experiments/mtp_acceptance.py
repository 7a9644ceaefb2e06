"""How often a trained MTP head's drafts are accepted, and what its step costs against the target's.

    python -m experiments.mtp_acceptance --target PATH.gguf --head HEAD.gguf --device cuda --dtype bfloat16 \
        --k 4 --context 1024 --new-tokens 256 --prompts 4 --out results/mtp

Each prompt (``--prompts`` held-out files of the head's corpus split, then the draft-threshold
studies' review prompt) is decoded greedily twice, in plain torch with a dense cache: by the
target alone, and with the head drafting ``k`` tokens per round (the target verifies
[last token + drafts] in one pass, keeps the longest prefix equal to its own argmax and adds its
next token). In fp32 the two outputs are identical; in bf16 / fp16 a verify pass rounds
differently from one-row steps, so a near-tie may flip and the decodes part (the token where they
do: ``same_as_plain_until``). Written to ``--out``:

- ``rounds.csv``: one row per drafting round (prompt, context, drafted, accepted);
- ``acceptance.csv``: per prompt and draft position j, the share of rounds whose first j drafts
  were all accepted, and tokens per round;
- ``step_cost.csv`` (CUDA): device time of one target step (width 1), one verify pass (width
  k + 1) and one head step, each captured as a CUDA graph at the prompt's length and replayed
  (dense cache, SDPA), and the speed-up those costs and the measured tokens per round PROJECT for
  a drafting round: tokens per round x t_step / (t_verify + k x t_head). It is a projection from
  measured parts, not a measured decode (the engine's: ``experiments.draft_threshold`` with
  ``spec=mtp``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

import conf

from experiments.common import INSTRUCTION, provenance, review_prompt, time_graph
from kvstream.eval.corpus import python_sources, split_files
from kvstream.model.mtp_gguf import load_head
from kvstream.model.loader import open_gguf
from kvstream.model.qwen import load_model
from kvstream.model.registry import resolve_model, sha256_file
from kvstream.model.tokenizer import Tokenizer


def forward(model, tokens: torch.Tensor, cache, features=True) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's pass over ``tokens`` after the cache's rows: (logits [n, V], the states ``features``
    names [n, F x d]: ``Qwen.body``'s ``hidden``)."""
    pos = cache.begin(tokens.shape[0])
    logits, h = model.body(tokens, pos, cache, all_logits=True, hidden=features)
    cache.commit()
    return logits, h


@torch.no_grad()
def plain_greedy(model, prompt: list[int], new: int) -> list[int]:
    cache = model.new_cache(len(prompt) + new + 1)
    dev = model.device
    logits, _ = forward(model, torch.tensor(prompt, device=dev), cache)
    out = [int(logits[-1].argmax())]
    while len(out) < new:
        logits, _ = forward(model, torch.tensor(out[-1:], device=dev), cache)
        out.append(int(logits[-1].argmax()))
    return out


@torch.no_grad()
def mtp_greedy(model, head, prompt: list[int], new: int, k: int) -> tuple[list[int], list[int]]:
    """Greedy decoding with the head drafting k tokens a round: (tokens, accepted drafts per round)."""
    dev, n = model.device, len(prompt)
    cache, kv = model.new_cache(n + new + k + 1), head.new_cache(n + new + 2 * k + 1)
    logits, h = forward(model, torch.tensor(prompt, device=dev), cache, head.features)
    head.step(h[:-1], torch.tensor(prompt[1:], device=dev), torch.arange(1, n, device=dev), kv)  # catch up
    out = [int(logits[-1].argmax())]
    # the rows the head has not seen: (target state at p - 1, token at p)
    rows_h, rows_t, rows_p = h[-1:], torch.tensor(out, device=dev), torch.tensor([n], device=dev)
    accepted = []
    while len(out) < new:
        before = kv.length
        draft = head.draft(rows_h, rows_t, rows_p, k, kv)
        kv.truncate(before + rows_t.shape[0])  # the drafted rows carry the head's own states: recomputed below
        start = cache.length
        logits, h = forward(model, torch.cat((torch.tensor(out[-1:], device=dev), draft)), cache, head.features)
        top = logits.argmax(-1)
        a = int((top[:k] == draft).long().cumprod(0).sum())
        kept = draft[:a].tolist() + [int(top[a])]
        cache.truncate(start + 1 + a)  # the last token and the accepted drafts; the bonus is fed next round
        accepted.append(a)
        out += kept
        rows_h, rows_t = h[:a + 1], torch.tensor(kept, device=dev)
        rows_p = torch.arange(start + 1, start + 2 + a, device=dev)
    return out[:new], accepted


@torch.no_grad()
def step_costs(model, head, context: int, k: int) -> dict:
    """Graphed device ms of a target step, a verify pass of k + 1 tokens and a head step at ``context``."""
    dev = model.device
    tokens = torch.randint(0, model.cfg.vocab_size, (context + k + 1,), device=dev)
    cache = model.new_cache(context + k + 1)
    forward(model, tokens[:context], cache, head.features)
    # a chained step's input (the step before's output: d values, no fusion of the target's streams)
    h = torch.randn(1, model.cfg.hidden, device=dev, dtype=model.dtype)
    kv = head.new_cache(context + 1)
    kv.length = context  # rows past the prompt are never read back: only the shapes matter for timing

    def target(width):
        def fn():
            cache.length = context
            forward(model, tokens[context:context + width], cache, head.features)
        return fn

    pos = torch.tensor([context], device=dev)

    def head_step():
        kv.length = context
        head.step(h, tokens[:1], pos, kv)

    ms = lambda fn: time_graph([fn], reps=50) / 1e3
    return {"target_ms": ms(target(1)), "verify_ms": ms(target(k + 1)), "head_ms": ms(head_step)}


def prompts(tok: Tokenizer, context: int, n: int, held_out: float, seed: int) -> dict[str, list[int]]:
    """``n`` held-out files (each cut to ``context`` tokens, the shortest skipped) and the review prompt."""
    _, held = split_files(python_sources(), held_out, seed)
    out = {}
    for f in held:
        ids = tok.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= context:
            out[f"{f.parent.name}/{f.name}"] = ids[:context]
        if len(out) == n:
            break
    out["review_prompt"] = review_prompt(tok, context, INSTRUCTION)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target GGUF (registered name or path)")
    ap.add_argument("--head", required=True, help="the MTP head GGUF trained for it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=3, help="held-out files (the review prompt is added)")
    train = OmegaConf.load(Path(conf.__file__).parent / "train_mtp.yaml")  # the training's split, by default
    ap.add_argument("--held-out", type=float, default=train.held_out, help="the corpus split's held-out fraction")
    ap.add_argument("--seed", type=int, default=train.seed, help="the corpus split's seed (the head's training seed)")
    ap.add_argument("--out", type=Path, default=Path("results/mtp"))
    a = ap.parse_args(argv)
    path = resolve_model(a.target)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    model = load_model(reader, getattr(torch, a.dtype), a.device)
    head, meta = load_head(a.head, model, sha256_file(path))
    a.out.mkdir(parents=True, exist_ok=True)
    rounds, summary = [], []
    for name, ids in prompts(tok, a.context, a.prompts, a.held_out, a.seed).items():
        plain = plain_greedy(model, ids, a.new_tokens)
        spec, acc = mtp_greedy(model, head, ids, a.new_tokens, a.k)
        diverge = next((i for i, (x, y) in enumerate(zip(spec, plain)) if x != y), None)
        if diverge is not None and model.dtype == torch.float32:
            raise AssertionError(f"{name}: greedy output with the head differs from plain decoding at token {diverge}")
        rounds += [{"prompt": name, "context": len(ids), "round": i, "drafted": a.k, "accepted": x} for i, x in enumerate(acc)]
        s = pd.Series(acc)
        # in bf16 / fp16 a verify pass of k + 1 rows rounds differently from one-row steps: a near-tie
        # may then flip, and the two decodes part (recorded; fp32 must match exactly)
        summary.append({"prompt": name, "rounds": len(acc), "tokens_per_round": 1 + s.mean(),
                        "same_as_plain_until": len(plain) if diverge is None else diverge,
                        **{f"accept_{j}": float((s >= j).mean()) for j in range(1, a.k + 1)}})
        print(f"{name:>28}: {1 + s.mean():.2f} tokens per round over {len(acc)} rounds; "
              + " ".join(f"{summary[-1][f'accept_{j}']:.2f}" for j in range(1, a.k + 1)))
    prov = {**provenance(), "head_sha256": sha256_file(Path(a.head)), "tokens_seen": meta.get("train.tokens_seen")}
    pd.DataFrame(rounds).assign(**prov).to_csv(a.out / "rounds.csv", index=False)
    table = pd.DataFrame(summary)
    table.assign(**prov).to_csv(a.out / "acceptance.csv", index=False)
    if torch.device(a.device).type == "cuda":
        cost = step_costs(model, head, a.context, a.k)
        tpr = float(table["tokens_per_round"].mean())
        cost |= {"k": a.k, "context": a.context, "tokens_per_round": tpr,
                 "projected_speedup": tpr * cost["target_ms"] / (cost["verify_ms"] + a.k * cost["head_ms"])}
        pd.DataFrame([{**cost, **prov}]).to_csv(a.out / "step_cost.csv", index=False)
        print(f"graphed: target step {cost['target_ms']:.3f} ms, verify of {a.k + 1} {cost['verify_ms']:.3f} ms, "
              f"head step {cost['head_ms']:.3f} ms: projected {cost['projected_speedup']:.2f}x")


if __name__ == "__main__":
    main()
