"""Quantized KV quality, kvstream against llama.cpp (issue 33): PPL and KLD of q8_0/q8_0,
q8_0/q4_0 and q4_0/q4_0 K/V caches against each one's own base, on the same GGUF and tokens.

    python experiments/kv_quant_llama.py --text /usr/lib/python3.11/argparse.py --ctx 512 --n-chunks 4

llama-perplexity's method on both sides: chunks of ``ctx`` tokens (kvstream's tokenizer; the
same ids are fed to llama.cpp), each in one batch on a fresh cache, the second half scored.
llama.cpp (llama-cpp-python, CPU, flash attention on in every arm, base f16 K/V) runs in a child
process (``--child``) that imports only numpy and writes each arm's scored log-probs; kvstream
runs ``cache=contiguous`` fp32 as its base and ``cache=resident`` for the pairs. Every KLD is
computed by kvstream's ``kld_top1`` on float32 log-probs. Skips (one line) when llama_cpp is not
importable. Writes ``<out>/kv_quant_llama.csv``.

The K swap (issue 33): ``--dump-k0 DIR`` writes llama.cpp's layer-0 K (``Kcur-0``, the RoPE
output, before the cache quantizes it; f16 base arm) as ``DIR/llama_k0.npy`` [n_chunks, ctx,
kv_heads, head_dim] for ``kv_quant_locate.py``'s ``k0`` arms, its Q as ``llama_q0.npy``, and
each arm's layer-0 attention output (``kqv_out-0``) as ``llama_attn0_<K>_<V>.npy`` (in a quantized
arm it is in llama.cpp's Hadamard-rotated basis: kv_quant_locate.py's ``rot``); ``--inject-k0
FILE`` overwrites that tensor with FILE's rows (e.g. kvstream's, ``kv_quant_locate.py --arms
dump_k0``) in every llama.cpp arm, so llama.cpp's KLDs are those of kvstream's layer-0 K. Both go
through ggml's scheduler eval callback (``cb_eval``): a node's data can be read, and rewritten
before any consumer runs, on the CPU backend. ``--llama-only`` skips kvstream's arms. The
``llama_attn_rot`` column says whether llama.cpp rotated quantized K/V (``LLAMA_ATTN_ROT_DISABLE``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PAIRS = [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")]


class _Tensor(__import__("ctypes").Structure):
    """ggml.h's ``struct ggml_tensor`` (the vendored ggml of llama-cpp-python 0.3.36)."""

    import ctypes as c
    _fields_ = [("type", c.c_int), ("buffer", c.c_void_p), ("ne", c.c_int64 * 4), ("nb", c.c_size_t * 4),
                ("op", c.c_int), ("op_params", c.c_int32 * 16), ("flags", c.c_int32), ("src", c.c_void_p * 10),
                ("view_src", c.c_void_p), ("view_offs", c.c_size_t), ("data", c.c_void_p), ("name", c.c_char * 64),
                ("extra", c.c_void_p), ("padding", c.c_char * 8)]


def k0_callback(lib, np, ctx: int, dumped: dict | None, inject):
    """A cb_eval on a ctx-token pass's layer-0 tensors: K and Q after RoPE (``Kcur-0`` / ``Qcur-0``
    whose src[1] is ``inp_pos``) and the attention output (``kqv_out-0``). Each found is appended
    to ``dumped[name]`` (a copy, [ctx, heads, D] / [ctx, H * D]) when ``dumped`` is given; K is
    overwritten with ``next(inject)`` when ``inject`` is."""
    import ctypes

    def found(t) -> str | None:
        name = t.name.decode()
        if name == "kqv_out-0" and t.ne[1] == ctx:
            return name
        if name not in ("Kcur-0", "Qcur-0") or not t.src[1] or t.ne[2] != ctx:
            return None
        return name if ctypes.cast(t.src[1], ctypes.POINTER(_Tensor)).contents.name == b"inp_pos" else None

    def cb(ptr, ask, _):
        t = ctypes.cast(ptr, ctypes.POINTER(_Tensor)).contents
        if ask:
            return t.name in (b"Kcur-0", b"Qcur-0", b"kqv_out-0")
        name = found(t)
        if name is not None:
            shape = tuple(t.ne[i] for i in range(4) if t.ne[i] > 1)[::-1]
            assert t.type == 0 and t.nb[1] == 4 * t.ne[0] and t.nb[2] == t.nb[1] * t.ne[1]  # f32, contiguous
            a = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape)
            if dumped is not None:
                dumped.setdefault(name, []).append(a.copy())
            if inject is not None and name == "Kcur-0":
                a[:] = next(inject)
        return True

    return lib.ggml_backend_sched_eval_callback(cb)


def child(gguf: str, tokens_file: str, out_dir: str, threads: int, dump_k0: bool = False,
          inject_k0: str | None = None) -> None:
    """llama.cpp arms: base (f16 K/V) and PAIRS, flash attention on; one .npy of float32
    log-probs [n_chunks * n_scored, vocab] and one of NLLs per arm."""
    import llama_cpp  # before numpy (experiments/peer_llama_cpp.py)
    import llama_cpp.llama_cpp as lib
    import numpy as np

    # no extra buffer types (weight repacking): a native build on an AMX CPU picks the AMX matmul,
    # which segfaults where the VM does not grant AMX tiles (this machine); attention is unaffected
    default_params = lib.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params

    chunks = np.array(json.load(open(tokens_file)))
    n, ctx = chunks.shape
    k0 = {"dumped": None, "inject": None}
    if dump_k0 or inject_k0:  # every context the Llama constructor makes gets the callback
        default_ctx = lib.llama_context_default_params

        def ctx_params():
            p = default_ctx()
            p.cb_eval = k0["cb"] = k0_callback(lib, np, ctx, k0["dumped"], k0["inject"])  # (kept alive)
            return p

        lib.llama_context_default_params = ctx_params
    first = ctx // 2
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    for tk, tv in [("f16", "f16")] + PAIRS:
        k0["dumped"] = {} if dump_k0 else None
        k0["inject"] = iter(np.load(inject_k0).astype(np.float32)) if inject_k0 else None
        llm = llama_cpp.Llama(gguf, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, n_threads=threads, logits_all=True,
                              flash_attn=True, type_k=types[tk], type_v=types[tv], verbose=False)
        lps, nlls = [], []
        for c in chunks:
            llm.reset()
            llm.eval(c.tolist())
            x = llm.scores[first:ctx - 1].astype(np.float64)
            lp = x - x.max(-1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
            lps.append(lp.astype(np.float32))
            nlls.append(-lp[np.arange(ctx - 1 - first), c[first + 1:]])
        np.save(Path(out_dir) / f"{tk}_{tv}.npy", np.concatenate(lps))
        np.save(Path(out_dir) / f"{tk}_{tv}.nll.npy", np.concatenate(nlls))
        if k0["dumped"] is not None:  # K and Q of the base; every arm's attention output
            files = {"Kcur-0": "llama_k0", "Qcur-0": "llama_q0"} if tk == "f16" else {}
            for name, f in {**files, "kqv_out-0": f"llama_attn0_{tk}_{tv}"}.items():
                got = k0["dumped"].get(name, [])
                assert len(got) == n, f"found {name} in {len(got)} of {n} passes"
                np.save(Path(dump_k0) / f"{f}.npy", np.stack(got))
        if k0["inject"] is not None:
            assert next(k0["inject"], None) is None, "layer 0's K was not overwritten in every pass"
        del llm


def main() -> None:
    if "--child" in sys.argv:  # llama.cpp's process imports numpy only, not experiments.common's torch
        ap = argparse.ArgumentParser()
    else:
        from experiments.common import kv_quant_parser

        ap = kv_quant_parser(__doc__.splitlines()[0], "results/kv_quant_cost/llama")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dump-k0", metavar="DIR", help="write llama.cpp's layer-0 K to DIR/llama_k0.npy")
    ap.add_argument("--inject-k0", metavar="NPY", help="run llama.cpp with this layer-0 K (see the module doc)")
    ap.add_argument("--llama-only", action="store_true", help="only llama.cpp's arms (no kvstream rows)")
    ap.add_argument("--child", nargs=3, metavar=("GGUF", "TOKENS_JSON", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.threads, args.dump_k0, args.inject_k0)
    if importlib.util.find_spec("llama_cpp") is None:
        print("kv_quant_llama: skipped, llama_cpp (llama-cpp-python) is not importable")
        return

    import numpy as np
    import pandas as pd
    import torch

    from experiments.common import kld_summary, provenance
    from kvstream.cache.factory import make_cache
    from kvstream.config import ArenaConfig, CacheConfig
    from kvstream.eval.perplexity import KldResult, LogprobFile, kld_top1, perplexity, split_chunks
    from kvstream.model.loader import open_gguf
    from kvstream.model.qwen import load_model
    from kvstream.model.registry import resolve_model
    from kvstream.model.tokenizer import Tokenizer

    path = resolve_model(args.model)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    chunks = split_chunks(tok.encode(Path(args.text).read_text()), args.ctx, args.n_chunks,
                          tok.bos_id if tok.add_bos else None)
    tmp = Path(tempfile.mkdtemp(prefix="kvllama"))
    (tmp / "tokens.json").write_text(json.dumps(chunks.tolist()))
    k0 = (["--dump-k0", args.dump_k0] if args.dump_k0 else []) + (["--inject-k0", args.inject_k0] if args.inject_k0 else [])
    subprocess.run([sys.executable, "-m", "experiments.kv_quant_llama", "--threads", str(args.threads), *k0,
                    "--child", str(path), str(tmp / "tokens.json"), str(tmp)], check=True)

    def stats(base_lp, base_nll, lp, nll) -> dict:
        k, same = kld_top1(torch.from_numpy(base_lp).view(torch.uint8), torch.from_numpy(lp), "float32")
        s = KldResult(k.numpy(), same.numpy(), base_nll, "", "float32").stats(nll)
        return kld_summary(s, ppl_base=True, kld_max=False)

    rows = []
    ll = {f"{a}_{b}": (np.load(tmp / f"{a}_{b}.npy"), np.load(tmp / f"{a}_{b}.nll.npy"))
          for a, b in [("f16", "f16")] + PAIRS}
    kv = {}
    arms = [] if args.llama_only else [("base", CacheConfig(mode="contiguous"))] + [
        (f"{a}_{b}", CacheConfig(mode="resident", type_k=a, type_v=b)) for a, b in PAIRS]
    model = load_model(reader) if arms else None
    with tempfile.TemporaryDirectory() as d:  # kvstream's arms, their scored log-probs kept in memory
        for name, cache in arms:
            f = Path(d) / f"{name}.lp"
            make = lambda n, c=cache: make_cache(c, ArenaConfig(), model, n, args.ctx, all_logits=True)
            perplexity(model, chunks, batch=args.ctx, make_cache=make, progress=False, logits_format="float32",
                       save_logits=f)
            lf = LogprobFile(f)
            kv[name] = (np.concatenate([lf.rows(c, 0, lf.n_scored).view(torch.float32).numpy()
                                        for c in range(lf.n_chunks)]),
                        np.concatenate([lf.nll(c) for c in range(lf.n_chunks)]))
            f.unlink()
    for a, b in PAIRS:
        p = f"{a}_{b}"
        rows.append(dict(engine="llama.cpp", type_k=a, type_v=b, base="f16 K/V (flash attention)",
                         **stats(*ll["f16_f16"], *ll[p])))
        if kv:
            rows.append(dict(engine="kvstream", type_k=a, type_v=b, base="contiguous fp32",
                             **stats(*kv["base"], *kv[p])))
    # the two bases against each other, and each engine's base against the other's
    if kv:
        rows.append(dict(engine="llama.cpp f16 vs kvstream fp32", type_k="-", type_v="-", base="kvstream fp32",
                         **stats(*kv["base"], *ll["f16_f16"])))
    df = pd.DataFrame(rows)
    for a, b in [] if args.llama_only else PAIRS:
        m = (df.type_k == a) & (df.type_v == b)
        ratio = df[m & (df.engine == "kvstream")].kld_mean.iloc[0] / df[m & (df.engine == "llama.cpp")].kld_mean.iloc[0]
        df.loc[m, "kld_ratio_kvstream_over_llama"] = ratio
    df = df.assign(model=args.model, text=args.text, ctx=args.ctx, n_chunks=args.n_chunks,
                   llama_cpp_python=importlib.metadata.version("llama_cpp_python"), threads=args.threads,
                   llama_k0=f"from {args.inject_k0}" if args.inject_k0 else "own",
                   llama_attn_rot="off" if int(os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0")) else "on", **provenance(),
                   command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "kv_quant_llama.csv", index=False)
    print(df.drop(columns=["command"]).to_string(index=False))


if __name__ == "__main__":
    main()
