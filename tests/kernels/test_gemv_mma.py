"""kernels/gemv_mma.py against the exact product and against gemv + silu_mul, on CUDA or under the
Triton interpreter."""
import pytest
import torch

from kernels.gemv_mma import Launch, gemv_mma

from tests.kernels.conftest import DEVICE


def _check(out, x, w, bias):
    """Products of bf16 / fp16 values (and fp32 ones in an ``ieee`` dot) are exact in fp32; the K
    sums then err by at most one fp32 ulp per addition: 2^-23 of the running magnitude (the tensor
    cores' adders may truncate, hence a whole ulp, twice gemv's round-to-nearest bound), plus one
    rounding to the output dtype (an ulp where the sum's error crosses a rounding boundary)."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    mags = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = torch.finfo(out.dtype).eps * ref.abs() + (x.shape[1] + 1) * 2.0 ** -23 * mags
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} against {bound[err > bound].min():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, N, K, launch", [(2, 40, 96, None), (5, 24, 160, Launch(16, 32, 4, 2)),
                                             (16, 9, 64, Launch(32, 16, 4, 1)), (1, 70, 300, Launch(64, 64, 4, 3)),
                                             (3, 40, 300, Launch(16, 32, 4, 2, split=4)),
                                             (5, 24, 100, Launch(16, 64, 4, 2, split=8))])
def test_gemv_mma_matches_the_exact_product(dtype, n, N, K, launch):
    """Column blocks past N, K tiles that do not divide K (the masked last tile), one tile for all of K;
    K split among programs (300 = 3 shares of 3 tiles and a last of 1; split 8 of 2 tiles: 2 shares)."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    g = torch.Generator().manual_seed(n * N + K)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(n, K + 8, generator=g).to(dtype)[:, :K].to(DEVICE)  # strided rows, as a verify's slices
    bias = torch.randn(N, generator=g).to(dtype).to(DEVICE)
    for b in (None, bias):
        out = gemv_mma(x, w, b, launch=launch)
        assert out.dtype == dtype and out.shape == (n, N)
        _check(out, x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, F, launch", [(3, 40, None), (16, 23, Launch(32, 32, 4, 2)),
                                          (5, 23, Launch(16, 16, 4, 2, split=3))])
def test_glu_equals_the_matmul_then_silu_mul(dtype, n, F, launch):
    """The fused epilogue (or the split sum's) rounds each sum to the dtype, then ``silu_times``: the bytes
    of gemv_mma then silu_mul with the same tiles and splits (so each sum's order is the same)."""
    from kernels.swiglu import silu_mul

    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    g = torch.Generator().manual_seed(n + F)
    w = torch.randn(2 * F, 96, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(n, 96, generator=g).to(dtype).to(DEVICE)
    fused, apart = gemv_mma(x, w, glu=True, launch=launch), silu_mul(gemv_mma(x, w, launch=launch))
    if DEVICE.type == "cuda":
        assert torch.equal(fused, apart)
    else:  # the interpreter's tl.dot is numpy's matmul, whose BLAS picks its summation order by the tile's
        # shape (the glu launch loads gate and up together): on some CPUs the sums differ in their last
        # fp32 bits (seen: 78 of 120 values, at most 6e-5 on sums of ~10), which silu_mul keeps: 4 ulps
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(fused, apart, rtol=4 * eps, atol=4 * eps * float(apart.abs().max()))


@pytest.mark.parametrize("x, w, kw, match", [
    (torch.randn(17, 8), torch.randn(4, 8), {}, "1 to 16 rows"),
    (torch.randn(2, 8), torch.randn(4, 6), {}, r"w must be \[N, 8\]"),
    (torch.randn(2, 8), torch.randn(4, 8).half(), {}, "in x's torch.float32"),
    (torch.randn(2, 8), torch.randn(4, 8), {"bias": torch.randn(3)}, r"bias must be contiguous \[4\]"),
    (torch.randn(2, 8), torch.randn(5, 8), {"glu": True}, "even number of weight rows"),
    (torch.randn(2, 8), torch.randn(4, 8), {"launch": Launch(8, 16, 4, 1)}, "block_n and block_k >= 16"),
    (torch.randn(2, 8), torch.randn(4, 8), {"launch": Launch(16, 16, 4, 1, split=0)}, "split must be >= 1"),
])
def test_bad_input_one_line(x, w, kw, match):
    with pytest.raises(ValueError, match=match):
        gemv_mma(x, w, **kw)


def test_launch_rule_stays_near_the_sweeps_fastest_for_the_1_5b():
    """results/kernels/gemv_mma/sweep.csv (H200, five rows, PDL): the rule's launch per matrix, each
    within 2.3% of that sweep's fastest (Q/K/V 4.64 against 4.54 us, gate/up 16.85 against 16.70)."""
    from kernels.gemv_mma import launch_for

    assert launch_for(2048, 1536) == Launch(64, 256, 4, 4)  # Q/K/V
    assert launch_for(1536, 1536) == Launch(64, 256, 4, 4)  # output: the fastest
    assert launch_for(17920, 1536) == Launch(64, 128, 4, 2)  # gate/up
    assert launch_for(1536, 8960) == Launch(64, 256, 4, 4)  # down: the fastest (the model keeps cuBLAS there)
    assert launch_for(100, 40) == Launch(64, 64, 4, 4)  # a K below one tile: one tile of it
    assert launch_for(2048, 1536, itemsize=4) == Launch(64, 128, 4, 4)  # fp32: the same shared memory


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@CUDA
def test_fp32_at_the_rules_launches_fits_and_matches():
    """fp32 (the CUDA tests' dtype) at the 1.5B's gate/up and down shapes: the rule's halved K tiles
    fit the SM's shared memory (the 16-bit widths needed 240 KB) and the products stay exact."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K, glu in ((17920, 1536, True), (1536, 8960, False)):
        w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
        x = torch.randn(5, K, device="cuda", generator=g)
        out = gemv_mma(x, w, glu=glu)
        if glu:
            from kernels.swiglu import silu_mul

            assert torch.equal(out, silu_mul(gemv_mma(x, w)))
        else:
            _check(out, x, w, None)


@CUDA
@pytest.mark.parametrize("kernel", ["gemv", "gemv_mma"])
def test_weights_past_2_31_elements(kernel):
    """W of 2^31 + 2^14 bf16 values (4.3 GB): the last rows' addresses pass int32 (row offsets are
    int64). Only the last 64 rows are non-zero; their outputs against the fp64 product."""
    from kernels.gemv import gemv

    N, K = (1 << 20) + 8, 2048
    w = torch.zeros(N, K, device="cuda", dtype=torch.bfloat16)
    w[-64:] = torch.randn(64, K, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1 if kernel == "gemv" else 5, K, device="cuda", dtype=torch.bfloat16)
    out = (gemv if kernel == "gemv" else gemv_mma)(x, w)
    _check(out[:, -64:], x, w[-64:], None)
    assert not out[:, :-64].any()
