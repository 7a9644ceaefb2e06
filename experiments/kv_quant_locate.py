"""Where the quantized KV cache's error comes from (issue 33): PPL / KLD of one step of the KV
path at a time against the fp32 base, on a real model and text, llama-perplexity's method.

    python experiments/kv_quant_locate.py --text /usr/lib/python3.11/argparse.py --arms base,kq8,vq4,...

Each arm runs the model over a contiguous cache (SDPA, fp32) that holds every K/V row as a paged
cache returns it (``reference.quantize`` then ``dequantize``: the bytes a page holds, decoded
exactly), with one knob changed:

- ``k`` / ``v``: the block type of K / V (None: exact), ``layers``: only these layers quantized;
- ``kv16``: K/V rounded to fp16 (llama.cpp's f16 base);
- ``q``: Q rounded through q8_0 first (llama.cpp's CPU flash attention converts Q to the K type's
  vec_dot type, q8_0 for q8_0 and q4_0 K);
- ``k_even``: q8_0 K quantized as ggml-cpu's x86 ``quantize_row_q8_0`` (``x * (127 / amax)``,
  round half to even) instead of gguf's reference (``x * (1 / (amax / 127))``, half away);
- ``own_exact``: the pass's own queries see its own rows exact (only earlier passes' rows quantized);
- ``v_tokens``: V in blocks of 32 tokens per channel instead of 32 channels per token.

``resident`` arms run the real paged cache (``cache=resident``) instead, at ``batch`` tokens a pass
(16: every query through the decode-attention path). ``attn_err`` runs the base once and records,
per layer, the relative error of that layer's attention output with its K (or V) quantized, the
layer's inputs being the base's. Writes ``<out>/locate.csv`` (and ``attn_err.csv``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments.common import provenance
from kernels import reference
from kvstream.cache.contiguous import ContiguousCache, causal_attention
from kvstream.cache.factory import make_cache
from kvstream.config import ArenaConfig, CacheConfig
from kvstream.eval.perplexity import KldResult, LogprobFile, decode_logprobs, kld_top1, perplexity, split_chunks
from kvstream.model.loader import open_gguf
from kvstream.model.qwen import load_model
from kvstream.model.registry import resolve_model
from kvstream.model.tokenizer import Tokenizer

ARMS = {
    "base": {},
    "kv16": dict(kv16=True),
    "kq8_vq4": dict(k="q8_0", v="q4_0"),
    "kq8": dict(k="q8_0"),
    "vq4": dict(v="q4_0"),
    "vq8": dict(v="q8_0"),
    "kq8_vq8": dict(k="q8_0", v="q8_0"),
    "kq4_vq4": dict(k="q4_0", v="q4_0"),
    "kq8_vq4_q8": dict(k="q8_0", v="q4_0", q=True),
    "kq8_vq4_even": dict(k="q8_0", v="q4_0", k_even=True),
    "kq8_vq4_own_exact": dict(k="q8_0", v="q4_0", own_exact=True),
    "kq8_vq4_vtokens": dict(k="q8_0", v="q4_0", v_tokens=True),
    "kq8_vq4_first_half": dict(k="q8_0", v="q4_0", layers=range(0, 12)),
    "kq8_vq4_second_half": dict(k="q8_0", v="q4_0", layers=range(12, 24)),
    "kq8_vq4_not_l0": dict(k="q8_0", v="q4_0", layers=range(1, 24)),
    "resident_b512": dict(resident=True, batch=512),
    "resident_b16": dict(resident=True, batch=16),
}


def roundtrip(x: torch.Tensor, t: str | None) -> torch.Tensor:
    """x [..., D] as a GGML block type holds it (blocks of 32 along the last dim), in x's dtype."""
    return x if t is None else reference.dequantize(reference.quantize(x, t), t).to(x.dtype)


def q8_0_even(x: torch.Tensor) -> torch.Tensor:
    """q8_0 as ggml-cpu's AVX quantize_row_q8_0 rounds: q = rint(x * (127 / amax)), fp16 d = amax / 127."""
    b = x.float().reshape(-1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax == 0, 0.0, 127 / amax))  # torch.round: half to even
    d = (amax / 127).half().float()
    return (q * d).reshape(x.shape).to(x.dtype)


class ProbeCache(ContiguousCache):
    """A contiguous cache whose rows are stored as the arm says (see the module doc)."""

    def __init__(self, model, max_tokens: int, k=None, v=None, layers=None, kv16=False, q=False, k_even=False,
                 own_exact=False, v_tokens=False, errors=None):
        c = model.cfg
        super().__init__(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, model.dtype, model.device)
        self.kt, self.vt, self.layers = k, v, set(range(c.n_layers) if layers is None else layers)
        self.kv16, self.q, self.k_even, self.own_exact, self.v_tokens = kv16, q, k_even, own_exact, v_tokens
        self.errors = errors  # attn_err: list of (layer, which, rel error)

    def _k(self, k):
        if self.k_even and self.kt == "q8_0":
            return q8_0_even(k)
        return roundtrip(k, self.kt)

    def _v(self, v):
        if self.v_tokens and self.vt is not None:  # blocks of 32 consecutive tokens of one channel
            return roundtrip(v.permute(1, 2, 0).contiguous(), self.vt).permute(2, 0, 1)
        return roundtrip(v, self.vt)

    def attend(self, layer, q, k_new, v_new):
        lo, hi = self.length, self.length + self._n
        if self.errors is not None:  # the base's attention, and its error with K or V quantized
            out = super().attend(layer, q, k_new, v_new)
            k, v = self.k[layer, :hi], self.v[layer, :hi]
            for which, kk, vv in (("k", roundtrip(k, "q8_0"), v), ("v", k, roundtrip(v, "q4_0"))):
                err = causal_attention(q, kk, vv) - out
                self.errors.append((layer, which, float(err.norm() / out.norm())))
            return out
        if self.kv16:
            k_new, v_new = k_new.half().to(k_new.dtype), v_new.half().to(v_new.dtype)
        if layer in self.layers:
            kq, vq = self._k(k_new), self._v(v_new)
        else:
            kq, vq = k_new, v_new
        self.k[layer, lo:hi], self.v[layer, lo:hi] = kq, vq
        if self.q and layer in self.layers:
            q = roundtrip(q, "q8_0")
        k, v = self.k[layer, :hi], self.v[layer, :hi]
        if self.own_exact:
            k, v = torch.cat([k[:lo], k_new]), torch.cat([v[:lo], v_new])
        return causal_attention(q, k, v)


KLD_COLS = ("kld_mean", "kld_mean_err", "kld_median", "kld_99.9", "same_top1", "ppl_ratio")
COLS = ["arm", "against", "batch", "ppl", "ppl_err", *KLD_COLS, "seconds", "model", "text", "ctx", "n_chunks",
        "git_commit", "git_dirty", "device_name", "torch", "triton", "python", "command"]


def compare_files(base: Path, run: Path) -> dict:
    """KLD statistics of one saved float32 run against a saved base (as ``compare_logits`` computes them)."""
    b, r = LogprobFile(base), LogprobFile(run)
    klds, tops = [], []
    for c in range(b.n_chunks):
        k, same = kld_top1(b.rows(c, 0, b.n_scored), decode_logprobs(r.rows(c, 0, r.n_scored), r.format).float(),
                           b.format)
        klds.append(k), tops.append(same)
    nll = lambda f: np.concatenate([f.nll(c) for c in range(f.n_chunks)])
    k = KldResult(torch.cat(klds).numpy(), torch.cat(tops).numpy(), nll(b), str(base), b.format).stats(nll(r))
    return {c: k[c] for c in KLD_COLS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--text", default="/usr/lib/python3.11/argparse.py")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--n-chunks", type=int, default=4)
    ap.add_argument("--arms", default="base,kq8_vq4,kq8,vq4", help=f"comma-separated, of {','.join(ARMS)},attn_err")
    ap.add_argument("--out", default="results/kv_quant_cost/locate")
    ap.add_argument("--bases", default="/tmp/kvq_bases", help="where the base runs' log-probs are kept between runs")
    args = ap.parse_args()
    path = resolve_model(args.model)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    chunks = split_chunks(tok.encode(Path(args.text).read_text()), args.ctx, args.n_chunks,
                          tok.bos_id if tok.add_bos else None)
    model = load_model(reader)
    bases = {"fp32": Path(args.bases) / "fp32.lp", "f16": Path(args.bases) / "f16.lp"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = dict(model=args.model, text=args.text, ctx=args.ctx, n_chunks=args.n_chunks, **provenance(),
                command=" ".join(["python"] + sys.argv))

    def emit(row: dict) -> None:  # one CSV row per (arm, base), appended as soon as it is known
        print(row, flush=True)
        f = out / "locate.csv"
        pd.DataFrame([{**row, **prov}]).reindex(columns=COLS).to_csv(f, mode="a", header=not f.exists(), index=False)

    for name in args.arms.split(","):
        if name == "attn_err":
            errors = []
            perplexity(model, chunks, batch=args.ctx, make_cache=lambda n: ProbeCache(model, n, errors=errors),
                       progress=False)
            df = pd.DataFrame(errors, columns=["layer", "quantized", "rel_err"])
            df = df.groupby(["layer", "quantized"]).rel_err.mean().unstack()  # mean over chunks
            df.to_csv(out / "attn_err.csv")
            print(df.to_string(), flush=True)
            continue
        arm = dict(ARMS[name])
        batch = arm.pop("batch", args.ctx)
        if arm.pop("resident", False):
            cc, ac = CacheConfig(mode="resident"), ArenaConfig()
            make = lambda n: make_cache(cc, ac, model, n, batch, all_logits=True)
        else:
            make = lambda n, a=arm: ProbeCache(model, n, **a)
        save = bases.get({"base": "fp32", "kv16": "f16"}.get(name), Path(args.bases) / f"{name}.lp")
        save.parent.mkdir(parents=True, exist_ok=True)
        r = perplexity(model, chunks, batch=batch, make_cache=make, progress=False, logits_format="float32",
                       save_logits=save)
        row = dict(arm=name, batch=batch, ppl=r.ppl, ppl_err=r.stats["ppl_err"], seconds=r.stats["seconds"])
        for against in ("fp32", "f16"):
            if bases[against].exists() and bases[against] != save:
                emit(dict(row, against=against, **compare_files(bases[against], save)))
        if save not in bases.values():
            save.unlink()
        elif name == "base":
            emit(row)


if __name__ == "__main__":
    main()
