"""kernels.q8_rows against Q8.embedding's torch expression (the reference): bit for bit."""
import pytest
import torch

from kernels.q8_rows import q8_rows
from kvstream.model.weights import Q8


@pytest.mark.parametrize("k, n", [(64, 40), (896, 300), (1536, 257)])  # 2 blocks; the 0.5B's 28; the 1.5B's 48
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q8_rows_equal_the_torch_gather(device, gen, k, n, dtype):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    w = Q8.of(torch.randn(n, k, generator=gen) * 3)
    tokens = torch.tensor([0, n - 1, 5, 5, n // 2], dtype=torch.int64)
    want = w.embedding(tokens, dtype)  # on the CPU: the torch expression
    got = q8_rows(tokens.to(device), w.q.to(device), w.d.to(device), dtype).cpu()
    assert got.dtype == dtype and torch.equal(got, want)
    assert q8_rows(tokens[:0].to(device), w.q.to(device), w.d.to(device), dtype).shape == (0, k)


def test_q8_rows_rejects_bad_input(device):
    w = Q8.of(torch.randn(8, 64))
    q, d, t = w.q.to(device), w.d.to(device), torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"tokens must be int64 \[n\], got \(2,\) torch.int32"):
        q8_rows(t.int(), q, d, torch.float32)
    with pytest.raises(ValueError, match=r"int8 \[K/32, N, 32\] and fp16 \[K/32, N\], got \(2, 8, 32\) torch.int8 and \(2, 7\)"):
        q8_rows(t, q, d[:, :7].contiguous(), torch.float32)
    with pytest.raises(ValueError, match="must be contiguous"):
        q8_rows(torch.zeros(4, dtype=torch.int64, device=device)[::2], q, d, torch.float32)
