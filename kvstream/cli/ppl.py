"""``kvstream-ppl``: perplexity of a text, and KL divergence against a saved base run.

    kvstream-ppl model=qwen2.5-coder-0.5b ctx=512 n_chunks=20 save_logits=base.lp
    kvstream-ppl model=qwen2.5-coder-0.5b hardware.dtype=bfloat16 compare_logits=base.lp out_json=ppl.jsonl
    kvstream-ppl cache=stream arena.mib=64 compare_logits=base.lp   # quantized, streamed KV vs the base

The computation and the log-prob file format are described in :mod:`kvstream.eval.perplexity`.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from kvstream.cache.factory import make_cache
from kvstream.cli import errors
from kvstream.config import ArenaConfig, CacheConfig, Hardware, ModelSource, register_schema, to_typed
from kvstream.model.loader import open_gguf, read_config
from kvstream.model.qwen import load_model
from kvstream.eval.perplexity import (LOGITS_FORMATS, STDLIB_MODULES, LogprobFile, check_run, perplexity, split_chunks,
                          stdlib_text)
from kvstream.model.registry import resolve_model
from kvstream.model.tokenizer import Tokenizer


@dataclass
class PplConfig:
    model: ModelSource = field(default_factory=ModelSource)
    hardware: Hardware = field(default_factory=Hardware)
    cache: CacheConfig = field(default_factory=CacheConfig)
    arena: ArenaConfig = field(default_factory=ArenaConfig)  # paged caches; auto: the whole chunk fits
    ctx: int = 512                    # tokens per chunk; the second half of each chunk is scored
    batch: int = 512                  # tokens per forward pass (prefill sub-batch) within a chunk
    n_chunks: int | None = None       # None: all whole chunks (compare: the base's count)
    text_file: str | None = None      # None: Python standard-library sources of this interpreter
    save_logits: str | None = None    # PATH: save the scored log-probs as a base (~2 bytes x vocab per token)
    compare_logits: str | None = None  # PATH: KL divergence of this run against a saved base
    logits_format: str = "uint16"     # how save_logits stores log-probs: uint16 (to 4.9e-4) | float32 (2x the size)
    force: bool = False               # save_logits: write a file above 2 GiB (check_run's SAVE_LIMIT)
    out_json: str | None = None       # PATH: append the summary as one JSON line
    progress: bool = True             # a tqdm bar per chunk on stderr

    def __post_init__(self):
        if self.ctx < 3:
            raise ValueError(f"ctx must be >= 3 (ctx/2 context tokens and at least one scored token), got {self.ctx}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.n_chunks is not None and self.n_chunks < 1:
            raise ValueError(f"n_chunks must be >= 1 or null (all), got {self.n_chunks}")
        if self.logits_format not in LOGITS_FORMATS:
            raise ValueError(f"logits_format={self.logits_format!r}; choose one of {', '.join(LOGITS_FORMATS)}")
        if self.save_logits is not None and self.compare_logits is not None:
            raise ValueError("save_logits and compare_logits are exclusive: save a base in one run, compare in another")


def run(cfg: PplConfig, out=sys.stdout) -> dict:
    """Run the command; print the summary block to ``out`` and return it as a dict."""
    if cfg.text_file is not None:
        if not Path(cfg.text_file).is_file():
            raise FileNotFoundError(f"text_file={cfg.text_file}: no such file")
        text, source = Path(cfg.text_file).read_text(encoding="utf-8"), cfg.text_file
    else:
        text, source = stdlib_text(), f"stdlib:{','.join(STDLIB_MODULES)} (Python {platform.python_version()})"
    path = resolve_model(cfg.model.source)
    reader = open_gguf(path)
    tok = Tokenizer.from_gguf(reader)
    tokens = tok.encode(text)
    n_chunks = cfg.n_chunks
    if n_chunks is None and cfg.compare_logits is not None:
        n_chunks = LogprobFile(cfg.compare_logits).n_chunks
    chunks = split_chunks(tokens, cfg.ctx, n_chunks, tok.bos_id if tok.add_bos else None)
    check_run(chunks, read_config(reader, **cfg.model.rope), batch=cfg.batch, logits_format=cfg.logits_format,
              save_logits=cfg.save_logits, compare_logits=cfg.compare_logits, force=cfg.force)  # before loading the weights
    model = load_model(reader, cfg.hardware.torch_dtype, cfg.hardware.device, **cfg.model.load)
    meta = {"text": source, "model": str(cfg.model.source), "hardware": dataclasses.asdict(cfg.hardware)}
    new_cache = lambda n: make_cache(cfg.cache, cfg.arena, model, n, cfg.batch, all_logits=True)  # one per chunk
    result = perplexity(model, chunks, batch=cfg.batch, make_cache=new_cache, save_logits=cfg.save_logits,
                        compare_logits=cfg.compare_logits, logits_format=cfg.logits_format, meta=meta,
                        progress=cfg.progress)
    c = model.cfg
    print(f"model       {path} ({c.arch}, {c.n_layers} layers, vocab {c.vocab_size}) | "
          f"{cfg.hardware.device} {cfg.hardware.dtype}", file=out)
    print(f"text        {source}: {len(text):,} chars, {len(tokens):,} tokens", file=out)
    print(result.summary(), file=out)
    if cfg.save_logits is not None:
        print(f"saved       {cfg.save_logits} ({cfg.logits_format} log-probs)", file=out)
    row = {**result.stats, "text": source, "text_tokens": len(tokens), "model_path": str(path),
           "config": dataclasses.asdict(cfg), "torch": torch.__version__, "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name(cfg.hardware.device)
           if torch.device(cfg.hardware.device).type == "cuda" else platform.processor() or platform.machine()}
    if cfg.out_json is not None:
        with open(cfg.out_json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


register_schema("ppl_schema", PplConfig)


@hydra.main(version_base=None, config_path="pkg://conf", config_name="ppl")
@errors.task
def _main(cfg: DictConfig) -> None:
    run(to_typed(cfg, PplConfig))


def main() -> None:
    errors.main("kvstream-ppl", _main, lambda: "interrupted: nothing saved (a log-prob file is written whole or not at all)")


if __name__ == "__main__":
    main()
