"""kernels.argmax against torch.argmax (the plain reference): the same index, exactly."""
import pytest
import torch

from kernels.argmax import BLOCK, argmax, scratch_for


def cases(gen):
    """(name, vector): random sizes around the block, ties, signs, zeros, NaN, infinities."""
    r = lambda n: torch.randn(n, generator=gen)
    tie = r(3 * BLOCK + 5)
    tie[[7, BLOCK + 1, 3 * BLOCK + 4]] = 40.0  # the first of three equal maxima, in three programs
    zeros = torch.zeros(2 * BLOCK)
    zeros[:5] = -0.0  # -0.0 first: equal to +0.0, so index 0
    nan = r(2 * BLOCK)
    nan[[BLOCK + 3, 9]] = float("nan")  # any NaN is largest: the first one
    inf = r(BLOCK + 1)
    inf[[BLOCK, 12]] = float("inf")
    neg = -r(151936).abs() - 1.0  # all negative (the reset key must sit below them all)
    return [("one", r(1)), ("block", r(BLOCK)), ("block+1", r(BLOCK + 1)), ("vocab", r(151936)), ("tie", tie),
            ("zeros", zeros), ("nan", nan), ("inf", inf), ("negative", neg), ("-inf", torch.full((300,), -float("inf")))]


def test_argmax_equals_torch_and_resets_its_scratch(device, gen):
    scratch = scratch_for(device)
    for name, x in cases(gen):
        x = x.to(device)
        for _ in range(2):  # a second launch on the scratch the first left
            assert int(argmax(x, scratch)) == int(torch.argmax(x)), name
    assert scratch.tolist() == [torch.iinfo(torch.int64).min, 0]
    out = torch.full((1,), -1, dtype=torch.int64, device=device)
    assert argmax(cases(gen)[4][1].to(device), scratch, out=out) is out and int(out) == 7


def test_argmax_rejects_bad_input(device):
    s = scratch_for(device)
    with pytest.raises(ValueError, match=r"contiguous fp32 \[n\].*\(2, 3\)"):
        argmax(torch.zeros(2, 3, device=device), s)
    with pytest.raises(ValueError, match="contiguous fp32.*torch.float16"):
        argmax(torch.zeros(8, dtype=torch.float16, device=device), s)
    with pytest.raises(ValueError, match=r"scratch must be int64 \[2\]"):
        argmax(torch.zeros(8, device=device), torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"out must be int64 \[1\]"):
        argmax(torch.zeros(8, device=device), s, out=torch.zeros(1, device=device))
