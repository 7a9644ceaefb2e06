"""What the drafters that draft on the device share (``DraftModel`` and ``MTPDraft``): a draft
step's greedy pick and the ``p_min`` stop as a mask, both inside a round's captured chain, so a
round's device work after its launch needs no eager kernel from the host."""

from __future__ import annotations

import torch

from kernels.argmax import argmax


def pick(logits: torch.Tensor, p_min: float, scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(greedy token, its softmax probability or None when ``p_min`` is 0) of a step's last
    logits [V]; without a stop the argmax alone (a softmax over the vocabulary costs ~30 us a
    step), by ``kernels.argmax`` where the drafter gives its ``scratch`` (``kernels.argmax.scratch_for``,
    CUDA; made with the drafter, not in a chain's capture, whose allocations are the graph's):
    torch.argmax's index in one launch, where torch's reduction took ~10 us a step over a head's
    32768 logits on the H100 (``results/round/ahead_session14``)."""
    if p_min > 0:
        p, t = torch.softmax(logits.float(), -1).max(-1)
        return t, p
    if scratch is not None and logits.dim() == 1 and logits.dtype == torch.float32 and logits.is_contiguous():
        return argmax(logits, scratch)[0], None
    return logits.argmax(-1), None


def stop_mask(top: list[torch.Tensor], n: int, p_min: float, n_min: int, device: torch.device) -> torch.Tensor:
    """The ``p_min`` stop over a round's ``n`` drafted tokens as a bool mask [n]: the prefix
    whose top probabilities are all >= p_min (every token when ``top`` is empty: no stop),
    none at all when that prefix is shorter than ``max(1, n_min)``."""
    if not top:
        return torch.full((n,), n >= max(1, n_min), dtype=torch.bool, device=device)
    valid = torch.cumprod((torch.stack(top) >= p_min).int(), 0)
    return (valid * (valid.sum() >= max(1, n_min))).bool()
