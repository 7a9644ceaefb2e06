"""What the KV cache costs in quality: PPL and KLD of paged q8_0 / q4_0 / f16 caches against the
dense fp32 cache, and streamed against resident pages, on a real model and a real text.

    python experiments/kv_quant_cost.py --model qwen2.5-coder-0.5b --ctx 2048 --n-chunks 3 --batch 16

Every run is ``kvstream-ppl`` (kvstream.cli.ppl.run) on the built-in standard-library text.
The base is the contiguous fp32 cache; each paged cache type pair is compared against it. The
stream arms hold 2 of each layer's pages resident and stream the rest through a ring large
enough for one round, or through a ring of 2 slots (one page a round: several rounds per
layer), and are compared against the resident arm of the same types (its log-probs saved
exactly, float32): those KLDs must be exactly 0. ``--batch 16`` sends every forward pass
through the decode-attention path (verify batches of 16), as decoding does. ``--stream-only``
runs just the resident and stream arms. Writes ``<out>/kv_quant_cost.csv``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

from experiments.common import kld_summary, provenance, run_ppl as ppl
from kvstream.cache.arena import ArenaPlan, pair_bytes
from kvstream.cache.factory import reserve_slab
from kvstream.model.loader import open_gguf, read_config
from kvstream.model.qwen import load_model
from kvstream.model.registry import resolve_model

PAIRS = [("q8_0", "q4_0"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "f16")]


def compared(arm: str, type_k: str, type_v: str, against: str, r: dict) -> dict:
    """A table row: a ``kvstream-ppl`` run ``r`` compared against the saved log-probs of ``against``."""
    return dict(arm=arm, type_k=type_k, type_v=type_v, against=against, ppl=r["ppl"], ppl_err=r["ppl_err"],
                **kld_summary(r["kld"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--n-chunks", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="results/kv_quant_cost")
    ap.add_argument("--stream-only", action="store_true", help="only the resident and stream arms")
    args = ap.parse_args()
    common = [f"model={args.model}", f"ctx={args.ctx}", f"n_chunks={args.n_chunks}", f"batch={args.batch}",
              "progress=false"]
    cfg = read_config(open_gguf(resolve_model(args.model)))
    tmp = Path(tempfile.mkdtemp(prefix="kvq"))
    rows = []
    base = tmp / "dense.lp"
    if not args.stream_only:
        r = ppl(common + ["cache=contiguous", f"save_logits={base}"])
        rows.append(dict(arm="contiguous fp32 (base)", type_k="-", type_v="-", against="-", ppl=r["ppl"],
                         ppl_err=r["ppl_err"]))
    for tk, tv in [] if args.stream_only else PAIRS:
        r = ppl(common + ["cache=resident", f"cache.type_k={tk}", f"cache.type_v={tv}", f"compare_logits={base}"])
        rows.append(compared("resident", tk, tv, "contiguous fp32", r))
    # streamed vs resident, q8_0 / q4_0: 2 resident pages per layer, the rest through the ring
    resident = tmp / "resident.lp"
    ppl(common + ["cache=resident", f"save_logits={resident}", "logits_format=float32"])
    pages = -(-args.ctx // 256)
    pair = pair_bytes("q8_0", "q4_0", cfg.n_kv_heads, cfg.head_dim)
    slab = reserve_slab(load_model(resolve_model(args.model)), args.batch)
    # two halves each holding every streamed page (one round per layer), or one page each
    for ring, rounds in ((2 * (pages - 2), "one round"), (2, f"{pages - 2} rounds")):
        mib = ArenaPlan(slab, ring, pair).mib(cfg.n_layers * 2)
        r = ppl(common + ["cache=stream", f"cache.ring_pages={ring}", f"arena.mib={mib}",
                          f"compare_logits={resident}"])
        rows.append(compared(f"stream ({pages - 2} of {pages} pages/layer streamed, {rounds})", "q8_0", "q4_0",
                             "resident q8_0/q4_0", r))
    df = pd.DataFrame(rows).assign(model=args.model, ctx=args.ctx, n_chunks=args.n_chunks, batch=args.batch,
                                   **provenance(), command=" ".join(["python"] + sys.argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "kv_quant_cost.csv", index=False)
    print(df.drop(columns=["command"]).to_string(index=False))


if __name__ == "__main__":
    main()
