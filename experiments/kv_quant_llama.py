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
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

PAIRS = [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0")]


def child(gguf: str, tokens_file: str, out_dir: str, threads: int) -> None:
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
    first = ctx // 2
    types = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}
    for tk, tv in [("f16", "f16")] + PAIRS:
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
        del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--text", default="/usr/lib/python3.11/argparse.py")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--n-chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/kv_quant_cost/llama")
    ap.add_argument("--child", nargs=3, metavar=("GGUF", "TOKENS_JSON", "OUT_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.threads)
    if importlib.util.find_spec("llama_cpp") is None:
        print("kv_quant_llama: skipped, llama_cpp (llama-cpp-python) is not importable")
        return

    import numpy as np
    import pandas as pd
    import torch

    from experiments.common import provenance
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
    subprocess.run([sys.executable, "-m", "experiments.kv_quant_llama", "--threads", str(args.threads),
                    "--child", str(path), str(tmp / "tokens.json"), str(tmp)], check=True)

    def stats(base_lp, base_nll, lp, nll) -> dict:
        k, same = kld_top1(torch.from_numpy(base_lp).view(torch.uint8), torch.from_numpy(lp), "float32")
        s = KldResult(k.numpy(), same.numpy(), base_nll, "", "float32").stats(nll)
        return dict(ppl_base=s["ppl_base"], ppl_ratio=s["ppl_ratio"], kld_mean=s["kld_mean"],
                    kld_mean_err=s["kld_mean_err"], kld_median=s["kld_median"], kld_99_9=s["kld_99.9"],
                    same_top1=s["same_top1"])

    model = load_model(reader)

    rows = []
    ll = {f"{a}_{b}": (np.load(tmp / f"{a}_{b}.npy"), np.load(tmp / f"{a}_{b}.nll.npy"))
          for a, b in [("f16", "f16")] + PAIRS}
    kv = {}
    with tempfile.TemporaryDirectory() as d:  # kvstream's arms, their scored log-probs kept in memory
        for name, cache in [("base", CacheConfig(mode="contiguous"))] + [
                (f"{a}_{b}", CacheConfig(mode="resident", type_k=a, type_v=b)) for a, b in PAIRS]:
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
        rows.append(dict(engine="kvstream", type_k=a, type_v=b, base="contiguous fp32",
                         **stats(*kv["base"], *kv[p])))
    # the two bases against each other, and each engine's base against the other's
    rows.append(dict(engine="llama.cpp f16 vs kvstream fp32", type_k="-", type_v="-", base="kvstream fp32",
                     **stats(*kv["base"], *ll["f16_f16"])))
    df = pd.DataFrame(rows)
    for a, b in PAIRS:
        m = (df.type_k == a) & (df.type_v == b)
        ratio = df[m & (df.engine == "kvstream")].kld_mean.iloc[0] / df[m & (df.engine == "llama.cpp")].kld_mean.iloc[0]
        df.loc[m, "kld_ratio_kvstream_over_llama"] = ratio
    df = df.assign(model=args.model, text=args.text, ctx=args.ctx, n_chunks=args.n_chunks,
                   llama_cpp_python=importlib.metadata.version("llama_cpp_python"), threads=args.threads, **provenance(),
                   command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "kv_quant_llama.csv", index=False)
    print(df.drop(columns=["command"]).to_string(index=False))


if __name__ == "__main__":
    main()
