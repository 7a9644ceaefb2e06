"""The fused RoPE + quantize-on-store kernel (kernels/rope_store.py) against the two kernels it
replaces (``rope`` then ``store`` for K and V) and against the plain-torch reference."""
import pytest
import torch

from kernels import reference
from kernels.formats import PAGE_TOKENS, PageFormat
from kernels.rope import rope
from kernels.rope_store import rope_store
from kernels.store import store

from tests.kernels.conftest import DEVICE

PAIRS = [("q8_0", "q4_0"), ("f16", "f16"), ("q4_0", "q8_0")]


def _case(dtype, n, n_heads, h, d, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(n, (n_heads + 2 * h) * d, generator=g)).to(dtype).to(DEVICE)
    qk = qkv[:, :(n_heads + h) * d].view(n, n_heads + h, d)  # strided views of the fused output, as the model's
    v = qkv[:, (n_heads + h) * d:].view(n, h, d)
    pos = torch.tensor([7, 0, 40000, 300, 5][:n], device=DEVICE)
    inv_freq, _ = reference.rope_inv_freq(d, 1e6, DEVICE)
    slots = torch.randperm(3 * PAGE_TOKENS, generator=g)[:n].to(DEVICE)
    if n > 2:
        slots[1] = -1  # a skipped row: its q is still rotated, its K / V not stored
    return qk, v, pos, inv_freq, slots, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("types", PAIRS)
@pytest.mark.parametrize("n, n_heads, h, d", [(1, 12, 2, 128), (3, 3, 1, 64), (5, 4, 2, 64)])
def test_rope_store_equals_rope_then_store(dtype, types, n, n_heads, h, d):
    k_fmt, v_fmt = (PageFormat(t, h, d) for t in types)
    qk, v, pos, inv_freq, slots, g = _case(dtype, n, n_heads, h, d, seed=n * d + h)
    scale = 1.0 if n != 3 else 1.1386  # YaRN's attention factor at factor 4
    pools = [torch.randint(0, 256, (3, f.page_bytes), dtype=torch.uint8, generator=g).to(DEVICE)
             for f in (k_fmt, v_fmt)]
    want = [p.clone() for p in pools]
    pools_before = [p.clone() for p in pools]
    rotated = rope(qk, pos, inv_freq, scale)
    store(want[0], rotated[:, n_heads:].contiguous(), slots, k_fmt)
    store(want[1], v.contiguous(), slots, v_fmt)
    q = rope_store(qk, v, pos, inv_freq, *pools, slots, k_fmt, v_fmt, scale)
    # the same instructions in one launch, compiled alike (no FMA contraction): q and every pool
    # byte (untouched ones too) identical
    assert torch.equal(q, rotated[:, :n_heads])
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    # and the torch reference: cos / sin of another library may differ by an ulp before their rounding,
    # which can move a rounded product by one unit of the rows' dtype (and a quant by one level)
    ref_pools = [p.cpu().clone() for p in pools_before]
    ref_q = reference.rope_store(qk.cpu(), v.cpu(), *reference.rope_angles(pos.cpu(), inv_freq.cpu(), dtype, scale),
                                 *(p.cpu() for p in ref_pools), slots.cpu(), k_fmt, v_fmt)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(q.cpu(), ref_q, rtol=tol, atol=tol)
    # V is stored, not rotated: its bytes are the reference's exactly; K's can move by a level where a
    # rounded product moved: a few bytes. (The interpreter's fp32 -> bf16 conversion truncates where
    # CUDA and torch round, kernels/NOTES.md, so its bf16 K rows are not the reference's.)
    assert torch.equal(ref_pools[1], pools[1].cpu())
    if not (dtype == torch.bfloat16 and DEVICE.type == "cpu"):
        written = (want[0] != pools_before[0]).sum()  # the K bytes the store wrote (but for chance equal ones)
        assert (ref_pools[0] != pools[0].cpu()).sum() <= 0.02 * written


def test_rope_store_rejects_bad_shapes():
    k_fmt = v_fmt = PageFormat("q8_0", 2, 64)
    qk, v, pos, inv_freq, slots, g = _case(torch.float16, 2, 4, 2, 64, seed=1)
    pools = [torch.zeros(3, k_fmt.page_bytes, dtype=torch.uint8, device=DEVICE)] * 2
    with pytest.raises(ValueError, match=r"v must be \[2, 2, 64\]"):
        rope_store(qk, v[:, :1], pos, inv_freq, *pools, slots, k_fmt, v_fmt)
    with pytest.raises(ValueError, match=r"qk must be \[n, n_heads \+ 2, 64\]"):
        rope_store(qk[:, :2], v, pos, inv_freq, *pools, slots, k_fmt, v_fmt)
    with pytest.raises(ValueError, match="slots must be contiguous int64"):
        rope_store(qk, v, pos, inv_freq, *pools, slots.int(), k_fmt, v_fmt)
