"""speculators/device_draft: a device round's greedy pick and its p_min stop as a mask, against
the host path's rule (stop at the first top probability below p_min; nothing under n_min)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvstream.speculators.device_draft import pick, stop_mask


def host_rule(top: list[float], p_min: float, n_min: int) -> int:
    n = next((i for i, p in enumerate(top) if p < p_min), len(top))
    return n if n >= max(1, n_min) else 0


@pytest.mark.parametrize("n_min", [0, 1, 2, 3])
def test_the_mask_is_the_host_rules_prefix(n_min):
    """Every pattern of 4 probabilities above / below p_min: the mask is a prefix of the host
    rule's length (with p_min exactly met counting as above, as the host's ``p < p_min`` stop)."""
    for pattern in itertools.product([0.2, 0.5, 0.9], repeat=4):
        mask = stop_mask([torch.tensor(p) for p in pattern], 4, 0.5, n_min, torch.device("cpu"))
        n = host_rule(list(pattern), 0.5, n_min)
        assert mask.tolist() == [True] * n + [False] * (4 - n), pattern


def test_without_a_stop_every_token_counts_unless_the_draft_is_under_n_min():
    cpu = torch.device("cpu")
    assert stop_mask([], 3, 0.0, 0, cpu).tolist() == [True] * 3
    assert stop_mask([], 3, 0.0, 3, cpu).tolist() == [True] * 3
    assert stop_mask([], 3, 0.0, 4, cpu).tolist() == [False] * 3


def test_pick_is_the_argmax_and_its_probability_only_with_a_stop():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    t, p = pick(logits, 0.0)
    assert int(t) == 1 and p is None
    t, p = pick(logits, 0.3)
    assert int(t) == 1 and float(p) == pytest.approx(float(torch.softmax(logits, -1)[1]))


def test_pick_through_the_argmax_kernel_is_torchs_argmax():
    """With a drafter's scratch (CUDA; here the interpreter) the greedy pick is ``kernels.argmax``:
    torch.argmax's index exactly (the first of equal maxima, across the kernel's blocks), and the
    scratch is left ready for the chain's next step."""
    from kernels.argmax import BLOCK, scratch_for

    scratch = scratch_for("cpu")
    logits = torch.randn(2 * BLOCK + 7, generator=torch.Generator().manual_seed(5))
    logits[[BLOCK + 2, 2 * BLOCK + 3]] = 9.0  # equal maxima in two programs: the first wins
    for x in (logits, logits[:BLOCK]):
        t, p = pick(x, 0.0, scratch)
        assert t.shape == () and int(t) == int(torch.argmax(x)) and p is None
    assert scratch.tolist() == [torch.iinfo(torch.int64).min, 0]
    t, p = pick(logits, 0.3, scratch)  # with a stop: the softmax's maximum, as before
    assert int(t) == BLOCK + 2 and float(p) == pytest.approx(float(torch.softmax(logits, -1).max()))
