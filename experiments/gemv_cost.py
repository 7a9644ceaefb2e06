"""What ``model.gemv`` costs in quality (issue #32, goal 3): the decode passes' next-token
distributions with the layers' single-row matmuls by ``kernels/gemv.py`` against cuBLAS's, on the
same tokens, and greedy output against HF transformers.

Perplexity runs (``kvstream-ppl``) prefill many rows per pass, which never take the single-row
path, so this measures decode passes. Two models load from one GGUF, gemv off and on, in the same
dtype with the same cache (``--cache``, default paged ``resident`` with q8_0 K / q4_0 V pages), the
matrices in ``--weights`` (the on arm) and ``--base-weights`` (the off arm; default the same blocks
multiplied exactly: ``q8_0`` for ``q8_0_int8``, whose decode rows on the CPU run the int8 kernel's
arithmetic, ``kvstream/model/weights.py``):

1. teacher forcing: a prompt of P = ``--prompt-tokens`` tokens of the built-in text (the
   standard-library sources ``kvstream-ppl`` reads), then its next T = ``--tokens`` tokens fed one
   per decode pass, or ``--width`` per pass (a verify batch's shape: ``kernels/gemv_mma.py``) (CUDA
   graphs on CUDA, as the engine runs them). At each position: KL(off || on)
   (fp64 log_softmax of the fp32 logits), same top-1, whether the logits are bit-identical, and
   the NLL of the text's next token in each arm: PPL off and on over the T positions, their ratio;
2. free greedy decoding of N = ``--new-tokens`` after the prompt in each arm (``run_decode``, the
   engine's own path, EOS ignored) and, with ``--transformers``, by transformers loading the same
   GGUF: the first index where two token streams differ (empty: equal). A quantized KV cache
   differs from transformers' by itself: ``--cache contiguous`` compares the matmuls alone.

    python -m experiments.gemv_cost --model <1.5B gguf> --device cuda --dtype bfloat16 --prompt-tokens 4096 \\
        --tokens 512 --new-tokens 256 --transformers --out results/kernels/gemv/quality
    python -m experiments.gemv_cost --model <tiny gguf> --prompt-tokens 64 --tokens 8 --new-tokens 8 \\
        --cache contiguous --transformers --out /tmp/gemv_cost          # CPU, fp32: tests/test_gemv_cost.py

On CPU ``model.gemv`` changes nothing for dense or q8_0 weights, so both arms run the same code: the check there is the
plumbing (KLD exactly 0, every logit identical, equal greedy tokens) and the tokens against
transformers. Writes ``<out>/quality.csv`` (one row) and prints it.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from experiments.common import git_state, kld_summary
from kvstream.cache.factory import make_cache
from kvstream.cli import errors
from kvstream.config import ArenaConfig, CacheConfig, GenerateConfig, Hardware, ModelSource
from kvstream.engine.generate import prefill_phase
from kvstream.engine.graphs import GraphedModel
from kvstream.engine.runner import run_decode
from kvstream.eval.perplexity import KldResult, ppl_estimate, stdlib_text
from kvstream.model.loader import is_skeleton, open_gguf, read_config
from kvstream.model.qwen import load_model
from kvstream.model.registry import MODELS, resolve_model, sha256_file
from kvstream.model.tokenizer import Tokenizer
from kvstream.model.weights import WEIGHT_FORMATS

PROG = "gemv_cost"


@torch.inference_mode()
def teacher_forced(model, cfg: GenerateConfig, ids: list[int], n_prompt: int, width: int = 1) -> torch.Tensor:
    """fp32 logits [T, vocab] on the host: the prompt ``ids[:n_prompt]`` prefilled, then decode passes of
    ``width`` tokens of ``ids[n_prompt:-1]`` (a verify batch's shape when > 1), each row predicting the
    token after it."""
    cache = make_cache(cfg.cache, cfg.arena, model, len(ids) - 1, cfg.prefill_chunk, verify_width=width)
    prefill_phase(model, cache, ids[:n_prompt], cfg.prefill_chunk)
    step = GraphedModel(model) if model.device.type == "cuda" else model
    feed = torch.tensor(ids[n_prompt:-1], dtype=torch.long, device=model.device)
    passes = range(0, len(feed), width)
    rows = [step(feed[j:j + width], cache, True) for j in tqdm(passes, desc=f"forced gemv={model.gemv}")]
    return torch.cat(rows).float().cpu()


def greedy(model, cfg: GenerateConfig, tok: Tokenizer, prompt: list[int]) -> list[int]:
    with tqdm(total=cfg.max_new_tokens, desc=f"greedy gemv={model.gemv}") as bar:
        return run_decode(cfg, model, tok, prompt, on_token=lambda _: bar.update()).generation.tokens


@torch.inference_mode()
def transformers_greedy(path: Path, prompt: list[int], n: int, hw: Hardware) -> list[int]:
    """Greedy tokens of transformers on the same GGUF (dequantized to ``hw``'s dtype), EOS not stopping."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=hw.torch_dtype)
    hf = hf.to(hw.device).eval()
    out = hf.generate(torch.tensor([prompt], device=hw.device), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where two token streams differ (one ending early counts), None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def compare(off: torch.Tensor, on: torch.Tensor, targets: torch.Tensor) -> dict:
    """Per position KL(off || on), same top-1 and each arm's NLL of ``targets``, summarised."""
    lp_off, lp_on = torch.log_softmax(off.double(), -1), torch.log_softmax(on.double(), -1)
    p = lp_off.exp()
    kld = torch.where(p > 0, p * (lp_off - lp_on), 0.0).sum(-1)
    nll_off, nll_on = (-lp.gather(1, targets[:, None])[:, 0].numpy() for lp in (lp_off, lp_on))
    same = (lp_off.argmax(-1) == lp_on.argmax(-1)).numpy()
    stats = KldResult(kld.numpy(), same, nll_off, "gemv off", "float32").stats(nll_on)
    return dict(ppl_off=stats["ppl_base"], ppl_on=ppl_estimate(nll_on)[0], **kld_summary(stats),
                identical_logits=float((off == on).all(-1).double().mean()))


def run(args) -> dict:
    for flag, v in (("--prompt-tokens", args.prompt_tokens), ("--tokens", args.tokens), ("--new-tokens", args.new_tokens)):
        if v < 1:
            raise ValueError(f"{flag}={v}: give a number of tokens >= 1")
    if not 1 <= args.width <= 16:
        raise ValueError(f"--width={args.width}: a decode pass of 1 to 16 tokens")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}, but this torch build sees no CUDA device: use --device cpu")
    hw = Hardware(args.device, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    cache = CacheConfig(mode=args.cache, type_k=args.type_k, type_v=args.type_v)
    path = resolve_model(args.model)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    P, T, N = args.prompt_tokens, args.tokens, args.new_tokens
    limit = read_config(reader)
    if P + max(T, N) > limit.context_length:
        raise ValueError(f"{P} prompt tokens + {max(T, N)} exceed the model's context of {limit.context_limit}")
    ids = tok.encode(stdlib_text())[:P + T + 1]  # the prompt, the T tokens fed, the last one's target
    if len(ids) < P + T + 1:
        raise ValueError(f"--prompt-tokens {P} + --tokens {T} + 1 = {P + T + 1} tokens, the built-in text has {len(ids)}")
    if tok.add_bos and tok.bos_id is not None:
        ids[0] = tok.bos_id  # as kvstream-ppl's chunks

    logits, tokens = {}, {}
    formats = {False: args.base_weights or ("q8_0" if args.weights == "q8_0_int8" else args.weights),
               True: args.weights}
    for gemv in (False, True):
        src = ModelSource(str(path), weights=formats[gemv], gemv=gemv)
        cfg = GenerateConfig(model=src, hardware=hw, cache=cache, arena=ArenaConfig("auto"), max_new_tokens=N,
                             ignore_eos=True)
        model = load_model(reader, hw.torch_dtype, hw.device, weights=formats[gemv], gemv=gemv)
        logits[gemv] = teacher_forced(model, cfg, ids, P, args.width)
        tokens[gemv] = greedy(model, cfg, tok, ids[:P])
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    hf = transformers_greedy(path, ids[:P], N, hw) if args.transformers else None

    paged = cache.mode != "contiguous"
    commit, dirty = git_state()
    row = dict(model=str(path), model_sha256=MODELS[args.model].sha256 if args.model in MODELS else sha256_file(path),
               random_weights=is_skeleton(reader), device=args.device,
               device_name=torch.cuda.get_device_name(hw.device) if hw.device.startswith("cuda")
               else platform.processor() or platform.machine(),
               dtype=hw.dtype, weights_off=formats[False], weights_on=formats[True], cache=cache.mode, type_k=cache.type_k if paged else None,
               type_v=cache.type_v if paged else None, prompt_tokens=P, tokens=T, width=args.width, new_tokens=N,
               **compare(logits[False], logits[True], torch.tensor(ids[P + 1:])),
               first_diff_on_off=first_diff(tokens[True], tokens[False]),
               first_diff_off_hf=first_diff(tokens[False], hf) if hf is not None else None,
               first_diff_on_hf=first_diff(tokens[True], hf) if hf is not None else None,
               transformers=args.transformers, torch=torch.__version__, commit=commit, dirty=dirty,
               command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([row]).to_csv(out / "quality.csv", index=False)
    print(pd.DataFrame([row]).drop(columns=["command", "model_sha256"]).T.to_string(header=False))
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a registered name or a GGUF path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32, float16, bfloat16 (default: bfloat16 on CUDA, else float32)")
    ap.add_argument("--cache", default="resident", help="contiguous, resident (paged, default) or stream")
    ap.add_argument("--type-k", default="q8_0")
    ap.add_argument("--type-v", default="q4_0")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512, help="teacher-forced tokens")
    ap.add_argument("--width", type=int, default=1,
                    help="tokens a teacher-forced pass (1: decode steps, kernels/gemv.py; 2-16: verify batches, gemv_mma.py)")
    ap.add_argument("--new-tokens", type=int, default=256, help="greedy tokens")
    ap.add_argument("--transformers", action="store_true", help="greedy tokens of transformers too")
    ap.add_argument("--weights", default="dense", choices=WEIGHT_FORMATS, help="model.weights of the gemv arm")
    ap.add_argument("--base-weights", choices=WEIGHT_FORMATS,
                    help="model.weights of the arm without gemv (default: --weights, q8_0 for q8_0_int8)")
    ap.add_argument("--out", default="results/kernels/gemv/quality")
    args = ap.parse_args(argv)
    try:
        run(args)
    except errors.KNOWN as e:
        errors.fail(PROG, errors.one_line(e))


if __name__ == "__main__":
    main()
