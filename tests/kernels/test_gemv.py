"""kernels/gemv.py against the fp32 product, on CUDA or under the Triton interpreter."""
import pytest
import torch

from kernels.gemv import Launch, gemv, launch_for

from tests.kernels.conftest import DEVICE


def _reference(x, w, bias):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _check(out, x, w, bias):
    """The kernel sums K fp32 products in another order than fp64, then rounds once: within one
    ulp of the output dtype of the exact value (plus fp32's sum error, ~K ulp of fp32, far below)."""
    ref = _reference(x, w, bias)
    ulp = torch.finfo(out.dtype).eps * ref.abs().clamp_min(torch.finfo(out.dtype).tiny)
    err = (out.double() - ref).abs()
    assert (err <= ulp + 1e-5 * ref.abs().max()).all(), f"max error {err.max():.3g}, ulp {ulp.max():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, N, K", [(1, 40, 96), (5, 24, 160), (8, 9, 64)])
def test_gemv_matches_the_exact_product(dtype, n, N, K):
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    g = torch.Generator().manual_seed(n * N + K)
    w = (torch.randn(N, K, generator=g) * (0.5 + torch.rand(N, 1, generator=g))).to(dtype).to(DEVICE)
    wide = torch.randn(n, K + 16, generator=g).to(dtype)
    x = wide[:, :K].to(DEVICE)  # strided rows, as the model's sliced activations are
    bias = torch.randn(N, generator=g).to(dtype).to(DEVICE)
    for b in (None, bias):
        out = gemv(x, w, b)
        assert out.dtype == dtype and out.shape == (n, N)
        _check(out, x, w, b)


@pytest.mark.parametrize("block_n, block_k", [(1, 16), (4, 32), (8, 64), (16, 256)])
def test_tiles_and_k_loop(block_n, block_k):
    """Column blocks that do not divide N, K tiles that do not divide K (the loop's prefetch of the
    next tile masked off at the end), one tile covering all of K."""
    x = torch.randn(3, 200).to(DEVICE)
    w, b = torch.randn(37, 200).to(DEVICE), torch.randn(37).to(DEVICE)
    _check(gemv(x, w, b, launch=Launch(block_n, block_k, 4)), x, w, b)


def test_launch_rule_gives_the_sweeps_fastest_for_the_1_5b():
    """results/kernels/gemv/sweep.csv's fastest launch per matrix (H200, one row, PDL)."""
    assert launch_for(2048, 1536) == Launch(4, 2048, 8)  # Q/K/V
    assert launch_for(1536, 1536) == Launch(4, 2048, 8)  # output (8 columns: 2.44 against 2.54 us)
    assert launch_for(17920, 1536) == Launch(4, 1024, 4)  # gate/up
    assert launch_for(1536, 8960) == Launch(2, 2048, 8)  # down
    assert launch_for(100, 64) == Launch(4, 64, 4)  # a K below one tile: one tile of it


@pytest.mark.parametrize("x, w, bias, match", [
    (torch.randn(9, 8), torch.randn(4, 8), None, "1 to 8 rows"),
    (torch.randn(2, 8), torch.randn(4, 6), None, r"w must be \[N, 8\]"),
    (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3), r"bias must be contiguous \[4\]"),
    (torch.randn(8, 2).T, torch.randn(4, 8), None, "contiguous rows"),
    (torch.randn(2, 8).long(), torch.randn(4, 8), None, "x must be"),
])
def test_bad_input_one_line(x, w, bias, match):
    with pytest.raises(ValueError, match=match):
        gemv(x, w, bias)
