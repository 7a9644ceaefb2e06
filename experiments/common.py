"""Helpers that several experiments share: where a result came from, the review prompt and
model loading, a study figure's title, and the timing tools of the GPU benchmarks.

``KVSTREAM_GIT_COMMIT`` names the commit of a copied checkout whose git metadata is missing or
stale (a remote GPU machine's copy of the tree): the tree is then taken to be that commit, clean.
"""
from __future__ import annotations

import datetime
import io
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
from hydra import compose, initialize_config_module

from kernels.formats import PageFormat
from kvstream.cli.ppl import PplConfig, run
from kvstream.config import (ArenaConfig, CacheConfig, EngineConfig, GenerateConfig, Hardware, ModelSource, quote_free_text,
                             to_typed)
from kvstream.engine.runner import DRAFT_HOSTS
from kvstream.eval.perplexity import stdlib_text
from kvstream.model.loader import ModelConfig, open_gguf
from kvstream.model.qwen import load_model
from kvstream.model.registry import MODELS, resolve_model, sha256_file
from kvstream.model.tokenizer import Tokenizer

# ---- provenance ------------------------------------------------------------------------


def git_state(*paths: str) -> tuple[str, bool]:
    """(commit, dirty), dirty meaning uncommitted changes (under ``paths`` if given)."""
    named = os.environ.get("KVSTREAM_GIT_COMMIT")
    if named:
        return named, False

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "HEAD")
    return commit or "unknown", not commit or bool(git("status", "--porcelain", *paths))


# what a row's numbers depend on besides its resolved config; conf/ is not among them: a row's run id is
# its resolved config's hash, so a conf change that matters changes the id (a comment does not)
CODE = ("kvstream", "kernels", "policies", "experiments", "pyproject.toml")


def same_code(commit: str) -> bool:
    """Whether this checkout runs the code of ``commit``: a clean tree whose code paths are
    ``commit``'s (a later commit that only adds results or docs is the same code)."""
    head, dirty = git_state()
    if dirty or head == "unknown":
        return False
    try:
        return subprocess.run(["git", "diff", "--quiet", commit, head, "--", *CODE], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def provenance() -> dict:
    """Commit, dirty flag, device and versions, as columns of a result row."""
    commit, dirty = git_state()
    return {"git_commit": commit, "git_dirty": dirty,
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}


def kernel_provenance() -> dict:
    """The kernel benchmarks' columns: GPU, versions, commit (dirty: under kernels/ or experiments/),
    date and command line."""
    commit, dirty = git_state("kernels", "experiments")
    return dict(gpu=torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
                torch=torch.__version__, triton=triton.__version__, commit=commit, dirty=dirty,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                command="python " + " ".join(sys.argv))


# ---- prompt and models -----------------------------------------------------------------

INSTRUCTION = "Review the code above: point out bugs, unclear names and missing tests."


def review_prompt(tok: Tokenizer, n_tokens: int, instruction: str) -> list[int]:
    """Exactly ``n_tokens`` tokens: chat template around source code cut to fit + the instruction."""
    marker = "\x00CODE\x00"
    pre, post = tok.apply_chat_template([{"role": "user", "content": marker + "\n\n" + instruction}],
                                        add_generation_prompt=True).split(marker)
    head, tail = tok.encode(pre), tok.encode(post)
    room = n_tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"context={n_tokens} tokens leaves no room for code ({len(head) + len(tail)} go to the "
                         "chat template and the instruction)")
    code = _source_tokens(tok)
    code = (code * (room // len(code) + 1))[:room]  # long contexts wrap around the text
    return head + code + tail


_SOURCE: dict = {}  # id(tokenizer) -> token ids of the source text: tokenized once per process


def _source_tokens(tok: Tokenizer) -> list[int]:
    if id(tok) not in _SOURCE:
        _SOURCE[id(tok)] = tok.encode(stdlib_text())
    return _SOURCE[id(tok)]


_TARGETS: dict = {}  # (source, rope and weight options, dtype, device) -> (model, tokenizer, sha256): one load per sweep process


def load_target(cfg: GenerateConfig):
    """(model, tokenizer, GGUF sha256) of ``cfg.model`` on ``cfg.hardware``, loaded once per process."""
    key = (cfg.model.source, *cfg.model.load.values(), cfg.hardware.dtype, cfg.hardware.device)
    if key not in _TARGETS:
        path = resolve_model(cfg.model.source)
        reader = open_gguf(path)
        sha = MODELS[cfg.model.source].sha256 if cfg.model.source in MODELS else sha256_file(path)
        model = load_model(reader, cfg.hardware.torch_dtype, cfg.hardware.device, **cfg.model.load)
        _TARGETS[key] = (model, Tokenizer.from_gguf(reader), sha)
        if cfg.spec.draft.source == cfg.model.source and model.device.type == "cpu" and not any(cfg.model.rope.values()) \
                and cfg.model.weights == "dense":
            # a model drafting for itself on the CPU: the draft's host weights are these (it pins copies), not a
            # second load of the same file
            DRAFT_HOSTS.setdefault((cfg.spec.draft.source, str(model.dtype), str(model.device))
                                   + ((("gemv", True),) if model.gemv else ()), model)  # get_host's key
    return _TARGETS[key]


def kvstream_config(device, mode, new, graphs=True, weights="dense", gemv=False):
    """A run of ``new`` tokens (EOS ignored, default sampling: greedy) in cache ``mode``, arena sized
    automatically, the model's matrices ``weights`` (dense or q8_0), their decode rows by
    ``kernels/gemv.py`` when ``gemv``."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return GenerateConfig(model=ModelSource(weights=weights, gemv=gemv), hardware=Hardware(device, dtype), cache=CacheConfig(mode=mode),
                          arena=ArenaConfig("auto"),
                          max_new_tokens=new, ignore_eos=True, engine=EngineConfig(cuda_graphs=graphs))


_BY_PATH: dict = {}  # (path, weight format, gemv) -> (model, tokenizer): the kvstream arms share one load


def kvstream_model(path, cfg):
    """(model, tokenizer) of the GGUF at ``path`` with ``cfg``'s weight format, loaded once per process."""
    key = (path, cfg.model.weights, cfg.model.gemv)
    if key not in _BY_PATH:
        reader = open_gguf(path)
        model = load_model(reader, cfg.hardware.torch_dtype, cfg.hardware.device, weights=cfg.model.weights,
                           gemv=cfg.model.gemv)
        _BY_PATH[key] = model, Tokenizer.from_gguf(reader)
    return _BY_PATH[key]


# ---- study figures ---------------------------------------------------------------------


def _values(runs, column) -> str:
    return ", ".join(str(v) for v in runs[column].dropna().unique()) if column in runs else ""


def title(runs) -> str:
    """Model, draft and device from runs.csv; synthetic acceptance named, since such runs measure no real draft."""
    model, draft, device = (_values(runs, c) for c in ("model", "draft_model", "device"))
    short = lambda v: ", ".join(Path(x).name.removesuffix(".gguf") for x in v.split(", ")) if v else v
    model, draft = short(model), short(draft)
    if "spec_type" in runs:  # a run's draft model column holds the config's default whatever it drafted with
        types = {t for v in runs["spec_type"].dropna().astype(str) for t in v.split(",")}
        draft = ", ".join(([draft] if draft and "draft" in types else []) + (["MTP head"] if "mtp" in types else []))
    if "random_weights" in runs and runs["random_weights"].astype(str).eq("True").any():
        model += " (random weights)"
    if "device_name" in runs and runs["device_name"].notna().any():
        device = runs["device_name"].dropna().iloc[0]
    t = "decode tok/s vs context" + (f": {model}" if model else "") + (f" + draft {draft}" if draft else "")
    t += f" on {device}" if device else ""
    alpha = _values(runs, "synthetic_acceptance")
    return t + (f"\nsynthetic acceptance α={alpha}" if alpha else "")


# ---- GPU timing ------------------------------------------------------------------------

QWEN15 = ModelConfig(arch="qwen2", n_layers=28, hidden=1536, n_heads=12, n_kv_heads=2, head_dim=128, ffn=8960,
                     vocab_size=151936, rope_base=1e6, rms_eps=1e-6, context_length=131072, tied_output=True)
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
ROTATE_BYTES = 512 * 2**20  # working set per graph, several times the L2
MAX_SETS = 256


def pinned_ceiling(device) -> float:
    """GB/s of one 1 GiB pinned host -> device copy (median of 5)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return src.numel() / statistics.median(times[1:]) / 1e9


def time_graph(calls, reps: int = 20) -> float:
    """Median microseconds per call: all calls captured in one CUDA graph, replayed. Off CUDA (the
    interpreter: a smoke run, its times mean nothing) each call runs once."""
    if not CUDA:
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) / len(calls) * 1e6
    for c in calls:  # compile, allocate
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return float(torch.tensor(times).median())


def time_eager(fn) -> float:
    """Median microseconds of one eager call, L2 flushed before each (do_bench); off CUDA one call."""
    if not CUDA:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def n_sets(bytes_per_set: float) -> int:
    if not CUDA:
        return 1
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(bytes_per_set, 1))))


def random_pool(fmt: PageFormat, n_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Pages of random quants and sane random scales (values within ~±4), never zeros."""
    pool = torch.empty(n_pages, fmt.page_bytes, dtype=torch.uint8, device=DEV)
    if fmt.kv_type.name == "f16":
        pool.view(torch.float16).copy_(torch.randn(n_pages, fmt.page_bytes // 2, device=DEV,
                                                   generator=gen))
        return pool
    pool[:, : fmt.scale_offset] = torch.randint(0, 256, (n_pages, fmt.scale_offset), device=DEV,
                                                dtype=torch.uint8, generator=gen)
    s = pool[:, fmt.scale_offset:].view(torch.float16)
    s.copy_(0.005 + 0.03 * torch.rand(s.shape, device=DEV, generator=gen))
    return pool


def ceilings() -> dict:
    n = (2**30 if CUDA else 2**22)
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    t_copy = time_eager(lambda: dst.copy_(src))
    t_read = time_eager(lambda: src.sum())
    return dict(copy_gbps=2 * n / t_copy / 1e3, read_gbps=n / t_read / 1e3)


_SIZED = {}


def sized_copy_gbps(nbytes: int) -> float:
    """The copy ceiling at one call's size: GB/s (read + write) of device copies that move
    ``nbytes`` each, timed as the kernels are (a CUDA graph of several sets past the L2). A
    kernel moving that many bytes pays the same launch, ramp-up and tail: the 1 GiB ceiling
    hides them, and at 32K one layer's pages are only ~10-30 MB."""
    half = max(16, nbytes // 2 // 16 * 16)
    if half not in _SIZED:
        sets = n_sets(2 * half)
        src = [torch.randint(0, 256, (half,), dtype=torch.uint8, device=DEV) for _ in range(sets)]
        dst = [torch.empty_like(x) for x in src]
        _SIZED[half] = 2 * half / time_graph([(lambda i=i: dst[i].copy_(src[i])) for i in range(sets)]) / 1e3
    return _SIZED[half]


def compiled(fn) -> list:
    """The kernels compiled so far for a @triton.jit function (none under the interpreter)."""
    out = []
    for caches in getattr(fn, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        out += list(getattr(cache, "values", lambda: [])())
    return out


def kv_quant_parser(description: str, out: str) -> "argparse.ArgumentParser":
    """The quantized-KV studies' shared arguments (issue 33: kv_quant_llama, kv_quant_locate): the
    model, the text, llama-perplexity's chunks, where the results go."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--text", default="/usr/lib/python3.11/argparse.py")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--n-chunks", type=int, default=4)
    ap.add_argument("--out", default=out)
    return ap


KLD_SUMMARY = ("ppl_ratio", "kld_mean", "kld_mean_err", "kld_median", "kld_99.9", "kld_max", "same_top1")


def run_ppl(overrides: list[str]) -> dict:
    """One ``kvstream-ppl`` run from its command-line overrides (its summary printed): its result row."""
    quote_free_text(overrides, ())
    with initialize_config_module("conf", version_base=None):
        cfg = to_typed(compose("ppl", overrides=overrides), PplConfig)
    out = io.StringIO()
    row = run(cfg, out)
    print(out.getvalue(), flush=True)
    return row


def kld_summary(stats: dict, ppl_base: bool = False, kld_max: bool = True) -> dict:
    """A run's KLD statistics (``KldResult.stats``, or a ``kvstream-ppl`` row's ``kld``) as result
    columns, in KLD_SUMMARY's order (``kld_99.9`` named ``kld_99_9``), ppl_base first if asked."""
    keys = (("ppl_base",) if ppl_base else ()) + tuple(k for k in KLD_SUMMARY if kld_max or k != "kld_max")
    return {k.replace(".", "_"): stats[k] for k in keys}
