"""Perplexity of a text, and KL divergence against a saved base run, as llama.cpp's llama-perplexity.

The tokens are cut into ``n_chunks`` chunks of ``ctx`` tokens. Each chunk runs through the model
on a fresh cache (``make_cache(ctx)``), prefilled in sub-batches of ``batch`` tokens with all
logits kept. As in llama.cpp, only the second half is scored: with ``first = ctx // 2``, the
logits at positions ``first .. ctx-2`` predict tokens ``first+1 .. ctx-1`` (``ctx - 1 - first``
scored tokens per chunk), so every scored token has at least ``ctx/2`` tokens of context. When
the tokenizer adds a BOS token, the first token of every chunk is replaced by it (llama.cpp too).

    PPL = exp(mean NLL), +/- PPL * sqrt(var(NLL) / (N - 1))          (llama.cpp's estimate)

**Log-prob files** (``save_logits`` / ``compare_logits``). A base run stores, for every scored
position, the full log-softmax over the vocabulary, plus the exact fp32 NLL of each scored token
and the chunk tokens, in one of two formats (``logits_format``):

* ``uint16`` (default; 2 bytes x vocab + 16 per position, ~77 MB per 512-token chunk for a
  151,936-token vocabulary): per row, ``lo = max(min lp, max lp - 32)`` and ``scale =
  (max lp - lo) / 65535`` (float64), and ``code = round((lp - lo) / scale)`` clamped to
  0..65535. Log-probs are kept to a uniform 32/65535 = 4.9e-4; anything below e^-32 of the top
  token (at most vocab x e^-32 ~ 2e-9 of the mass) sits at ``lo``. llama.cpp's format is the
  same idea with a 16 window, whose clamped tail it has to leave out of the KLD sum.
* ``float32`` (twice the size): the fp32 log-probs as computed.

Layout, written chunk by chunk so the base never sits in memory::

    MAGIC, 8-byte little-endian header length, JSON header (padded to 64 bytes)
    tokens   int32 [n_chunks, ctx]
    per chunk: rows [n_scored] of (uint16: lo, scale float64 + codes uint16 [vocab] | float32 [vocab]),
               then NLL float32 [n_scored]

A compare run reads it with ``np.memmap``, one sub-batch at a time. KL(base || run) is computed
after *both* runs' log-probs went through the same codec and were renormalised (``log_softmax``
in fp64): a bit-identical run gives exactly 0, every row is a proper distribution (KLD >= 0),
and the codec's floor is second order, ~ var(rounding) ~ (4.9e-4)^2 / 12 = 2e-8 for uint16
(fp16 log-probs would be ~1e-6 for flat rows, as their step at |lp| in 4..8 is 4e-3; llama.cpp
rounds only the base and measures a floor of ~4e-6). Same top-1 is the share of positions whose
argmaxes agree; PPL(run)/PPL(base) and the difference are estimated from the paired per-token NLLs.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

MAGIC = b"KVSTREAM-LOGPROBS\n"
VERSION = 1
LOGITS_FORMATS = ("uint16", "float32")
WINDOW = 32.0  # uint16 format: log-probs kept within this distance of the row's top
# The built-in text: Python standard-library sources, in this order (~100K Qwen2.5 tokens).
STDLIB_MODULES = ("textwrap", "argparse", "functools", "dataclasses", "json.decoder", "json.encoder",
                  "heapq", "difflib", "fractions", "statistics", "shlex", "contextlib")


class LogprobFileError(ValueError):
    """A log-prob file that cannot be read or does not match the current run."""


def stdlib_text(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The concatenated source of standard-library modules of the running interpreter (offline,
    deterministic for one Python version)."""
    parts = []
    for name in modules:
        try:
            parts.append(inspect.getsource(importlib.import_module(name)))
        except (OSError, TypeError) as e:
            raise RuntimeError(f"the built-in text needs the source of the standard-library module {name!r}, "
                               f"which this Python does not ship ({e}); pass text_file=PATH") from None
    return "\n\n".join(parts)


def split_chunks(tokens: list[int], ctx: int, n_chunks: int | None = None, bos_id: int | None = None) -> torch.Tensor:
    """The first ``n_chunks`` (default: all that fit) whole chunks of ``ctx`` tokens, [n_chunks, ctx]."""
    if ctx < 3:
        raise ValueError(f"ctx must be >= 3 (ctx/2 context tokens and at least one scored token), got {ctx}")
    fit = len(tokens) // ctx
    if fit == 0:
        raise ValueError(f"the text has {len(tokens)} tokens; one chunk needs ctx={ctx}: use a longer text or a smaller ctx")
    if n_chunks is None:
        n_chunks = fit
    elif not 1 <= n_chunks <= fit:
        raise ValueError(f"n_chunks={n_chunks}, but the text's {len(tokens)} tokens hold {fit} chunk(s) of ctx={ctx}")
    chunks = torch.tensor(tokens[:n_chunks * ctx], dtype=torch.long).view(n_chunks, ctx)
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


@torch.inference_mode()
def scored_logprobs(model, cache, chunk: torch.Tensor, batch: int,
                    first: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """Run one chunk [ctx] through ``model`` in sub-batches of ``batch`` tokens; yield ``(row, lp)``
    with ``lp`` the fp32 log-softmax [rows, vocab] of the scored positions ``row ..`` (in
    ``first .. ctx-2``; ``first`` defaults to ``ctx // 2``, the second half)."""
    ctx = chunk.numel()
    first = ctx // 2 if first is None else first
    for lo in range(0, ctx, batch):
        logits = model(chunk[lo:lo + batch], cache, all_logits=True)
        a, b = max(lo, first), min(lo + batch, ctx - 1)
        if a < b:
            yield a, torch.log_softmax(logits[a - lo:b - lo].float(), dim=-1)


def row_bytes(vocab: int, fmt: str) -> int:
    return 16 + 2 * vocab if fmt == "uint16" else 4 * vocab


def encode_logprobs(lp: torch.Tensor, fmt: str) -> torch.Tensor:
    """Log-probs [n, vocab] -> the file's rows, uint8 [n, row_bytes] on ``lp``'s device; see the module doc."""
    if fmt == "float32":
        return lp.float().contiguous().view(torch.uint8)
    hi = lp.max(-1, keepdim=True).values
    lo = torch.maximum(lp.min(-1, keepdim=True).values, hi - WINDOW)
    scale = ((hi - lo) / 65535).clamp_min(1e-30)  # all-equal rows: every code 0
    codes = ((lp - lo) / scale).round_().clamp_(0, 65535).to(torch.int32).to(torch.uint16)
    return torch.cat([torch.cat([lo, scale], 1).double().view(torch.uint8), codes.view(torch.uint8)], 1)


def decode_logprobs(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """The file's rows, uint8 [n, row_bytes] -> log-probs [n, vocab] in fp64 (not renormalised)."""
    if fmt == "float32":
        return rows.contiguous().view(torch.float32).double()
    head = rows[:, :16].contiguous().view(torch.float64)  # lo, scale
    return head[:, :1] + head[:, 1:] * rows[:, 16:].view(torch.uint16).double()


def kld_top1(base_rows: torch.Tensor, lp: torch.Tensor, fmt: str, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(base || run) and whether the argmaxes agree, between a base's file rows
    [n, row_bytes] and this run's log-probs [n, vocab] put through the same codec; both
    renormalised in fp64. ``block`` rows at a time bound the fp64 temporaries."""
    kld, same = [], []
    for i in range(0, lp.shape[0], block):
        lb = torch.log_softmax(decode_logprobs(base_rows[i:i + block], fmt), dim=-1)
        lq = torch.log_softmax(decode_logprobs(encode_logprobs(lp[i:i + block], fmt), fmt), dim=-1)
        p = lb.exp()
        kld.append(torch.where(p > 0, p * (lb - lq), 0.0).sum(-1))
        same.append(lb.argmax(-1) == lq.argmax(-1))
    return torch.cat(kld).cpu(), torch.cat(same).cpu()


def ppl_estimate(nll: np.ndarray) -> tuple[float, float]:
    """(PPL, its standard error) from per-token NLLs, as llama.cpp estimates them."""
    n, mean = len(nll), float(nll.mean())
    var = float((nll ** 2).mean()) - mean * mean
    ppl = math.exp(mean)
    return ppl, (ppl * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else float("nan"))


class LogprobFile:
    """A saved base run: header, tokens, and per-chunk (log-probs, NLL) blocks; see the module doc."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    raise LogprobFileError(f"{self.path}: not a kvstream log-prob file (made by save_logits=PATH)")
                hlen = int.from_bytes(f.read(8), "little")
                self.header = json.loads(f.read(hlen))
        except OSError as e:
            raise LogprobFileError(f"cannot read the base log-probs {self.path}: {e}") from None
        h = self.header
        if h.get("version") != VERSION:
            raise LogprobFileError(f"{self.path}: log-prob file version {h.get('version')}, this kvstream reads {VERSION}")
        self.ctx, self.n_chunks, self.vocab = h["ctx"], h["n_chunks"], h["vocab"]
        self.format = h["format"]
        self.n_scored = self.ctx - 1 - self.ctx // 2
        self.row = row_bytes(self.vocab, self.format)
        self.data_start = len(MAGIC) + 8 + hlen
        self.block = self.n_scored * (self.row + 4)
        size, want = self.path.stat().st_size, self.data_start + 4 * self.n_chunks * self.ctx + self.n_chunks * self.block
        if size != want:
            raise LogprobFileError(f"{self.path}: {size} bytes, but its header ({self.n_chunks} chunks x ctx {self.ctx}, "
                                   f"vocab {self.vocab}, {self.format}) needs {want}: truncated or not written completely")
        self.tokens = torch.from_numpy(np.fromfile(self.path, np.int32, self.n_chunks * self.ctx, offset=self.data_start)
                                       .astype(np.int64)).view(self.n_chunks, self.ctx)

    @staticmethod
    def nbytes(n_chunks: int, ctx: int, vocab: int, fmt: str) -> int:
        return n_chunks * (ctx * 4 + (ctx - 1 - ctx // 2) * (row_bytes(vocab, fmt) + 4))

    def _chunk_offset(self, c: int) -> int:
        return self.data_start + 4 * self.n_chunks * self.ctx + c * self.block

    def rows(self, c: int, lo: int, hi: int) -> torch.Tensor:
        """Chunk ``c``'s stored log-prob rows ``lo:hi`` (of its n_scored), uint8 [hi - lo, row_bytes]."""
        m = np.memmap(self.path, np.uint8, "r", self._chunk_offset(c), (self.n_scored, self.row))
        return torch.from_numpy(np.array(m[lo:hi]))

    def nll(self, c: int) -> np.ndarray:
        off = self._chunk_offset(c) + self.n_scored * self.row
        return np.fromfile(self.path, np.float32, self.n_scored, offset=off).astype(np.float64)

    def check_matches(self, chunks: torch.Tensor, vocab: int) -> None:
        """Refuse a run whose ctx, chunk count, vocabulary or tokens differ from the base's."""
        n, ctx = chunks.shape
        src = self.header.get("text", "?")
        if ctx != self.ctx:
            raise LogprobFileError(f"{self.path} was computed at ctx={self.ctx}, this run has ctx={ctx}: use ctx={self.ctx}")
        if vocab != self.vocab:
            raise LogprobFileError(f"{self.path} has log-probs over {self.vocab} tokens, this model's vocabulary has {vocab}")
        if n > self.n_chunks:
            raise LogprobFileError(f"this run has {n} chunks, {self.path} holds {self.n_chunks}: use n_chunks<={self.n_chunks}")
        diff = (chunks != self.tokens[:n]).flatten().nonzero()
        if len(diff):
            i = int(diff[0])
            raise LogprobFileError(
                f"the tokens differ from {self.path}'s: {len(diff)} of {n * ctx} differ, the first at chunk {i // ctx}, "
                f"position {i % ctx} (base id {int(self.tokens.flatten()[i])}, this run {int(chunks.flatten()[i])}); "
                f"the base was computed on text {src!r}")


class LogprobWriter:
    """Writes a log-prob file chunk by chunk to ``path + '.tmp'``; ``close`` renames it into place."""

    def __init__(self, path: str | os.PathLike, chunks: torch.Tensor, vocab: int, fmt: str, meta: dict):
        self.path, self.tmp = Path(path), Path(f"{path}.tmp")
        n, ctx = chunks.shape
        need = LogprobFile.nbytes(n, ctx, vocab, fmt)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.path.parent).free
        if need > free:
            raise OSError(f"save_logits={path} needs {need / 2**30:.2f} GiB ({n} chunks x {ctx - 1 - ctx // 2} positions "
                          f"x {vocab} {fmt}), {free / 2**30:.2f} GiB are free: use fewer n_chunks or logits_format=uint16")
        print(f"kvstream-ppl: saving {n} chunks of {fmt} log-probs over {vocab} tokens: {need / 2**20:.1f} MiB "
              f"to {path}", file=sys.stderr)
        header = json.dumps({"version": VERSION, "ctx": ctx, "n_chunks": n, "vocab": vocab, "format": fmt, **meta}).encode()
        header += b" " * (-(len(MAGIC) + 8 + len(header)) % 64)
        self.format = fmt
        self.f = open(self.tmp, "wb")
        self.f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        self.f.write(chunks.to(torch.int32).numpy().tobytes())

    def write_logprobs(self, lp: torch.Tensor) -> None:
        self.f.write(encode_logprobs(lp, self.format).cpu().numpy().tobytes())

    def write_nll(self, nll: np.ndarray) -> None:
        self.f.write(nll.astype(np.float32).tobytes())

    def close(self, ok: bool) -> None:
        self.f.close()
        if ok:
            self.tmp.replace(self.path)
        else:
            self.tmp.unlink(missing_ok=True)


@dataclass
class KldResult:
    """Per scored position: KL(base || run), whether the top-1 tokens agree, and the base's NLL."""

    kld: np.ndarray
    same_top1: np.ndarray
    nll_base: np.ndarray
    base_path: str
    format: str

    def stats(self, nll: np.ndarray) -> dict:
        k, n = self.kld, len(self.kld)
        mean = float(k.mean())
        var = float((k ** 2).mean()) - mean * mean
        top1 = float(self.same_top1.mean())
        ppl_b, ppl_b_err = ppl_estimate(self.nll_base)
        ppl_q, _ = ppl_estimate(nll)
        d = nll - self.nll_base  # ln(PPL/PPL(base)) is the mean of the paired differences
        se = lambda x: float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
        cov = np.cov(np.stack([nll, self.nll_base])) / n if n > 1 else np.full((2, 2), np.nan)  # of the means
        diff_err = math.sqrt(max(ppl_q ** 2 * cov[0, 0] + ppl_b ** 2 * cov[1, 1] - 2 * ppl_q * ppl_b * cov[0, 1], 0.0))
        ratio = math.exp(float(d.mean()))
        q999, q99, q50 = np.quantile(k, [0.999, 0.99, 0.5])
        return {
            "base": self.base_path, "base_format": self.format,
            "ppl_base": ppl_b, "ppl_base_err": ppl_b_err,
            "ppl_ratio": ratio, "ppl_ratio_err": ratio * se(d),
            "ppl_diff": ppl_q - ppl_b, "ppl_diff_err": diff_err,
            "kld_mean": mean, "kld_mean_err": math.sqrt(max(var, 0.0) / (n - 1)) if n > 1 else float("nan"),
            "kld_max": float(k.max()), "kld_99.9": float(q999), "kld_99": float(q99),
            "kld_median": float(q50), "kld_min": float(k.min()),
            "same_top1": top1, "same_top1_err": math.sqrt(top1 * (1 - top1) / (n - 1)) if n > 1 else float("nan"),
        }


@dataclass
class PplResult:
    ctx: int
    n_chunks: int
    batch: int
    nll: np.ndarray            # float64 [n_chunks * n_scored]
    seconds: float
    kld: KldResult | None = None
    stats: dict = field(init=False)

    def __post_init__(self):
        ppl, err = ppl_estimate(self.nll)
        self.stats = {"ppl": ppl, "ppl_err": err, "ctx": self.ctx, "n_chunks": self.n_chunks, "batch": self.batch,
                      "n_scored": len(self.nll), "seconds": self.seconds,
                      "tok_s": self.n_chunks * self.ctx / self.seconds if self.seconds else float("nan")}
        if self.kld is not None:
            self.stats["kld"] = self.kld.stats(self.nll)

    @property
    def ppl(self) -> float:
        return self.stats["ppl"]

    def summary(self) -> str:
        s = self.stats
        lines = [
            f"chunks      {s['n_chunks']} x {s['ctx']} tokens (batch {s['batch']}); scored {s['n_scored']} "
            f"({s['n_scored'] // s['n_chunks']} per chunk: the second half)",
            f"time        {s['seconds']:.1f} s, {s['tok_s']:.1f} tok/s",
            f"PPL         {s['ppl']:.4f} +/- {s['ppl_err']:.4f}",
        ]
        if (k := s.get("kld")) is not None:
            lines += [
                f"base        {k['base']} ({k['base_format']} log-probs)",
                f"PPL(base)   {k['ppl_base']:.4f} +/- {k['ppl_base_err']:.4f}",
                f"PPL/base    {k['ppl_ratio']:.5f} +/- {k['ppl_ratio_err']:.5f}",
                f"PPL-base    {k['ppl_diff']:.5f} +/- {k['ppl_diff_err']:.5f}",
                f"KLD mean    {k['kld_mean']:.6g} +/- {k['kld_mean_err']:.3g}",
                *(f"KLD {q:<7} {k[key]:.6g}" for q, key in (("max", "kld_max"), ("99.9%", "kld_99.9"), ("99%", "kld_99"),
                                                            ("median", "kld_median"), ("min", "kld_min"))),
                f"same top-1  {100 * k['same_top1']:.3f} +/- {100 * k['same_top1_err']:.3f} %",
            ]
        return "\n".join(lines)


SAVE_LIMIT = 2 * 2**30  # save_logits refuses a larger file unless forced


def check_run(chunks: torch.Tensor, model_cfg, *, batch: int = 512, logits_format: str = "uint16",
              save_logits=None, compare_logits=None, force: bool = False) -> LogprobFile | None:
    """Refuse a run that cannot work, before any model work; returns the opened base, if any.
    ``model_cfg`` is the model's :class:`~kvstream.model.loader.ModelConfig` (cheap to read from a GGUF).
    A ``save_logits`` file above :data:`SAVE_LIMIT` is refused unless ``force``."""
    n, ctx = chunks.shape
    if ctx > model_cfg.context_length:
        raise ValueError(f"ctx={ctx} exceeds the model's context length of {model_cfg.context_limit}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if logits_format not in LOGITS_FORMATS:
        raise ValueError(f"logits_format={logits_format!r}; choose one of {', '.join(LOGITS_FORMATS)}")
    if save_logits is not None and compare_logits is not None:
        raise ValueError("save_logits and compare_logits are exclusive: save a base in one run, compare in another")
    if save_logits is not None:
        need = LogprobFile.nbytes(n, ctx, model_cfg.vocab_size, logits_format)
        if need > SAVE_LIMIT and not force:
            raise ValueError(f"save_logits={save_logits} would write {need / 2**30:.1f} GiB ({n} chunks x "
                             f"{ctx - 1 - ctx // 2} scored positions x {model_cfg.vocab_size} vocab x "
                             f"{row_bytes(model_cfg.vocab_size, logits_format) / model_cfg.vocab_size:.0f} bytes, "
                             f"{logits_format}), above the {SAVE_LIMIT / 2**30:.0f} GiB limit: set n_chunks "
                             "(or force=true)")
    if compare_logits is None:
        return None
    base = LogprobFile(compare_logits)
    base.check_matches(chunks, model_cfg.vocab_size)
    return base


@torch.inference_mode()
def perplexity(model, chunks: torch.Tensor, *, batch: int = 512, make_cache: Callable | None = None,
               save_logits: str | os.PathLike | None = None, compare_logits: str | os.PathLike | None = None,
               logits_format: str = "uint16", meta: dict | None = None, progress: bool = True) -> PplResult:
    """Perplexity of ``chunks`` [n_chunks, ctx] (see :func:`split_chunks`); optionally save the
    scored log-probs as a base, or compare against a saved base (KLD statistics).

    ``make_cache(max_tokens)`` builds the KV cache of one chunk (default ``model.new_cache``);
    ``meta`` goes into a saved file's header (text source, model, ...).
    """
    n, ctx = chunks.shape
    vocab = model.cfg.vocab_size
    base = check_run(chunks, model.cfg, batch=batch, logits_format=logits_format, save_logits=save_logits,
                     compare_logits=compare_logits, force=True)  # a size limit is the command's (kvstream-ppl)
    make_cache = make_cache or model.new_cache
    writer = None
    if save_logits is not None:
        writer = LogprobWriter(save_logits, chunks, vocab, logits_format, meta or {})
    first = ctx // 2
    nlls, klds, tops, base_nlls = [], [], [], []
    ok = False
    t0 = time.perf_counter()
    try:
        bar = tqdm(range(n), desc="ppl", unit="chunk", file=sys.stderr, disable=not progress)
        for c in bar:
            chunk = chunks[c].to(model.device)
            chunk_nll = []
            for row, lp in scored_logprobs(model, make_cache(ctx), chunk, batch):
                rows = lp.shape[0]
                chunk_nll.append(-lp.gather(1, chunk[row + 1:row + 1 + rows, None])[:, 0].double().cpu())
                if writer is not None:
                    writer.write_logprobs(lp)
                if base is not None:
                    stored = base.rows(c, row - first, row - first + rows).to(lp.device)
                    k, same = kld_top1(stored, lp, base.format)
                    klds.append(k)
                    tops.append(same)
            nlls.append(torch.cat(chunk_nll).numpy())
            if writer is not None:
                writer.write_nll(nlls[-1])
            if base is not None:
                base_nlls.append(base.nll(c))
            bar.set_postfix(ppl=f"{math.exp(np.concatenate(nlls).mean()):.4f}", refresh=False)
        ok = True
    finally:
        if writer is not None:
            writer.close(ok)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - t0
    kld = None
    if base is not None:
        kld = KldResult(torch.cat(klds).numpy(), torch.cat(tops).numpy(), np.concatenate(base_nlls),
                        str(compare_logits), base.format)
    return PplResult(ctx, n, batch, np.concatenate(nlls), seconds, kld)
