"""kernels/gemv.py against the fp32 product, on CUDA or under the Triton interpreter."""
import pytest
import torch
import triton
import triton.language as tl

from kernels.gemv import Launch, gemv, launch_for
from kernels.pdl import supported

from tests.kernels.conftest import DEVICE

PDL = pytest.mark.skipif(not (torch.cuda.is_available() and supported(torch.device("cuda"))),
                         reason="programmatic dependent launch needs an sm_90+ GPU")


def _reference(x, w, bias):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _check(out, x, w, bias):
    """The kernel sums K fp32 products (and the bias) in some order, then rounds once to the output
    dtype. Its fp32 sum is within K * 2^-24 * sum|w x| of the exact value (each addition's
    rounding); the final rounding adds half an ulp, and where the fp32 error crosses a rounding
    boundary the result lands one ulp off: eps * |exact| (eps = 2^(1-p) covers an ulp) plus the
    fp32 bound."""
    ref = _reference(x, w, bias)
    mags = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = torch.finfo(out.dtype).eps * ref.abs() + (x.shape[1] + 1) * 2.0 ** -24 * mags
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g} against {bound[err > bound].min():.3g}"


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
    (torch.randn(2, 8), torch.randn(4, 8).half(), None, "in x's torch.float32"),
    (torch.randn(8, 2).T, torch.randn(4, 8), None, "contiguous rows"),
    (torch.randn(2, 8).long(), torch.randn(4, 8), None, "x must be"),
])
def test_bad_input_one_line(x, w, bias, match):
    with pytest.raises(ValueError, match=match):
        gemv(x, w, bias)


@PDL
def test_pdl_launches_compute_what_ordinary_ones_do():
    """Each kernel that takes ``pdl`` gives the same bytes launched as a programmatic dependent."""
    from kernels.decode_attention import decode_attention
    from kernels.formats import PageFormat
    from kernels.rms_norm import add_rms_norm
    from kernels.swiglu import silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    x, d, w, b = r(1, 1536), r(1, 1536), r(2048, 1536), r(2048)
    kf, vf = PageFormat("q8_0", 2, 128), PageFormat("q4_0", 2, 128)
    pools = [torch.randint(0, 256, (8, f.page_bytes), device="cuda", dtype=torch.uint8, generator=g) for f in (kf, vf)]
    for pool, f in zip(pools, (kf, vf)):  # sane fp16 scales
        pool[:, f.scale_offset:].view(torch.float16).copy_(0.01 + 0.02 * torch.rand(
            8, (f.page_bytes - f.scale_offset) // 2, device="cuda", generator=g))
    q, table = r(3, 12, 128), torch.arange(8, dtype=torch.int32, device="cuda")
    from kernels.gemv_mma import Launch as Launch_mma, gemv_mma

    x5 = r(5, 1536)
    calls = [lambda p: gemv(x, w, b, pdl=p), lambda p: gemv(x, w, glu=True, pdl=p),
             lambda p: gemv_mma(x5, w, b, pdl=p), lambda p: gemv_mma(x5, w, glu=True, pdl=p),
             lambda p: gemv_mma(x5, w, b, pdl=p, launch=Launch_mma(16, 128, 4, 3, split=4)),  # + its split sum
             lambda p: gemv_mma(x5, w, glu=True, pdl=p, launch=Launch_mma(16, 128, 4, 3, split=3)),
             lambda p: add_rms_norm(x, w[0], 1e-6, d, pdl=p)[1],
             lambda p: silu_mul(x, pdl=p),
             lambda p: decode_attention(q, *pools, table, 1900, kf, vf, pdl=p)]
    for call in calls:
        assert torch.equal(call(False), call(True))


@triton.jit
def _late_writer(x, value, spins, BLOCK: tl.constexpr):
    """Lets its dependents launch at once, then keeps running ``spins`` steps before it writes x."""
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(spins):
        acc = acc * 1.0000001 + 1.0
    o = tl.arange(0, BLOCK)
    tl.store(x + o, tl.where(acc > -1.0, value, 0.0))  # acc >= 0 always; the store waits for the loop


@PDL
def test_a_dependent_gemv_reads_what_the_kernel_before_writes_last():
    """A kernel before it releases its dependents at once and writes x after ~a millisecond: a gemv
    (or gemv_mma) launched as a dependent still reads the written x (its wait covers the whole
    kernel), with or without the delay. Without the wait it would read the zeros."""
    from kernels.gemv_mma import gemv_mma

    x, w = torch.zeros(1, 256, device="cuda"), torch.ones(4, 256, device="cuda")
    x5 = torch.zeros(5, 256, device="cuda")
    for spins in (1, 1_000_000):
        x.zero_()
        _late_writer[(1,)](x, 2.0, spins, BLOCK=256)
        assert torch.equal(gemv(x, w, pdl=True), torch.full((1, 4), 512.0, device="cuda"))
        x5.zero_()  # the tensor-core kernel: its last row written late (the writer's one program covers 256 values)
        _late_writer[(1,)](x5[4], 2.0, spins, BLOCK=256)
        assert torch.equal(gemv_mma(x5, w, pdl=True)[4], torch.full((4,), 512.0, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, F, K, launch", [(1, 40, 96, None), (3, 23, 160, Launch(4, 64, 4)),
                                             (8, 9, 64, Launch(2, 32, 4)), (1, 17, 200, Launch(16, 128, 4))])
def test_glu_equals_the_matmul_then_silu_mul(dtype, n, F, K, launch):
    """gate/up's fused epilogue rounds each sum to the dtype and applies ``silu_times``, as the
    unfused pair does: the same bytes as gemv then silu_mul (odd F: the last program half empty)."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    from kernels.swiglu import silu_mul

    g = torch.Generator().manual_seed(n * F + K)
    w = torch.randn(2 * F, K, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(n, K, generator=g).to(dtype).to(DEVICE)
    # the unfused product with the same [block_n, block_k] tiles, so each sum's fp32 order is the same
    unfused = silu_mul(gemv(x, w, launch=launch))
    assert torch.equal(gemv(x, w, glu=True, launch=launch), unfused)


@pytest.mark.parametrize("w, launch, match", [
    (torch.randn(7, 8), None, "even number of weight rows"),
    (torch.randn(8, 8), Launch(3, 8, 4), "even block_n"),
])
def test_glu_bad_input_one_line(w, launch, match):
    with pytest.raises(ValueError, match=match):
        gemv(torch.randn(1, 8), w, glu=True, launch=launch)
