"""kernels/q8_linear.py against kernels.reference.q8_linear, and the weight codec against gguf's
q8_0 quantizer, on CUDA or under the Triton interpreter."""
import gguf
import numpy as np
import pytest
import torch

from kernels import reference
from kernels.q8_linear import Launch, launch, q8_linear

from tests.kernels.conftest import DEVICE

# Kernel and reference sum the same K products in fp32, in different orders (the kernel: per
# block of 32 on the tensor cores, then times the block's scale; the reference: dequantized
# weights, one matmul): a few fp32 ulp of the row's magnitude apart, then one rounding to the
# output dtype, where a value on a rounding boundary can move by one ulp of that dtype.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.float16: dict(rtol=1e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def _weight(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * (0.5 + torch.rand(N, 1, generator=g))  # rows of different scales
    return w, reference.q8_weight(w)


def test_weight_codec_is_ggufs_q8_0_byte_for_byte():
    w, (q, d) = _weight(40, 96, 0)
    w[3, :32] = 0  # an all-zero block: scale 0, quants 0
    q, d = reference.q8_weight(w, rows_per_pass=16)  # several passes
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(40, 3, 34)
    assert np.array_equal(d.numpy(), ref[..., :2].copy().view(np.float16)[..., 0].T)
    assert np.array_equal(q.numpy(), ref[..., 2:].copy().view(np.int8).transpose(1, 0, 2))
    back = gguf.quants.dequantize(ref.reshape(40, -1), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(reference.q8_dense(q, d), torch.from_numpy(back))  # dequantization exact in fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, N, K", [(1, 48, 64), (5, 40, 96), (20, 72, 128)])
def test_q8_linear_matches_reference(dtype, n, N, K):
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    _, (q, d) = _weight(N, K, n + N)
    g = torch.Generator().manual_seed(K)
    wide = torch.randn(n, K + 32, generator=g).to(dtype)
    x = wide[:, :K].to(DEVICE)  # strided rows, as the model's sliced activations are
    bias = torch.randn(N, generator=g).to(dtype).to(DEVICE)
    q, d = q.to(DEVICE), d.to(DEVICE)
    for b in (None, bias):
        out = q8_linear(x, q, d, b)
        ref = reference.q8_linear(x, q, d, b)
        assert out.dtype == dtype and out.shape == (n, N)
        torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("split, blocks", [(1, 1), (2, 1), (3, 1), (1, 4), (2, 4), (3, 8)])
def test_split_k_and_blocks_per_iteration_equal_one_pass_up_to_the_sum_order(split, blocks):
    _, (q, d) = _weight(24, 32 * 7, 1)  # 7 blocks: splits of unequal length, iterations part masked
    x = torch.randn(3, 32 * 7).to(DEVICE)
    q, d, b = q.to(DEVICE), d.to(DEVICE), torch.randn(24).to(DEVICE)
    one = q8_linear(x, q, d, b, Launch(16, 16, 1, 4, 2))
    c = Launch(16, 16, split, 4, 2, blocks)
    out = q8_linear(x, q, d, b, c)
    torch.testing.assert_close(out, one, rtol=1e-6, atol=1e-5)  # the same block sums, fp32, regrouped
    assert torch.equal(out, q8_linear(x, q, d, b, c))  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [Launch(1, 16, 1, 4, 2, 1), Launch(1, 32, 3, 4, 2, 4), Launch(1, 16, 2, 4, 2, 8)])
def test_the_gemv_kernel_matches_the_reference(dtype, config):
    """The CUDA-core kernel (bm 1): every row of x, splits and blocks per iteration part masked."""
    _, (q, d) = _weight(40, 32 * 7, 2)
    x = torch.randn(3, 32 * 7).to(dtype).to(DEVICE)
    q, d, b = q.to(DEVICE), d.to(DEVICE), torch.randn(40).to(dtype).to(DEVICE)
    torch.testing.assert_close(q8_linear(x, q, d, b, config), reference.q8_linear(x, q, d, b), **TOL[dtype])


def test_launch_splits_decode_batches_only_and_few_rows_most():
    assert launch(1, 1536, 8960).split == 8 and launch(1, 1536, 8960).blocks == 4  # ffn_down: 48 row tiles
    assert launch(5, 151936, 1536).split <= 2 and launch(5, 151936, 1536).bn == 128  # the LM head: 1187 row tiles
    assert launch(1024, 1536, 8960).split == 1  # prefill tiles are many


def test_bad_shapes_are_named():
    _, (q, d) = _weight(16, 64, 0)
    with pytest.raises(ValueError, match=r"x must be \[n, 64\]"):
        q8_linear(torch.zeros(2, 32), q, d)
    with pytest.raises(ValueError, match="d must be contiguous fp16"):
        q8_linear(torch.zeros(2, 64), q, d.float())
    with pytest.raises(ValueError, match=r"bias must be \[16\]"):
        q8_linear(torch.zeros(2, 64), q, d, torch.zeros(8))
