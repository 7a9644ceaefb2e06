"""kernels/q8_gemv.py against the exact product of the dequantized weight, on CUDA or under the Triton
interpreter (which runs the Triton form of the quants' conversion; CUDA runs the PTX one)."""
import pytest
import torch

from kernels import reference
from kernels.q8_gemv import Launch, launch_for, q8_gemv
from kernels.swiglu import silu_mul

from tests.kernels.conftest import DEVICE
from tests.kernels.test_gemv import PDL, _check


def _weight(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * (0.5 + torch.rand(N, 1, generator=g))  # rows of different scales
    w[0, :32] = 0  # an all-zero block: scale 0
    w[1, 5] = 40.0  # a block whose largest quant is +127 and others near 0, and -128's neighbour
    w[2, 7] = -40.0
    q, d = reference.q8_weight(w)
    return q.to(DEVICE), d.to(DEVICE), reference.q8_dense(q, d).to(DEVICE)


def _x(n, K, dtype, seed):
    wide = torch.randn(n, K + 16, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return wide[:, :K].to(DEVICE)  # strided rows, as the model's sliced activations are


# The bound is test_gemv's (K + 1 fp32 roundings of the magnitudes, then one rounding to the output dtype)
# against W's exact dequantized values: the kernel's products of a quant (8 bits) and x are exact for fp16 /
# bf16 x (one rounding each for fp32), each block's sum of 32 takes <= 31 roundings, its scaling one, the
# sum over K / 32 blocks and the bias K / 32 + 1: within K + 1 for K >= 64.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, N, K", [(1, 40, 96), (3, 24, 160), (8, 9, 64)])
def test_q8_gemv_matches_the_exact_product(dtype, n, N, K):
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    q, d, w = _weight(N, K, n * N + K)
    x = _x(n, K, dtype, K)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(N)).to(dtype).to(DEVICE)
    for b in (None, bias):
        out = q8_gemv(x, q, d, b)
        assert out.dtype == dtype and out.shape == (n, N)
        _check(out, x, w, b)


def test_every_quant_converts_exactly():
    """All 256 quant values at each of the four byte positions of a 32-bit word (the PTX's four byte
    selections): one-hot rows of x read W's columns back, exactly."""
    q = torch.arange(-128, 128, dtype=torch.int8).repeat(4).view(1, 32, 32)  # block 0: every value once
    q = torch.cat([q.roll(s, dims=2) for s in range(4)])  # block s: the bytes moved s places
    d = torch.ones(4, 32, dtype=torch.float16)
    eye = torch.eye(128)
    cols = torch.cat([q8_gemv(eye[r:r + 8].to(DEVICE), q.to(DEVICE), d.to(DEVICE)) for r in range(0, 128, 8)])
    assert torch.equal(cols.cpu().T, reference.q8_dense(q, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, N, K", [(1, 40, 96), (3, 24, 160)])
def test_int8_is_the_exact_product_of_x_through_q8_0(dtype, n, N, K):
    """``int8``: x's blocks quantized in the kernel exactly as gguf's q8_0 codec does (scale, round half
    away from zero, the scale stored in fp16), the block's products summed exactly in int32: against the
    exact product of the round-tripped x and W, only the fp32 sum over blocks and scales differs (inside
    test_gemv's bound). A quant off by one moves a result by ~1/127 of its block's largest |x w|, far
    outside it."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    q, d, w = _weight(N, K, n + N + K)
    x = _x(n, K, dtype, N)
    x[0, :32] = 0  # a block of x all zero: scale 0
    x[-1, 32] = 1e3 * x[-1, 32:64].abs().max()  # one value dominating its block: the rest round to 0 or +-1
    bias = torch.randn(N, generator=torch.Generator().manual_seed(K)).to(dtype).to(DEVICE)
    xr = reference.q8_round(x.cpu()).to(DEVICE)
    for b in (None, bias):
        out = q8_gemv(x, q, d, b, int8=True)
        assert out.dtype == dtype and out.shape == (n, N)
        _check(out, xr, w, b)
    assert torch.equal(q8_gemv(x[:1], q, d, glu=True, int8=True), silu_mul(q8_gemv(x[:1], q, d, int8=True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_xq_is_the_kernels_own_quantization(dtype):
    """``xq``, x's q8_0 blocks made outside (``reference.q8_rows``: gguf's codec, what the producer kernels
    write): bit for bit the product ``int8`` gives when the kernel quantizes x itself (the same quants and
    scales, the same sum order). ``q8_rows`` holds x's gguf round trip."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (kernels/NOTES.md): bf16 runs on CUDA")
    q, d, _ = _weight(40, 224, 7)
    x = _x(3, 224, dtype, 8)
    x[1, 32:64] = 0  # a zero block
    xq = tuple(t.to(DEVICE) for t in reference.q8_rows(x.cpu()))
    assert torch.equal(reference.q8_rows_dense(xq).cpu(), reference.q8_round(x.cpu()))
    for launch in (None, Launch(8, 64, 4), Launch(16, 256, 4)):
        assert torch.equal(q8_gemv(x, q, d, xq=xq, launch=launch), q8_gemv(x, q, d, int8=True, launch=launch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_q8_out_is_h_through_q8_0(dtype):
    """``q8_out``: gate/up's SwiGLU output h unchanged, and beside it h's q8_0 blocks exactly as gguf's codec
    makes them from h (down's ``xq``); 64 rows a program hold 32 whole columns; a tail program's masked
    blocks are not written; fewer rows a program (a divisor of 64): the last program of a block quantizes
    it, and leaves its counter at zero for the next launch (each launch twice)."""
    q, d, _ = _weight(2 * 96, 64, 9)
    x = _x(3, 64, dtype, 10)  # (3 rows: the padded row's masks too)
    # (16 pairs a program in one warp: two programs a block; 2 pairs would be 48 programs a launch, slow in the
    # interpreter for no other path)
    for launch in (Launch(64, 64, 4), Launch(128, 32, 4), Launch(32, 64, 4), Launch(8, 32, 4), Launch(16, 64, 1)):
        h = q8_gemv(x, q, d, glu=True, int8=True, launch=launch)
        for _ in range(2):
            out, hq = q8_gemv(x, q, d, glu=True, int8=True, q8_out=True, launch=launch)
            assert torch.equal(out, h)
            ref = reference.q8_rows(out.cpu())
            assert torch.equal(hq[0].cpu(), ref[0]) and torch.equal(hq[1].cpu(), ref[1]), launch
    _counters_at_zero()


def _counters_at_zero():
    """Every launch leaves its counters as it found them: at zero."""
    from kernels.q8_gemv import _SCRATCH

    assert all(not t.any() for (kind, *_), t in _SCRATCH.items() if kind == "counts")


@pytest.mark.parametrize("mode", ["exact", "int8", "xq"])
def test_split_k_adds_its_shares_in_order(mode):
    """``Launch.split``: programs share each row block's K (shares of whole tiles, the last one short or
    empty), the last to finish adds their fp32 sums in share order: the exact product within the same bound
    (another sum order), the same bits on every call (deterministic), and the counters left at zero (each
    launch twice); with a bias and 3 rows."""
    K, N = 7 * 32, 11  # N: a partial last row block at every block_n below
    q, d, w = _weight(N, K, 3)
    x, b = _x(3, K, torch.float32, 4), torch.randn(N).to(DEVICE)
    kw = dict(int8=True) if mode == "int8" else dict(xq=reference.q8_rows(x.cpu())) if mode == "xq" else {}
    if "xq" in kw:
        kw["xq"] = tuple(t.to(DEVICE) for t in kw["xq"])
    xr = x if mode == "exact" else reference.q8_round(x.cpu()).to(DEVICE)  # int8: x through its q8_0 blocks
    # (shares of 2 and 3 tiles with a short last one; 7 one-block shares; 4-block shares with two empty)
    for launch in (Launch(4, 64, 4, 2), Launch(8, 32, 4, 3), Launch(16, 64, 4, 4), Launch(2, 32, 1, 7),
                   Launch(4, 128, 4, 4)):
        first = q8_gemv(x, q, d, b, launch=launch, **kw)
        _check(first, xr, w, b)
        # another product between (the counters were reset: its own output), then x's again: the same bits
        _check(q8_gemv(x, q, d, None, launch=launch, **kw), xr, w, None)
        assert torch.equal(q8_gemv(x, q, d, b, launch=launch, **kw), first), launch
    _counters_at_zero()


@pytest.mark.parametrize("block_n, block_k", [(1, 32), (4, 64), (8, 128), (16, 256)])
def test_tiles_and_k_loop(block_n, block_k):
    """Row blocks that do not divide N, tiles of blocks that do not divide K's 7 blocks (the next tile's
    prefetch masked off at the end), one tile covering all of K."""
    q, d, w = _weight(37, 224, 1)
    x, b = torch.randn(3, 224).to(DEVICE), torch.randn(37).to(DEVICE)
    _check(q8_gemv(x, q, d, b, launch=Launch(block_n, block_k, 4)), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_equals_the_product_then_silu_mul(dtype):
    """SwiGLU in the epilogue rounds the gate and up sums as the unfused kernel's output, then as silu_mul."""
    q, d, _ = _weight(2 * 24, 96, 2)
    x = _x(2, 96, dtype, 3)
    for launch in (None, Launch(2, 64, 4), Launch(8, 32, 4)):
        assert torch.equal(q8_gemv(x, q, d, glu=True, launch=launch), silu_mul(q8_gemv(x, q, d, launch=launch)))


@PDL
def test_pdl_launch_is_bit_identical():
    q, d, _ = _weight(300, 1536, 4)
    x = _x(1, 1536, torch.bfloat16, 5)
    assert torch.equal(q8_gemv(x, q, d, pdl=True), q8_gemv(x, q, d))


def test_launch_rule_gives_the_sweeps_fastest_for_the_1_5b():
    """results/kernels/q8_gemv's sweep (H200, one row, PDL): the fastest launch per matrix."""
    assert launch_for(1536, 8960) == Launch(4, 2048, 8)  # down
    assert launch_for(17920, 1536) == Launch(16, 512, 4)  # gate/up
    assert launch_for(151936, 1536) == Launch(16, 512, 4)  # the LM head
    assert launch_for(1536, 1536) == Launch(8, 2048, 4)  # output (Q/K/V: 3.41 against the best 3.30 us)
    assert launch_for(100, 64) == Launch(8, 64, 4)  # a K below one tile: one tile of it
    assert launch_for(1536, 8960, int8=True) == Launch(8, 2048, 8)  # int8: down
    assert launch_for(151936, 1536, int8=True) == Launch(32, 512, 4)  # the LM head
    assert launch_for(17920, 1536, int8=True) == Launch(16, 512, 4)  # gate/up
    assert launch_for(2048, 1536, int8=True) == Launch(16, 2048, 4)  # Q/K/V (output the same)
    assert launch_for(1536, 8960, xq=True) == Launch(4, 2048, 4)  # xq: down
    assert launch_for(151936, 1536, xq=True) == Launch(16, 512, 4)  # the LM head
    assert launch_for(17920, 1536, xq=True) == Launch(8, 512, 4)  # gate/up
    assert launch_for(2048, 1536, xq=True) == Launch(16, 2048, 4)  # Q/K/V (output the same)
    assert launch_for(17920, 1536, xq=True, q8_out=True) == Launch(64, 256, 4)  # gate/up writing h's blocks


@pytest.mark.parametrize("make, match", [
    (lambda q, d: (torch.randn(9, 64), q, d, None), r"\[1..8, 64\]"),
    (lambda q, d: (torch.randn(1, 96), q, d, None), r"\[1..8, 64\]"),
    (lambda q, d: (torch.randn(1, 64).long(), q, d, None), "x must be"),
    (lambda q, d: (torch.randn(1, 64), q, d, torch.randn(3)), r"bias must be contiguous \[8\]"),
    (lambda q, d: (torch.randn(1, 64), q.view(2, 4, 64), d, None), "q must be contiguous int8"),
    (lambda q, d: (torch.randn(1, 64), q, d.float(), None), "d must be contiguous fp16"),
])
def test_bad_input_one_line(make, match):
    q, d = reference.q8_weight(torch.randn(8, 64))
    x, q, d, b = make(q, d)
    with pytest.raises(ValueError, match=match):
        q8_gemv(x.to(DEVICE), q.to(DEVICE), d.to(DEVICE), None if b is None else b.to(DEVICE))


@pytest.mark.parametrize("kw, match", [
    (dict(xq=(torch.zeros(1, 32, dtype=torch.int8), torch.zeros(1, 2, dtype=torch.float16))), r"xq must be .* \[1, 64\]"),
    (dict(xq=(torch.zeros(1, 64, dtype=torch.int8), torch.zeros(1, 2))), r"fp16 \[1, 2\] scales"),
    (dict(q8_out=True), "q8_out needs glu"),
    (dict(glu=True, q8_out=True), "a multiple of 32 output columns, got glu=True, 4 columns"),
])
def test_bad_q8_rows_one_line(kw, match):
    q, d = reference.q8_weight(torch.randn(8, 64))
    kw = {k: tuple(t.to(DEVICE) for t in v) if k == "xq" else v for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        q8_gemv(torch.randn(1, 64).to(DEVICE), q.to(DEVICE), d.to(DEVICE), **kw)


def test_q8_out_launch_holds_whole_blocks():
    q, d = reference.q8_weight(torch.randn(128, 64))
    with pytest.raises(ValueError, match="with q8_out a multiple or a divisor of 64"):
        q8_gemv(torch.randn(1, 64).to(DEVICE), q.to(DEVICE), d.to(DEVICE), glu=True, q8_out=True,
                launch=Launch(24, 64, 4))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="memory pools are CUDA's")
def test_the_workspace_outlives_a_memory_pool():
    """``scratch`` made while a pool routes this thread's allocations (a cache's slab during a step) lies
    outside the pool's segments: the slab's next pass may reuse them, the workspace must stay."""
    from kernels.q8_gemv import scratch

    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = scratch("test", (7,), torch.int32, DEVICE)
        inside = torch.empty(7, dtype=torch.int32, device=DEVICE)  # (this one is the pool's)
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
    within = lambda p: any(a <= p < b for a, b in segments)  # noqa: E731
    assert within(inside.data_ptr()) and not within(t.data_ptr())
    assert torch.equal(t.cpu(), torch.zeros(7, dtype=torch.int32))
