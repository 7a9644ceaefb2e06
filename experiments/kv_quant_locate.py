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
- ``v_tokens``: V in blocks of 32 tokens per channel instead of 32 channels per token;
- ``rot``: Q and K (when K is quantized) and V (when V is) multiplied by the orthonormal 64x64
  Walsh-Hadamard matrix before quantization, the attention output rotated back, as llama.cpp's
  KV cache does for quantized types (llama-cpp-python 0.3.36's; ``attn_rot_k`` / ``attn_rot_v``, cf. #21038,
  off with ``LLAMA_ATTN_ROT_DISABLE=1``): the rotation spreads K's outlier channels over the block;
- ``k0``: layer 0's K (after RoPE, before quantization) replaced by the rows of an .npy file
  [n_chunks, ctx, kv_heads, head_dim], e.g. llama.cpp's (``kv_quant_llama.py --dump-k0``): does
  the q8_0 cost follow the K values? ``dump_k0`` writes kvstream's own layer-0 K in that form.

``resident`` arms run the real paged cache (``cache=resident``) instead, at ``batch`` tokens a pass
(16: every query through the decode-attention path). ``attn_err`` runs the base once and records,
per layer, the relative error of that layer's attention output with its K (or V) quantized, the
layer's inputs being the base's. Writes ``<out>/locate.csv`` (and ``attn_err.csv``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from experiments.common import kv_quant_parser, provenance
from kernels import reference
from kvstream.cache.kv_ops import hadamard
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
    "dump_k0": dict(dump=True),  # also the layer-0 attention output of each dump arm
    "dump_k0_kq8_vq8": dict(dump=True, k="q8_0", v="q8_0"),
    "dump_k0_kq8_vq4": dict(dump=True, k="q8_0", v="q4_0"),
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
    # the K swap: llama.cpp's layer-0 K (<bases>/llama_k0.npy) in kvstream's path, exact or q8_0
    "l0k_llama": dict(k0="llama"),
    "kq8_l0_only": dict(k="q8_0", layers=[0]),
    "kq8_l0_only_l0k_llama": dict(k="q8_0", layers=[0], k0="llama"),
    "kq8_l0k_llama": dict(k="q8_0", k0="llama"),
    "kq8_vq4_l0k_llama": dict(k="q8_0", v="q4_0", k0="llama"),
    # llama.cpp's layer-0 attention output (kv_quant_llama.py --dump-k0) in kvstream's exact path
    "l0attn_llama_f16": dict(attn0="llama_attn0_f16_f16"),
    "l0attn_llama_q8_q8": dict(attn0="llama_attn0_q8_0_q8_0"),
    # llama.cpp's Hadamard rotation of quantized K/V (see ``rot``)
    "kq8_vq8_rot": dict(k="q8_0", v="q8_0", rot=True),
    "kq8_vq4_rot": dict(k="q8_0", v="q4_0", rot=True),
    "kq4_vq4_rot": dict(k="q4_0", v="q4_0", rot=True),
    "kq8_rot": dict(k="q8_0", rot=True),
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
                 own_exact=False, v_tokens=False, errors=None, k0=None, dump=None, attn0=None,
                 rot=False):
        c = model.cfg
        super().__init__(c.n_layers, c.n_kv_heads, c.head_dim, max_tokens, model.dtype, model.device)
        self.kt, self.vt, self.layers = k, v, set(range(c.n_layers) if layers is None else layers)
        self.kv16, self.q, self.k_even, self.own_exact, self.v_tokens = kv16, q, k_even, own_exact, v_tokens
        self.errors = errors  # attn_err: list of (layer, which, rel error)
        self.k0, self.dump = k0, dump  # this chunk's layer-0 K [ctx, kvh, D] to use; a dict to append ours to
        self.attn0 = attn0  # this chunk's layer-0 attention output [ctx, H * D] to use instead of ours
        self.rot = hadamard(c.head_dim).to(model.device, model.dtype) if rot else None

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
        if layer == 0 and self.dump is not None:
            self.dump.setdefault("k", []).append(k_new.float().cpu())
            self.dump.setdefault("q", []).append(q.float().cpu())
        if layer == 0 and self.k0 is not None:
            k_new = self.k0[lo:hi].to(k_new)
        out = self._attend(layer, q, k_new, v_new, lo, hi)
        if layer == 0 and self.attn0 is not None:
            out = self.attn0[lo:hi].to(out).view(out.shape)
        if layer == 0 and self.dump is not None:
            self.dump.setdefault("attn", []).append(out.reshape(out.shape[0], -1).float().cpu())
        return out

    def _attend(self, layer, q, k_new, v_new, lo, hi):
        if self.errors is not None:  # the base's attention, and its error with K or V quantized
            out = super().attend(layer, q, k_new, v_new)
            k, v = self.k[layer, :hi], self.v[layer, :hi]
            for which, kk, vv in (("k", roundtrip(k, "q8_0"), v), ("v", k, roundtrip(v, "q4_0"))):
                err = causal_attention(q, kk, vv) - out
                self.errors.append((layer, which, float(err.norm() / out.norm())))
            return out
        if self.kv16:
            k_new, v_new = k_new.half().to(k_new.dtype), v_new.half().to(v_new.dtype)
        rot_k = self.rot is not None and layer in self.layers and self.kt is not None
        rot_v = self.rot is not None and layer in self.layers and self.vt is not None
        if rot_k:  # q.k is unchanged (H orthonormal); K is quantized in the rotated basis
            q, k_new = q @ self.rot, k_new @ self.rot
        if rot_v:
            v_new = v_new @ self.rot
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
        out = causal_attention(q, k, v)
        return out @ self.rot if rot_v else out  # (H is its own inverse)


def k0_stats(bases: Path, out: Path) -> None:
    """kvstream's layer-0 K against llama.cpp's (``<bases>/{kvstream,llama}_k0.npy``): per channel
    (kv head, dim) the mean |K| of each and the RMS of their difference, and per q8_0 block the mean
    scale (amax / 127) and RMS rounding error of each; -> ``k0_channels.csv``, ``k0_blocks.csv``."""
    ks, kl = (torch.from_numpy(np.load(bases / f"{e}_k0.npy")).float() for e in ("kvstream", "llama"))
    n, ctx, kvh, d = ks.shape
    ch = pd.DataFrame(dict(head=np.repeat(np.arange(kvh), d), dim=np.tile(np.arange(d), kvh),
                           kvstream_mean_abs=ks.abs().mean((0, 1)).flatten().numpy(),
                           llama_mean_abs=kl.abs().mean((0, 1)).flatten().numpy(),
                           kvstream_max_abs=ks.abs().amax((0, 1)).flatten().numpy(),
                           diff_rms=(ks - kl).pow(2).mean((0, 1)).sqrt().flatten().numpy()))
    ch.to_csv(out / "k0_channels.csv", index=False)
    rows = []
    for name, k in (("kvstream", ks), ("llama", kl)):
        err = roundtrip(k, "q8_0") - k
        b, e = k.reshape(n, ctx, kvh, d // 32, 32), err.reshape(n, ctx, kvh, d // 32, 32)
        for h in range(kvh):
            for j in range(d // 32):
                rows.append(dict(k=name, head=h, block=j, scale_mean=float(b[:, :, h, j].abs().amax(-1).mean() / 127),
                                 err_rms=float(e[:, :, h, j].pow(2).mean().sqrt()),
                                 err_rel=float(e[:, :, h, j].norm() / b[:, :, h, j].norm())))
    bl = pd.DataFrame(rows)
    bl.to_csv(out / "k0_blocks.csv", index=False)
    print(ch.sort_values("kvstream_mean_abs", ascending=False).head(8).to_string(index=False))
    print(bl.to_string(index=False))
    print(f"K relative RMS difference kvstream vs llama.cpp: {float((ks - kl).norm() / ks.norm()):.3e}; "
          f"q8_0 error relative: kvstream {float((roundtrip(ks, 'q8_0') - ks).norm() / ks.norm()):.3e}, "
          f"llama.cpp {float((roundtrip(kl, 'q8_0') - kl).norm() / kl.norm()):.3e}", flush=True)


def attn0_stats(bases: Path, out: Path) -> None:
    """Layer 0's attention output (its inputs are the same in every arm) in each engine's arms
    against each engine's base, ||a - base|| / ||base|| per chunk; kvstream's from the ``dump_k0*``
    arms, llama.cpp's from ``kv_quant_llama.py --dump-k0``; also Q against Q. -> ``attn0.csv``."""
    load = lambda f: torch.from_numpy(np.load(bases / f"{f}.npy")).double()
    runs = {("kvstream", "exact"): "kvstream_attn0_base", ("kvstream", "q8_0/q8_0"): "kvstream_attn0_kq8_vq8",
            ("kvstream", "q8_0/q4_0"): "kvstream_attn0_kq8_vq4", ("llama.cpp", "exact"): "llama_attn0_f16_f16",
            ("llama.cpp", "q8_0/q8_0"): "llama_attn0_q8_0_q8_0", ("llama.cpp", "q8_0/q4_0"): "llama_attn0_q8_0_q4_0",
            ("llama.cpp", "q4_0/q4_0"): "llama_attn0_q4_0_q4_0"}
    a = {k: load(f) for k, f in runs.items() if (bases / f"{f}.npy").exists()}
    # llama.cpp's kqv_out of a quantized-V arm is in the Hadamard-rotated basis (``rot``): rotate it back
    h = hadamard(64).double()
    a = {(e, arm): x if e == "kvstream" or arm == "exact" else (x.unflatten(-1, (-1, 64)) @ h).flatten(-2)
         for (e, arm), x in a.items()}
    rows = []
    for (eng, arm), x in a.items():
        for beng in ("kvstream", "llama.cpp"):
            base = a.get((beng, "exact"))
            if base is None or (eng, arm) == (beng, "exact"):
                continue
            rel = ((x - base).flatten(1).norm(dim=1) / base.flatten(1).norm(dim=1)).numpy()
            rows.append(dict(tensor="attn_out_l0", engine=eng, arm=arm, against=f"{beng} exact",
                             rel_err=float(rel.mean()), **{f"chunk{i}": float(r) for i, r in enumerate(rel)}))
    qk, ql = load("kvstream_q0"), load("llama_q0")
    rel = ((qk - ql).flatten(1).norm(dim=1) / qk.flatten(1).norm(dim=1)).numpy()
    rows.append(dict(tensor="q_l0", engine="llama.cpp", arm="exact", against="kvstream exact", rel_err=float(rel.mean()),
                     **{f"chunk{i}": float(r) for i, r in enumerate(rel)}))
    df = pd.DataFrame(rows)
    df.to_csv(out / "attn0.csv", index=False)
    print(df.to_string(index=False), flush=True)


def swap_report(out: Path) -> None:
    """The issue's table with and without the Hadamard rotation, from committed CSVs: llama.cpp
    (``<out>/llama_own``, ``<out>/llama_rot_off``: kv_quant_llama.py --llama-only, with and without
    LLAMA_ATTN_ROT_DISABLE=1), kvstream (``<out>/../kv_quant_llama.csv``) and kvstream with the
    rotation (``<out>/locate.csv``'s ``*_rot`` arms) -> ``summary.csv``."""
    def llama(d):
        df = pd.read_csv(out / d / "kv_quant_llama.csv")
        return {(r.type_k, r.type_v): r.kld_mean for r in df[df.engine == "llama.cpp"].itertuples()}
    kv = pd.read_csv(out.parent / "kv_quant_llama.csv")
    kv = {(r.type_k, r.type_v): r.kld_mean for r in kv[kv.engine == "kvstream"].itertuples()}
    loc = pd.read_csv(out / "locate.csv")
    loc = loc[loc.against == "fp32"].drop_duplicates("arm", keep="last").set_index("arm").kld_mean
    on, off = llama("llama_own"), llama("llama_rot_off")
    rows = []
    for tk, tv in on:
        rot = loc.get(f"k{tk[:2]}_v{tv[:2]}_rot")  # q8_0 -> kq8
        rows.append(dict(type_k=tk, type_v=tv, llama_rot_on=on[(tk, tv)], llama_rot_off=off[(tk, tv)],
                         kvstream=kv[(tk, tv)], kvstream_rot=rot,
                         kvstream_over_llama_rot_on=kv[(tk, tv)] / on[(tk, tv)],
                         kvstream_over_llama_rot_off=kv[(tk, tv)] / off[(tk, tv)],
                         kvstream_rot_over_llama_rot_on=None if rot is None else rot / on[(tk, tv)]))
    df = pd.DataFrame(rows)
    df.to_csv(out / "summary.csv", index=False)
    print(df.to_string(index=False), flush=True)


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
    ap = kv_quant_parser(__doc__.splitlines()[0], "results/kv_quant_cost/locate")
    ap.add_argument("--arms", default="base,kq8_vq4,kq8,vq4", help=f"comma-separated, of {','.join(ARMS)},attn_err,attn_err_l0k_llama,k0_stats,attn0_stats,swap_report")
    ap.add_argument("--bases", default="/tmp/kvq_bases", help="where the base runs' log-probs are kept between runs")
    args = ap.parse_args()
    path = resolve_model(args.model)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    chunks = split_chunks(tok.encode(Path(args.text).read_text()), args.ctx, args.n_chunks,
                          tok.bos_id if tok.add_bos else None)
    model = load_model(reader)
    bases = {"fp32": Path(args.bases) / "fp32.lp", "f16": Path(args.bases) / "f16.lp",
             "l0k_llama": Path(args.bases) / "l0k_llama.lp"}  # the base with llama.cpp's layer-0 K
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = dict(model=args.model, text=args.text, ctx=args.ctx, n_chunks=args.n_chunks, **provenance(),
                command=" ".join(["python"] + sys.argv))

    def emit(row: dict) -> None:  # one CSV row per (arm, base), appended as soon as it is known
        print(row, flush=True)
        f = out / "locate.csv"
        pd.DataFrame([{**row, **prov}]).reindex(columns=COLS).to_csv(f, mode="a", header=not f.exists(), index=False)

    for name in args.arms.split(","):
        if name in ("k0_stats", "attn0_stats"):
            (k0_stats if name == "k0_stats" else attn0_stats)(Path(args.bases), out)
            continue
        if name == "swap_report":
            swap_report(out)
            continue
        if name in ("attn_err", "attn_err_l0k_llama"):  # the latter with llama.cpp's layer-0 K
            errors = []
            k0 = iter(torch.from_numpy(np.load(Path(args.bases) / "llama_k0.npy"))) if name != "attn_err" else None
            perplexity(model, chunks, batch=args.ctx, progress=False, make_cache=lambda n: ProbeCache(
                model, n, errors=errors, k0=None if k0 is None else next(k0)))
            df = pd.DataFrame(errors, columns=["layer", "quantized", "rel_err"])
            df = df.groupby(["layer", "quantized"]).rel_err.mean().unstack()  # mean over chunks
            df.to_csv(out / f"{name}.csv")
            print(df.to_string(), flush=True)
            continue
        arm = dict(ARMS[name])
        batch = arm.pop("batch", args.ctx)
        if arm.pop("resident", False):
            cc, ac = CacheConfig(mode="resident"), ArenaConfig()
            make = lambda n: make_cache(cc, ac, model, n, batch, all_logits=True)
        else:
            dump = {} if arm.pop("dump", False) else None
            k0 = arm.pop("k0", None)
            if k0 is not None:
                k0 = iter(torch.from_numpy(np.load(Path(args.bases) / f"{k0}_k0.npy")))
            # one cache per chunk, in order: the next chunk's layer-0 K goes with it
            a0 = arm.pop("attn0", None)
            if a0 is not None:
                a0 = iter(torch.from_numpy(np.load(Path(args.bases) / f"{a0}.npy")))
            make = lambda n, a=arm, d=dump, k=k0, a0=a0: ProbeCache(
                model, n, dump=d, k0=None if k is None else next(k), attn0=None if a0 is None else next(a0), **a)
        save = bases.get({"base": "fp32", "kv16": "f16"}.get(name, name), Path(args.bases) / f"{name}.lp")
        save.parent.mkdir(parents=True, exist_ok=True)
        r = perplexity(model, chunks, batch=batch, make_cache=make, progress=False, logits_format="float32",
                       save_logits=save)
        row = dict(arm=name, batch=batch, ppl=r.ppl, ppl_err=r.stats["ppl_err"], seconds=r.stats["seconds"])
        if dump is not None:
            if name == "dump_k0":
                np.save(Path(args.bases) / "kvstream_k0.npy", torch.stack(dump["k"]).numpy())
                np.save(Path(args.bases) / "kvstream_q0.npy", torch.stack(dump["q"]).numpy())
            np.save(Path(args.bases) / f"kvstream_attn0{name[7:] or '_base'}.npy", torch.stack(dump["attn"]).numpy())
        for against in bases:
            if bases[against].exists() and bases[against] != save:
                emit(dict(row, against=against, **compare_files(bases[against], save)))
        if save not in bases.values():
            save.unlink()
        elif name in ("base", "l0k_llama"):
            emit(row)


if __name__ == "__main__":
    main()
