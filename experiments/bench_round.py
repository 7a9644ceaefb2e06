"""What a drafting round costs against its parts: the verify step and k draft steps, each timed
alone, and whole rounds with the host reading each draft token or the round on the device.

    python -m experiments.bench_round --target .models/qwen2.5-coder-1.5b.skeleton.gguf \
        --draft .models/qwen2.5-coder-0.5b.skeleton.gguf --context 4096 --k 4
    python -m experiments.bench_round --target .models/qwen2.5-coder-1.5b.skeleton.gguf --mtp random \
        --draft-vocab 32768 --context 4096 --k 4      # an MTP head (random weights, made for the target)

Random weights at the real shapes (skeleton GGUFs) with synthetic acceptance 1.0 (every draft
token kept, every round k + 1 tokens: times only), resident caches, graphed steps. The parts:
the target's captured 1 + k step and the draft's captured one-token step, replayed alone
(device time by CUDA events, the median of 50 replays each queued behind a device sleep); the rounds: ``run_decode`` with
``engine.device_rounds`` off and on, each round's host wall time (``StepRecord.step_s``). The
goal (issue #28): a device round <= verify + k x draft + 0.15 ms. With ``--mtp`` the draft is
an MTP head (a GGUF, or ``random``: seeded random weights made for the target, with
``--draft-vocab`` rows of its LM head); a round's drafting is then a feed of the k + 1 kept
rows and k - 1 one-row steps, so its parts are verify + feed + (k - 1) x step (a draft model's first
pass catches up two rows at full acceptance: timed too, shown beside its parts, not in them). ``--alpha``
below 1 keeps each draft token with that probability (rounds of varying width, as real acceptance
gives; the parts stay a full round's, a narrower feed costing a little less), ``--alpha real`` lets
the target verify (with real weights and ``--prompt review``, the studies' prompt: real acceptance),
``--cache stream`` runs the studies' cache mode, ``--gemv`` ``model.gemv``; ``--reps N`` measures the rounds
and then their parts N times (the parts moved by up to 0.1 ms between runs of one lease; the report gives
each arm's medians and the excess's range). Writes
``<out>/round_<context>_k<k>[_mtp][_a<alpha>][_stream][_review][_gemv].csv`` (one row per arm, with the
command and provenance).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from experiments.common import provenance, review_prompt
from kvstream.config import (ArenaConfig, CacheConfig, DraftConfig, EngineConfig, GenerateConfig, Hardware, ModelSource,
                             MTPConfig, SpecConfig)
from kvstream.engine.graphs import GraphedModel
from kvstream.engine.runner import run_decode
from kvstream.model.loader import open_gguf
from kvstream.model.qwen import load_model
from kvstream.model.tokenizer import Tokenizer
from kvstream.model.weights import WEIGHT_FORMATS


SLEEP_CYCLES = 2_000_000  # ~1 ms of the H200's clock: longer than the host takes to stage and launch one step


def step_ms(graphed, cache, width: int, reps: int = 50, hidden: bool = False, all_logits: bool | None = None) -> float:
    """One captured step of ``width`` tokens at the cache's end: its device time in ms (CUDA events),
    the median of ``reps`` replays, each queued behind a ~1 ms device sleep so that the host's part
    (``cache.begin``'s staging, the launch: 0.1-0.3 ms) falls inside the sleep. Replays queued back to
    back measured the host instead wherever a step is shorter than that: an MTP head's one-row step read
    0.149 and 0.329 ms in two leases (results/round). ``all_logits`` (default: ``width > 1``, a verify's
    and a head's feed): every row's logits, else the last row's (a draft model's catch-up)."""
    n, tokens = cache.length, torch.randint(0, graphed.cfg.vocab_size, (width,), device="cuda")
    every = width > 1 if all_logits is None else all_logits

    def call():
        graphed(tokens, cache, every, hidden)
        cache.truncate(n)
    for _ in range(3):  # capture, warm
        call()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def report(paths: list[str]) -> str:
    """A markdown table of bench_round CSVs: per file and arm, the round against its parts."""
    lines = ["| file (code) | draft | arm | round | parts | excess | excess over its own parts | draft part | tok/s |",
             "|---" * 9 + "|"]
    for p in paths:
        d = pd.read_csv(p)
        mtp = "--mtp" in d.command[0]
        if d.get("rep", pd.Series([0])).nunique() > 1:  # several reps: each arm's medians, the excess's range
            lo, hi = d.groupby("arm").excess_ms.min(), d.groupby("arm").excess_ms.max()
            d = d.groupby("arm", sort=False).median(numeric_only=True).reset_index().assign(
                git_commit=d.git_commit[0], command=d.command[0],
                arm=lambda m: [f"{a}, median of {d.rep.nunique()} reps (excess {lo[a]:+.3f} to {hi[a]:+.3f})"
                               for a in m.arm], k=lambda m: m.k.astype(int))
        for r in d.itertuples():
            parts = (f"{r.verify_ms:.3f} + {r.feed_ms:.3f} + {r.k - 1} x {r.draft_step_ms:.3f}" if mtp else
                     f"{r.verify_ms:.3f} + {r.k} x {r.draft_step_ms:.3f}")
            no_feed = mtp or pd.isna(getattr(r, "feed_ms", None))  # (draft CSVs before the catch-up's timing have none)
            catch_up = "" if no_feed else f" (its 2-row catch-up: {r.feed_ms:.3f} ms)"
            # the draft model's round as it runs: its first pass the catch-up, then k - 1 one-row steps
            own = r.excess_ms if mtp else float("nan") if no_feed else \
                r.round_ms - (r.verify_ms + r.feed_ms + (r.k - 1) * r.draft_step_ms)
            lines.append(f"| `{Path(p).name}` ({str(r.git_commit)[:7]}) | {'MTP head' if mtp else 'draft model'}, k = {r.k} | "
                         f"{r.arm} | {r.round_ms:.3f} ms | {parts} = {r.parts_ms:.3f} ms{catch_up} | {r.excess_ms:+.3f} ms | "
                         f"{own:+.3f} ms | {r.draft_ms:.3f} ms | {r.tok_s:.0f} |")
    return "\n".join(lines)


def parts(args, base, model, tok, prompt) -> tuple[float, float, float, float]:
    """(verify, feed, draft step, their round's sum) in ms: the target's captured 1 + k step and the
    drafter's steps, each replayed alone after a short decode that pins the drafter. The feed is an MTP
    head's pass of the k + 1 kept rows (in the sum), or a draft model's two-row catch-up (not in it)."""
    cfg = replace(base, engine=EngineConfig(device_rounds=True), max_new_tokens=8)
    res = run_decode(cfg, model, tok, prompt)
    verify = step_ms(GraphedModel(model), res.cache, 1 + args.k)
    if args.mtp:  # the head's feed of the k + 1 kept rows, then k - 1 one-row steps
        # (both timed on the target's states: for a head that fuses several streams the one-row step
        # includes its fc, which a chained step skips; an upper bound)
        head = res.chain.get("mtp")
        feed, draft_step = (step_ms(head.step, head.cache, w, hidden=True) for w in (1 + args.k, 1))
        return verify, feed, draft_step, verify + feed + (args.k - 1) * draft_step
    draft = res.chain.get("draft")
    # the parts count k one-row steps (#28's formula); a round's first pass catches up 2 rows at full
    # acceptance (the last draft and the target's token): timed too, outside the sum, to tell that share
    draft_step, feed = (step_ms(draft.model, draft.cache, w, all_logits=False) for w in (1, 2))
    return verify, feed, draft_step, verify + args.k * draft_step


def random_head(args, model) -> str:
    """A head of seeded random weights for ``args.target`` (its sha256), written to a temporary
    folder (50-100 MB: never beside the results)."""
    from kvstream.model.mtp import MTPHead
    from kvstream.model.mtp_gguf import write_head
    from kvstream.model.registry import sha256_file

    V, gen = model.cfg.vocab_size, torch.Generator().manual_seed(0)
    d2t = torch.randperm(V, generator=gen)[:args.draft_vocab].sort().values if args.draft_vocab else None
    path = Path(tempfile.mkdtemp(prefix="bench_round_")) / "random_head.gguf"
    write_head(path, MTPHead(model, d2t=d2t, seed=0), sha256_file(args.target),
               {"command": "experiments.bench_round --mtp random", "tokens_seen": 0}, "f16")
    return str(path)


def round_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The decode's options (``round_config``) and ``--out``."""
    ap.add_argument("--target", help="the target's GGUF")
    ap.add_argument("--draft", help="the draft model's GGUF")
    ap.add_argument("--mtp", help="an MTP head's GGUF, or 'random' (seeded random weights for the target)")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="--mtp random: LM-head rows (0: all)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--new", type=int, default=400, help="tokens decoded per arm")
    ap.add_argument("--alpha", type=acceptance, default=1.0,
                    help="synthetic acceptance: each draft token kept with this probability (1: every round k + 1 "
                         "tokens); 'real': the target verifies (real weights: with --prompt review)")
    ap.add_argument("--prompt", default="random", choices=["random", "review"],
                    help="seeded random tokens, or the studies' review prompt (stdlib code, then an instruction)")
    ap.add_argument("--cache", default="resident", choices=["resident", "stream"],
                    help="the target's cache mode (stream: the studies' setting; with arena auto nothing streams)")
    ap.add_argument("--gemv", action="store_true",
                    help="model.gemv: the target's (and its drafter's) decode rows by kernels/gemv.py, gemv_mma.py")
    ap.add_argument("--weights", default="dense", choices=WEIGHT_FORMATS, help="model.weights: the target's matrices")
    ap.add_argument("--draft-weights", default="dense", choices=WEIGHT_FORMATS,
                    help="spec.draft.weights: the draft model's matrices")
    ap.add_argument("--out", default="results/round")
    return ap


INSTRUCTION = "Write pytest unit tests for the code above."  # --prompt review: the MTP studies' (results/mtp_h200_k_1.5b)


def acceptance(text: str) -> float | None:
    """``--alpha``: a probability, or 'real' (None: the target verifies)."""
    if text == "real":
        return None
    a = float(text)
    if not 0.0 <= a <= 1.0:
        raise argparse.ArgumentTypeError(f"{a}: a probability in [0, 1], or 'real'")
    return a


def tag(args) -> str:
    """A run's file-name part: context, k, the drafter, and the options off their defaults."""
    alpha = "" if args.alpha == 1 else "_areal" if args.alpha is None else f"_a{args.alpha:g}"
    return (f"{args.context}_k{args.k}{'_mtp' if args.mtp else ''}{alpha}" + ("_stream" if args.cache != "resident" else "")
            + ("_review" if args.prompt != "random" else "") + ("_gemv" if args.gemv else "")
            + ("" if args.weights == "dense" else f"_{args.weights}")
            + ("" if args.draft_weights == "dense" or args.mtp else f"_draft_{args.draft_weights}"))


def write_csv(df: pd.DataFrame, args, kind: str) -> Path:
    """``df`` as ``<args.out>/<kind>_<tag>.csv``; returns the path."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = out / f"{kind}_{tag(args)}.csv"
    df.to_csv(name, index=False)
    return name


def round_config(args, model) -> GenerateConfig:
    """The decode both arms run: ``args.k`` draft tokens a round from ``--draft`` or ``--mtp``,
    synthetic acceptance ``args.alpha``, an ``args.cache`` target cache in an automatic arena,
    ``args.new`` tokens."""
    if args.mtp:
        spec = SpecConfig(type="mtp", n_max=args.k, synthetic_acceptance=args.alpha,
                          mtp=MTPConfig(source=random_head(args, model) if args.mtp == "random" else args.mtp))
    else:
        spec = SpecConfig(type="draft", n_max=args.k, synthetic_acceptance=args.alpha,
                          draft=DraftConfig(source=args.draft, p_min=0.0, weights=args.draft_weights))
    return GenerateConfig(model=ModelSource(args.target, weights=args.weights, gemv=args.gemv),
                          hardware=Hardware("cuda", "bfloat16"),
                          cache=CacheConfig(mode=args.cache), arena=ArenaConfig("auto"), max_new_tokens=args.new,
                          ignore_eos=True, spec=spec)


def load_round(ap: argparse.ArgumentParser, args, tool: str):
    """(target on CUDA in bf16, its tokenizer, a prompt of ``args.context`` tokens: seeded random, or
    ``--prompt review``),
    after checking the options (one drafter) and that there is a GPU."""
    if args.target is None or (args.draft is None) == (args.mtp is None):
        ap.error("give one of --draft (a draft model) or --mtp (an MTP head)")
    if "q8_0_int8" in (args.weights, args.draft_weights) and not args.gemv:
        ap.error("q8_0_int8 weights multiply decode rows in int8 in model.gemv's kernel: add --gemv")
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} CUDA graphs and device rounds: it needs a GPU")
    reader = open_gguf(args.target)
    model, tok = load_model(reader, torch.bfloat16, "cuda", args.weights, args.gemv), Tokenizer.from_gguf(reader)
    if args.prompt == "review":
        return model, tok, review_prompt(tok, args.context, INSTRUCTION)
    prompt = torch.randint(0, model.cfg.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, tok, prompt


def main(argv=None) -> None:
    ap = round_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    ap.add_argument("--reps", type=int, default=1,
                    help="times the rounds and then their parts are measured, one after the other (the report: medians)")
    ap.add_argument("--report", nargs="+", metavar="CSV", help="print the table of written CSVs (no GPU)")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    model, tok, prompt = load_round(ap, args, "bench_round times")
    base = round_config(args, model)
    frames = []
    for rep in range(args.reps):  # rounds and their parts measured again each rep, one after the other
        rows = []
        for device_rounds in (False, True, False, True):  # twice each, interleaved: the second pair is reported
            cfg = replace(base, engine=EngineConfig(device_rounds=device_rounds))
            res = run_decode(cfg, model, tok, prompt)
            rec = [r for r in res.generation.records if r.verify_width == 1 + args.k][5:]  # past the first rounds
            rows.append({"arm": "device" if device_rounds else "host", "rounds": len(rec),
                         "round_ms": 1e3 * pd.Series([r.step_s for r in rec]).median(),
                         "draft_ms": 1e3 * pd.Series([r.draft_s for r in rec]).median(),
                         "tok_s": res.generation.stats.decode_tok_s})
            del res
        verify, feed, draft_step, floor = parts(args, base, model, tok, prompt)
        frames.append(pd.DataFrame(rows[2:]).assign(rep=rep, verify_ms=verify, feed_ms=feed, draft_step_ms=draft_step,
                                                    parts_ms=floor, excess_ms=lambda d: d.round_ms - floor))
    df = pd.concat(frames, ignore_index=True).assign(
        context=args.context, k=args.k, command=" ".join(["python -m experiments.bench_round", *sys.argv[1:]]),
        **provenance())
    name = write_csv(df, args, "round")
    print(report([str(name)]))
    print(f"wrote {name}")


if __name__ == "__main__":
    main()
