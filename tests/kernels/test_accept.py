"""kernels.accept against reference.accept (the torch expression the engine ran): the same counts,
argmaxes and kept rows, exactly (integers), for every acceptance pattern, greedy and synthetic."""
import itertools

import pytest
import torch

from kernels import reference
from kernels.accept import BLOCK, accept, scratch_for

V = 2 * BLOCK + 77  # three programs a row, the last partial


def verify(n, pattern, gen, nan_row=None):
    """Logits [1 + n, V] and n drafted tokens: token i is row i's argmax where ``pattern[i]``, else another."""
    logits = torch.randn(n + 1, V, generator=gen)
    top = logits.argmax(-1)
    tokens = torch.where(torch.tensor(pattern), top[:n], (top[:n] + 1) % V)
    if nan_row is not None:
        logits[nan_row, [5, BLOCK + 9]] = float("nan")  # the first NaN is the row's argmax
    return logits, tokens


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_accept_equals_the_reference_for_every_pattern(device, gen, n):
    scratch = scratch_for(16, device)
    for pattern in itertools.islice(itertools.product([True, False], repeat=n), 24):
        for cut in (n, n // 2):  # valid: all, or a prefix (the p_min stop)
            logits, tokens = verify(n, pattern, gen, nan_row=n // 2 if cut == n else None)
            valid = torch.arange(n) < cut
            want = reference.accept(logits, tokens, valid)
            got = accept(logits.to(device), tokens.to(device), valid.to(device), None, scratch)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (pattern, cut)
    assert scratch[0] == 0 and (scratch[1:] == torch.iinfo(torch.int64).min).all()  # as made: replays reuse it


def test_synthetic_acceptance_keeps_what_its_draws_say(device, gen):
    n = 5
    scratch = scratch_for(n + 1, device)
    logits, tokens = verify(n, [False] * n, gen)  # no token is the argmax: only the draws keep them
    for keep in ([True] * 5, [True, True, False, True, True], [False] * 5):
        keep, valid = torch.tensor(keep), torch.ones(n, dtype=torch.bool)
        want = reference.accept(logits, tokens, valid, keep)
        got = accept(logits.to(device), tokens.to(device), valid.to(device), keep.to(device), scratch)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert int(want[0][0]) == 0 and want[1].tolist() == [int(want[0][2 + n])] * (n + 1)


def test_accept_writes_the_buffers_it_is_given_and_rejects_bad_input(device, gen):
    logits, tokens = verify(3, [True, False, True], gen)
    logits, tokens, valid = logits.to(device), tokens.to(device), torch.ones(3, dtype=torch.bool, device=device)
    result, kept = torch.zeros(9, dtype=torch.int64, device=device), torch.zeros(4, dtype=torch.int64, device=device)
    scratch = scratch_for(4, device)
    got = accept(logits, tokens, valid, None, scratch, result, kept)
    assert got[0] is result and got[1] is kept
    assert int(result[0]) == 1 and kept[0] == tokens[0]
    with pytest.raises(ValueError, match=r"fp32 logits \[1 \+ n, V\].*for 2 tokens"):
        accept(logits, tokens[:2], valid[:2], None, scratch)
    with pytest.raises(ValueError, match=r"scratch must be int64 \[>= 5\]"):
        accept(logits, tokens, valid, None, scratch[:3])


def test_accept_at_the_real_vocabulary(device, gen):
    """Qwen2.5's 151936 logits a row (38 programs each), four drafts, the second one rejected."""
    n, vocab = 4, 151936
    logits = torch.randn(n + 1, vocab, generator=gen)
    top = logits.argmax(-1)
    tokens = top[:n].clone()
    tokens[1] = (tokens[1] + 1) % vocab
    valid = torch.ones(n, dtype=torch.bool)
    want = reference.accept(logits, tokens, valid)
    got = accept(logits.to(device), tokens.to(device), valid.to(device), None, scratch_for(n + 1, device))
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]) and int(want[0][0]) == 1
