"""experiments.mtp_acceptance: greedy decoding with an MTP head drafting equals plain greedy decoding."""

import pytest
import torch

from experiments.mtp_acceptance import mtp_greedy, plain_greedy
from kvstream.model.mtp import MTPHead
from kvstream.model.qwen import load_model
from tiny_gguf import write_tiny_model


@pytest.mark.parametrize("k", [1, 3])
def test_drafting_with_the_head_keeps_the_greedy_output(tmp_path, k):
    target = load_model(write_tiny_model(tmp_path / "m.gguf"))
    head = MTPHead(target, seed=1)  # untrained: mostly rejected drafts, rollback exercised every round
    prompt = torch.randint(0, target.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    out, accepted = mtp_greedy(target, head, prompt, 30, k)
    assert out == plain_greedy(target, prompt, 30)
    assert all(0 <= a <= k for a in accepted) and len(accepted) <= 30


def test_a_head_that_copies_the_target_is_always_accepted(tmp_path, monkeypatch):
    """A head whose drafts are the target's own greedy tokens: every draft accepted, k + 1 tokens a round."""
    target = load_model(write_tiny_model(tmp_path / "m.gguf"))
    head = MTPHead(target, seed=1)
    prompt = torch.randint(0, target.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    plain = plain_greedy(target, prompt, 41)
    real_draft = head.draft

    def oracle(h, tokens, pos, k, kv):
        real_draft(h, tokens, pos, k, kv)  # keeps the head's cache bookkeeping real
        n = int(pos[-1]) - len(prompt) + 1  # tokens generated so far
        return torch.tensor(plain[n:n + k])

    monkeypatch.setattr(head, "draft", oracle)
    out, accepted = mtp_greedy(target, head, prompt, 41, 4)
    assert out == plain and accepted == [4] * 8
