"""``kvstream-generate``: print a continuation of a prompt, then one stats line.

    kvstream-generate model=qwen2.5-coder-0.5b prompt="def quicksort(a):" max_new_tokens=64
    kvstream-generate hardware=h200 chat=true prompt="Write a binary search in C." sampling.temperature=0.7
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from kvstream.cli import errors
from kvstream.config import GenerateConfig, quote_free_text, to_typed
from kvstream.model.loader import open_gguf
from kvstream.model.qwen import load_model
from kvstream.model.registry import resolve_model
from kvstream.engine.runner import run_decode
from kvstream.model.stream_decoder import StreamDecoder
from kvstream.model.tokenizer import Tokenizer


# values taken literally: free text, and speculator chains (commas would read as a Hydra sweep)
FREE_TEXT = ("prompt", "system", "spec.type")


def run(cfg: GenerateConfig, out=sys.stdout) -> None:
    if not cfg.prompt and not cfg.chat:
        raise ValueError("prompt='': give a prompt of at least one character (or chat=true)")
    reader = open_gguf(resolve_model(cfg.model.source))
    tok = Tokenizer.from_gguf(reader)
    model = load_model(reader, cfg.hardware.torch_dtype, cfg.hardware.device, **cfg.model.load)
    text = cfg.prompt
    if cfg.chat:
        messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [{"role": "user", "content": text}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
    stream = StreamDecoder(tok)
    stop = () if cfg.ignore_eos else tok.eog_ids

    def show(t: int) -> None:
        if t not in stop:  # the end-of-generation marker is not part of the continuation
            out.write(stream.push(t))
            out.flush()

    r = run_decode(cfg, model, tok, tok.encode(text), on_token=show)
    out.write(stream.flush() + "\n")
    print(r.generation.stats.line(), file=out)
    layout = getattr(r.cache, "layout", None)
    if layout is not None:  # a paged cache: its arena's regions, as the decode phase laid them out
        regions = ", ".join(f"{k} {v:.1f}" for k, v in layout.mib().items() if k != "arena")
        print(f"arena: {layout.nbytes / 2**20:.1f} MiB ({regions} MiB); {r.cache.capacity} of "
              f"{r.cache.max_pages} pages/layer resident", file=out)
    for name, st in (r.chain.stats().items() if r.chain else ()):
        print(f"spec {name}: {st.calls} calls, {st.drafts} drafts, {st.drafted_tokens} drafted, "
              f"{st.accepted_tokens} accepted ({100 * st.acceptance_rate:.0f}%), {st.seconds:.2f} s", file=out)
    if r.control is not None:
        c = r.control
        print(f"draft: {c.bytes / 2**20:.1f} MiB pinned; capacity {c.capacity_with} pages/layer with it, "
              f"{c.capacity_without} without; {c.count('eject')} ejects, {c.count('reenable')} re-enables", file=out)
    if cfg.spec.synthetic_acceptance is not None:
        print(f"SYNTHETIC acceptance alpha={cfg.spec.synthetic_acceptance}: the tokens are not the target's", file=out)


@hydra.main(version_base=None, config_path="pkg://conf", config_name="generate")
@errors.task
def _main(cfg: DictConfig) -> None:
    run(to_typed(cfg, GenerateConfig))


def main() -> None:
    quote_free_text(sys.argv, FREE_TEXT)
    errors.main("kvstream-generate", _main, lambda: "interrupted: the generation stopped")


if __name__ == "__main__":
    main()
