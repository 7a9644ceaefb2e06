"""Page gather: kernel vs reference (exact), sparse/permuted pages, lengths, rejects."""
import pytest
import torch

from kernels import reference
from kernels.formats import PAGE_TOKENS, PageFormat
from kernels.gather import gather

CASES = [  # (type, head_dim, n_kv_heads, n_tokens, out dtype)
    ("f16", 64, 2, 1, torch.float16),
    ("q8_0", 128, 1, 255, torch.float32),
    ("q4_0", 64, 3, 256, torch.float16),
    ("q8_0", 64, 2, 257, torch.float16),
    ("q4_0", 128, 2, 3001, torch.float32),
    ("f16", 128, 1, 700, torch.float32),
    ("q8_0", 64, 1, 513, torch.bfloat16),
    ("q4_0", 64, 1, 300, torch.bfloat16),
]


@pytest.mark.parametrize("t,head_dim,n_kv_heads,n_tokens,dtype", CASES)
def test_gather_matches_reference(t, head_dim, n_kv_heads, n_tokens, dtype, make_pool, gen, device):
    fmt = PageFormat(t, n_kv_heads, head_dim)
    n_pages = -(-n_tokens // PAGE_TOKENS)
    pool = make_pool(fmt, 2 * n_pages + 1)
    ids = torch.randperm(pool.shape[0], generator=gen)[:n_pages].int().to(device)  # sparse, permuted
    got = gather(pool, ids, n_tokens, fmt, dtype)
    want = reference.gather(pool.cpu(), ids.cpu(), n_tokens, fmt, dtype)
    assert got.shape == (n_tokens, n_kv_heads, head_dim) and got.dtype == dtype
    if dtype == torch.bfloat16 and device.type == "cpu":
        # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): <= 1 bf16 ulp
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=0)
    else:  # exact: dequantization is exact in fp32, then one rounding to dtype on both sides
        assert torch.equal(got.cpu(), want)


def test_gather_into_strided_out(make_pool, device):
    fmt = PageFormat("q8_0", 2, 64)
    pool = make_pool(fmt, 2)
    ids = torch.tensor([1, 0], dtype=torch.int32, device=device)
    kv = torch.zeros(300, 2, 2, 64, dtype=torch.float16, device=device)  # [T, K|V, H, D]
    gather(pool, ids, 300, fmt, out=kv[:, 0])
    assert torch.equal(kv[:, 0].cpu(), reference.gather(pool.cpu(), ids.cpu(), 300, fmt))
    assert not kv[:, 1].any(), "only the out view may be written"


def test_gather_rejects_bad_inputs(device):
    fmt = PageFormat("q4_0", 2, 64)
    pool = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8, device=device)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="page_ids must be contiguous int32"):
        gather(pool, ids.long(), 300, fmt)
    with pytest.raises(ValueError, match=r"\[>= 2\] for 300 tokens"):
        gather(pool, ids[:1], 300, fmt)
    with pytest.raises(ValueError, match="dtype must be one of"):
        gather(pool, ids, 300, fmt, torch.int8)
    with pytest.raises(ValueError, match=r"out must be .* \[300, 2, 64\]"):
        gather(pool, ids, 300, fmt, out=torch.empty(300, 2, 128, device=device)[..., ::2])
    with pytest.raises(ValueError, match=rf"pool must be uint8 \[n_pages, {fmt.page_bytes}\]"):
        gather(pool.view(torch.int8), ids, 300, fmt)


@pytest.mark.bigmem
@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_gather_past_2gib(t, big_pool, make_pool, device):
    fmt = PageFormat(t, 1, 64)
    pool, ids = big_pool(fmt)
    ids = torch.tensor([ids[-1], 3, ids[0]], dtype=torch.int32, device=device)
    pool[ids.long()] = make_pool(fmt, 3)
    got = gather(pool, ids, 700, fmt, torch.float32)
    want = reference.gather(pool[ids.long()].cpu(), torch.arange(3), 700, fmt, torch.float32)
    assert torch.equal(got.cpu(), want)
