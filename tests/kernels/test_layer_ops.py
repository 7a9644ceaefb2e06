"""The fused layer kernels (kernels/rms_norm.py, rope.py, swiglu.py) against their plain-torch
references in kernels/reference.py, on CUDA or under the Triton interpreter."""
import pytest
import torch

from kernels import reference
from kernels.rms_norm import add_rms_norm
from kernels.rope import rope
from kernels.swiglu import silu_mul

from tests.kernels.conftest import DEVICE

# fp32: the kernels compute what the reference computes in the same precision; only the order
# of the variance's fp32 sum differs (kernel: a tree, torch: its own), a few ulp of rstd.
# fp16: every rounding of the reference happens at the same place in the kernel; a different
# fp32 sum order or cos/sin ulp can move a value across a rounding boundary: 1 fp16 ulp at |x|~4.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=4e-3)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, hidden", [(1, 64), (3, 96), (5, 1536)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_reference(dtype, n, hidden, with_delta):
    g = _gen(n + hidden)
    wide = torch.randn(n, hidden + 32, generator=g).to(dtype)
    x = wide[:, :hidden].to(DEVICE)  # strided rows: a view, as the model's sliced rows are
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    delta = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE) if with_delta else None
    s, y = add_rms_norm(x, w, 1e-6, delta)
    s_ref, y_ref = reference.add_rms_norm(x, w, 1e-6, delta)
    assert torch.equal(s, s_ref)  # one rounding of the same fp32 sum
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, hidden", [(1, 96), (2, 896)])
def test_add_rms_norm_q8_writes_ys_blocks(dtype, n, hidden):
    """``q8``: the same (s, y), and y's q8_0 blocks exactly as gguf's codec makes them from y (896 = 28
    blocks in a 1024-wide program: the masked tail writes nothing)."""
    g = _gen(hidden)
    x = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE)
    x[0, :32] = 0  # a zero block of y: scale 0
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    delta = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE)
    s, y, (yq, yd) = add_rms_norm(x, w, 1e-6, delta, q8=True)
    s0, y0 = add_rms_norm(x, w, 1e-6, delta)
    assert torch.equal(s, s0) and torch.equal(y, y0)
    ref_q, ref_d = reference.q8_rows(y.cpu())
    assert torch.equal(yq.cpu(), ref_q) and torch.equal(yd.cpu(), ref_d)


def test_add_rms_norm_rejects_bad_shapes():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"w \[hidden\]"):
        add_rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="delta must be contiguous"):
        add_rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, torch.zeros(2, 16, device=DEVICE)[:, ::2])
    with pytest.raises(ValueError, match="q8 blocks need hidden a multiple of 32, got 8"):
        add_rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, q8=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, heads, d", [(1, 3, 64), (4, 14, 128), (2, 16, 64)])
def test_rope_matches_reference(dtype, n, heads, d):
    g = _gen(heads * d)
    qkv = torch.randn(n, (heads + 2) * d, generator=g).to(dtype).to(DEVICE)
    x = qkv[:, :heads * d].view(n, heads, d)  # q and k heads: a strided view of the fused output
    pos = torch.tensor([0, 7, 300, 40000][:n] if n <= 4 else list(range(n)), device=DEVICE)
    inv_freq = (1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))).to(DEVICE)
    out = rope(x, pos, inv_freq)
    ref = reference.rope(x, *reference.rope_angles(pos, inv_freq, dtype))
    assert out.is_contiguous() and out.shape == x.shape
    # angles up to 40000 rad: fp32 cos/sin of the kernel and of torch agree to a few 1e-7
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_rope_rejects_odd_shapes():
    with pytest.raises(ValueError, match="power of two"):
        rope(torch.zeros(1, 2, 12, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
             torch.zeros(6, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, ffn", [(1, 64), (3, 1500), (2, 2048)])
def test_silu_mul_matches_reference(dtype, n, ffn):
    gu = (3 * torch.randn(n, 2 * ffn, generator=_gen(ffn))).to(dtype).to(DEVICE)
    torch.testing.assert_close(silu_mul(gu), reference.silu_mul(gu), **TOL[dtype])
