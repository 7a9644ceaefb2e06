"""Plain autoregressive generation: chunked prefill, then one token per decode step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvstream.engine.graphs import GraphedModel, warm_next_token, warm_widths
from kvstream.engine.readback import Readback
from kvstream.model.sampling import Sampler
from kvstream.telemetry import StepRecord


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    warm_s: float = 0.0  # compiling and capturing the decode widths (CUDA): setup, in neither of the above

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_s(self) -> float:
        # the first new token comes from the prefill's logits; decode steps make the rest
        steps = self.new_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s else float("nan")

    def line(self) -> str:
        warm = f" | warm-up {self.warm_s:.2f} s" if self.warm_s >= 0.005 else ""
        return (f"prompt {self.prompt_tokens} tok | prefill {self.prefill_tok_s:.1f} tok/s{warm} | "
                f"decode {self.new_tokens} tok, {self.decode_tok_s:.1f} tok/s")


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats
    stopped_on: int | None = None  # the end-of-generation token that stopped it, if any
    logits: list[torch.Tensor] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)  # one per decode step


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model, cache, prompt: list[int], chunk: int, observe=None, hidden=True) -> torch.Tensor:
    """Run the prompt through the model in chunks of ``chunk`` tokens; return the last logits [vocab].
    ``observe(h, next_tokens, start)``: each chunk's hidden states (an MTP head's rows; ``hidden``:
    which, as ``Qwen.body`` takes it)."""
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed to start decoding")
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
    for lo in range(0, len(prompt), chunk):
        if observe is None:
            logits = model(ids[lo:lo + chunk], cache)
        else:
            logits, h = model(ids[lo:lo + chunk], cache, hidden=hidden)
            observe(h, prompt[lo + 1:lo + chunk + 1], lo)
    return logits[-1]


def prefill_phase(model, cache, prompt: list[int], chunk: int, observe=None, hidden=True) -> tuple[torch.Tensor, float]:
    """The prefill phase, timed: the prompt in chunks (``observe``, ``hidden``: as ``prefill``), then the
    cache switches to decode. Returns the last logits [vocab] and the seconds it took (device
    synchronised)."""
    sync_device(model.device)
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt, chunk, observe, hidden)
    cache.set_phase("decode")
    sync_device(model.device)
    return logits, time.perf_counter() - t0


@torch.inference_mode()
def warm_up(model, cache, widths, *more: Callable[[], None]) -> float:
    """Compile and capture the decode ``widths`` (``warm_widths``, CUDA only) and run ``more``
    warm-ups; returns the seconds (device synchronised), reported apart from prefill and decode."""
    t0 = time.perf_counter()
    warm_widths(model, cache, widths)
    for f in more:
        f()
    sync_device(model.device)
    return time.perf_counter() - t0


@torch.inference_mode()
def generate(model, cache, prompt: list[int], max_new_tokens: int, sampler: Sampler, *,
             stop_ids: Iterable[int] = (), prefill_chunk: int = 512,
             on_token: Callable[[int], None] | None = None, keep_logits: bool = False,
             run_ahead: bool | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt``; stop early on any of ``stop_ids``.

    With ``run_ahead`` (default: on CUDA) the host runs one step ahead: the sampled token stays
    on the device and feeds the next step, which is queued before the host reads the token
    back, so the host's part of a step (the stop check, the cache's bookkeeping, the launches)
    overlaps the GPU's. A stop token read back then has one step queued after it: that step's
    row is rolled back (``cache.truncate``). Without it each token is read before the next
    step starts (on the CPU nothing overlaps, and a stop would cost a step).

    A greedy decode through a ``GraphedModel`` with a paged cache, logits not kept, runs each
    step as one graph that ends with the argmax and feeds the next (``GraphedModel.next_token``):
    the same tokens, with no eager kernel between steps."""
    stop = set(stop_ids)
    dev = model.device
    ahead = dev.type == "cuda" if run_ahead is None else run_ahead
    fused = (isinstance(model, GraphedModel) and sampler.params.greedy and not keep_logits
             and hasattr(cache, "plan_key"))
    logits, prefill_s = prefill_phase(model, cache, prompt, prefill_chunk)
    warm_s = warm_up(model, cache, [] if fused else [(1, False)],
                     *([lambda: warm_next_token(model, cache)] if fused else []))
    t1 = time.perf_counter()
    out: list[int] = []
    kept: list[torch.Tensor] = []
    records: list[StepRecord] = []
    stopped = None
    # token i's copy to the host: two buffers, since token i + 1's copy may start before token i is read
    readbacks = [Readback(dev, (), torch.long), Readback(dev, (), torch.long)]

    last = t1  # when the previous step was queued

    def sample(logits: torch.Tensor) -> torch.Tensor:
        if keep_logits:
            kept.append(logits.clone())
        return sampler(logits)  # on the device

    def step(tok: torch.Tensor, readback: Readback) -> torch.Tensor:
        """The next token after ``tok``, on the device (queued, not read); its copy to the host
        started on ``readback``."""
        nonlocal last
        if fused:  # the copy starts before the step's write-back, which it would otherwise wait behind
            nxt = model.next_token(cache, tok, readback)
        else:
            nxt = sample(model(tok.view(1), cache)[-1])
            readback.start(nxt.view(()))
        now = time.perf_counter()
        # wall time since the previous step was queued: it includes the read-back of the token in
        # between, so with the host a step ahead it is, in steady state, the device's step time
        # (the host's own time per step would hide the device's); without run-ahead the whole step
        records.append(StepRecord.of(len(records), cache, 1, now - last))
        last = now
        return nxt

    tok = sample(logits)
    readbacks[0].start(tok.view(()))
    while len(out) < max_new_tokens:  # (0: no token at all)
        queued = ahead and len(out) + 1 < max_new_tokens  # a next step is needed unless this token stops
        if queued:
            tok = step(tok, readbacks[(len(out) + 1) % 2])
        t = int(readbacks[len(out) % 2].read())
        out.append(t)
        if on_token is not None:
            on_token(t)
        if t in stop or len(out) == max_new_tokens:
            if t in stop:
                stopped = t
            if queued:  # the step queued after a stop token: its row is not part of the output
                records.pop()
                if keep_logits:
                    kept.pop()
                cache.truncate(cache.length - 1)
            break
        if not queued:
            tok = step(tok, readbacks[len(out) % 2])
    sync_device(dev)
    t2 = time.perf_counter()
    return Generation(out, GenerationStats(len(prompt), len(out), prefill_s, t2 - t1, warm_s), stopped, kept,
                      records)
