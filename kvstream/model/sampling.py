"""Token sampling with llama.cpp's semantics, seeded and reproducible.

The chain is llama.cpp's default order: top-k, top-p, min-p, temperature, then a draw.
top-p and min-p look at the distribution *before* temperature (as in llama.cpp, where the
temperature sampler comes last). A knob at its neutral value is skipped: ``top_k <= 0``,
``top_p >= 1``, ``min_p <= 0``. ``temperature <= 0`` is greedy (argmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [vocab] (fp32) -> (candidate logits sorted descending, their token ids), after
    top-k, top-p and min-p, with at least one candidate kept; temperature not yet applied."""
    if p.top_k > 0:
        vals, ids = torch.topk(logits, min(p.top_k, logits.shape[-1]))
    else:
        vals, ids = torch.sort(logits, descending=True)
    keep = torch.ones_like(vals, dtype=torch.bool)
    if p.top_p < 1.0:
        cum = torch.softmax(vals, -1).cumsum(-1)
        # keep through the first token at which the cumulative mass reaches top_p
        keep &= (cum - torch.softmax(vals, -1)) < p.top_p
    if p.min_p > 0.0:
        keep &= vals >= vals[0] + math.log(p.min_p)
    keep[0] = True
    return vals.masked_fill(~keep, float("-inf")), ids


class Sampler:
    """Draws tokens from logits; owns a seeded generator so a run is reproducible."""

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        self.params = params
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(params.seed)

    def probs(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final distribution over candidates: (probabilities, token ids)."""
        vals, ids = filter_logits(logits.float(), self.params)
        return torch.softmax(vals / self.params.temperature, -1), ids

    def dense(self, logits: torch.Tensor) -> torch.Tensor:
        """The final distribution over the whole vocabulary [vocab] (one-hot when greedy)."""
        out = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
        if self.params.greedy:
            return out.index_fill_(0, logits.argmax(-1, keepdim=True), 1.0)
        probs, ids = self.probs(logits)
        return out.scatter_(0, ids, probs)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> token id as a 0-d int64 tensor on the logits' device (no host sync)."""
        if self.params.greedy:
            return logits.argmax(-1)
        probs, ids = self.probs(logits)
        return ids[torch.multinomial(probs, 1, generator=self.generator)[0]]
