"""Quantize-on-store: reference codec vs gguf, kernel vs reference, page export, FMA bound."""
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels import reference
from kernels.formats import PAGE_TOKENS, PageFormat, ggml_to_page, page_to_ggml
from kernels.store import store

GGML = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0,
        "q4_0": GGMLQuantizationType.Q4_0}


def gguf_quantize(x: torch.Tensor, t: str) -> torch.Tensor:
    with warnings.catch_warnings():  # gguf's own 1/d overflow and NaN casts on tiny blocks
        warnings.simplefilter("ignore", RuntimeWarning)
        b = quants.quantize(x.float().numpy(), GGML[t])
    return torch.from_numpy(np.ascontiguousarray(b).view(np.uint8)).reshape(*x.shape[:-1], -1)


def adversarial_blocks() -> torch.Tensor:
    """Blocks of 32 float32 values that break naive codecs, one block per row."""
    g = torch.Generator().manual_seed(7)
    r = lambda: torch.randn(32, generator=g)  # noqa: E731
    ties8 = torch.arange(-63, 65, 4, dtype=torch.float32)[:32] + 0.5  # d = 1: x * id = k + .5
    ties8[0] = -127.0
    ties4 = (torch.arange(32) % 16 - 8).float() + 0.5  # d = 1: x * id + 8.5 = integer
    ties4[1] = -8.0
    huge = r()
    huge[9] = 3e4  # one value dominates the scale
    fp16_overflow = r()
    fp16_overflow[3] = 1e7  # q8_0 scale 1e7 / 127 > 65504: fp16 inf, as gguf
    neg_extreme = r()
    neg_extreme[30] = -65504.0  # largest |x| is negative: q4_0 d > 0
    sym = r()
    sym[4], sym[20] = -5.0, 5.0  # equal |x|: q4_0 takes the first (argmax), here the negative
    sym2 = r()
    sym2[2], sym2[17] = 5.0, -5.0
    tiny = torch.full((32,), 1e-39)  # float32 subnormals: 1 / d overflows, quants become 0
    tiny[5] = -3e-39
    fp16_sub = r() * 1e-7  # fp16 subnormal range
    return torch.stack([torch.zeros(32), -torch.zeros(32), ties8, -ties8, ties4, -ties4, huge,
                        fp16_overflow, neg_extreme, -neg_extreme, sym, sym2, tiny, fp16_sub,
                        torch.full((32,), 0.5), torch.full((32,), -7.0)])


def random_blocks(n_rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-6, 5, (n_rows, 1), generator=g).float()
    return torch.randn(n_rows, width, generator=g) * scales


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_reference_codec_matches_gguf(t):
    x = torch.cat([random_blocks(512, 128, seed=1).reshape(-1, 32), adversarial_blocks()])
    for src in (x, x.half().float(), x.bfloat16().float()):  # values the store kernel sees
        b = reference.quantize(src, t)
        assert torch.equal(b, gguf_quantize(src, t)), "blocks must be byte-exact with gguf"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = quants.dequantize(b.numpy(), GGML[t])
        # exact: dequantization is int * fp16 scale, representable in float32
        np.testing.assert_array_equal(reference.dequantize(b, t).numpy(), want)


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("dtype,head_dim,n_kv_heads", [
    (torch.float32, 64, 1), (torch.float16, 128, 2), (torch.bfloat16, 64, 3)])
def test_store_kernel_byte_exact(t, dtype, head_dim, n_kv_heads, device, gen):
    fmt = PageFormat(t, n_kv_heads, head_dim)
    n_pages, n = 5, 70
    pool = torch.randint(0, 256, (n_pages, fmt.page_bytes), dtype=torch.uint8, generator=gen)
    slots = torch.randperm(n_pages * PAGE_TOKENS, generator=gen)[:n]
    slots[[3, 40]] = -1  # skipped rows
    rows = random_blocks(n, n_kv_heads * head_dim, seed=2).reshape(n, n_kv_heads, head_dim)
    adv = adversarial_blocks()
    if dtype == torch.bfloat16 and device.type == "cpu":  # the interpreter's bf16 -> fp32
        adv = adv[adv.abs().amax(1) > 1e-30]  # cast flushes subnormals (on the GPU it is exact)
    rows[:16].view(-1, 32)[: len(adv)] = adv
    rows = rows.to(dtype)
    want = pool.clone()
    reference.store(want, rows, slots, fmt)
    got = pool.to(device)
    store(got, rows.to(device), slots.to(device), fmt)
    assert torch.equal(got.cpu(), want), "pool bytes must equal the reference store, untouched bytes too"
    # export: the stored tokens' GGML rows are gguf's blocks of the same rows
    keep = slots >= 0
    ggml = page_to_ggml(got.cpu(), fmt).reshape(-1, fmt.row_bytes)[slots[keep]]
    assert torch.equal(ggml, gguf_quantize(rows[keep].float().reshape(int(keep.sum()), -1), t))


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_page_export_import_roundtrip(t, gen):
    fmt = PageFormat(t, 2, 64)
    pages = torch.randint(0, 256, (3, fmt.page_bytes), dtype=torch.uint8, generator=gen)
    rows = page_to_ggml(pages, fmt)
    assert rows.shape == (3, PAGE_TOKENS, fmt.row_bytes)
    assert torch.equal(ggml_to_page(rows, fmt), pages)
    # a GGML row quantized by gguf and imported dequantizes to gguf's values
    x = random_blocks(PAGE_TOKENS, fmt.n_kv_heads * fmt.head_dim, seed=3)
    page = ggml_to_page(gguf_quantize(x, t), fmt)[None]
    got = reference.dequantize_pages(page, torch.tensor([0]), fmt)
    want = quants.dequantize(gguf_quantize(x, t).numpy(), GGML[t])
    np.testing.assert_array_equal(got.reshape(PAGE_TOKENS, -1).numpy(), want)


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("lo, hi", [(0, 1), (37, 38), (250, 256), (3, 200), (0, 256)])
def test_row_spans_hold_exactly_the_rows(t, lo, hi, gen):
    """Copying a page's ``row_spans(lo, hi)`` from another page moves GGML rows [lo, hi) and no
    other byte (the GGML view, page_to_ggml, is the independent reference)."""
    fmt = PageFormat(t, 2, 128)
    old, new = torch.randint(0, 256, (2, fmt.page_bytes), dtype=torch.uint8, generator=gen)
    got = old.clone()
    for a, w in fmt.row_spans(lo, hi):
        got[a:a + w] = new[a:a + w]
    want = page_to_ggml(old, fmt)
    want[lo:hi] = page_to_ggml(new, fmt)[lo:hi]
    assert torch.equal(page_to_ggml(got, fmt), want)
    assert len(fmt.row_spans(lo, hi)) == (1 if (lo, hi) == (0, 256) else 2 * (1 + (t != "f16")))
    with pytest.raises(ValueError, match=r"token rows \[5, 5\)"):
        fmt.row_spans(5, 5)


def _q4_0_quants(b: np.ndarray, fma: bool) -> np.ndarray:
    """gguf's q4_0 quants of float32 blocks [n, 32], with x * id + 8.5 rounded once (FMA) or
    twice (gguf). The FMA is emulated exactly: x * id is exact in float64 (48 bits), and for
    |x * id| >= 0.25 so is + 8.5; below that both forms give 8."""
    mx = np.take_along_axis(b, np.abs(b).argmax(-1)[:, None], -1)
    d = mx / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    if fma:
        v = (b.astype(np.float64) * inv.astype(np.float64) + 8.5).astype(np.float32)
    else:
        v = b * inv + np.float32(8.5)
    return np.minimum(np.trunc(v), 15).astype(np.int64), inv


def test_q4_0_fma_contraction_bound():
    """gguf (and our kernel, compiled without FP contraction) rounds x * id, then adds 8.5.
    A C build of ggml that contracts this into an FMA differs exactly when x * id lies within
    one float32 ulp of a quant boundary n - 8.5, by one level (|d| in value), nowhere else."""
    g = np.random.default_rng(11)
    rnd = (g.standard_normal((20000, 32)) * 10.0 ** g.integers(-3, 4, (20000, 1))).astype(np.float32)
    # near-boundary blocks: x = (n - 8.5) * d nudged by -2..2 ulps, d = max / -8 random
    mx = (g.uniform(0.5, 2.0, (4000, 1)) * 10.0 ** g.integers(-2, 3, (4000, 1))).astype(np.float32)
    n = g.integers(1, 16, (4000, 31))
    x = ((n - 8.5) * (mx / np.float32(-8))).astype(np.float32)
    ulps = g.integers(-2, 3, x.shape)
    for step in (1, 2):
        x = np.where(ulps >= step, np.nextafter(x, np.float32(np.inf)), x)
        x = np.where(ulps <= -step, np.nextafter(x, np.float32(-np.inf)), x)
    near = np.concatenate([mx, x], axis=1).astype(np.float32)  # block max first, |x| < |max|
    blocks = np.concatenate([rnd, near])

    q_gguf = quants.quantize(blocks, GGMLQuantizationType.Q4_0).reshape(-1, 18)[:, 2:]
    q_plain, inv = _q4_0_quants(blocks, fma=False)
    q_fma, _ = _q4_0_quants(blocks, fma=True)
    packed = (q_plain[:, :16] | (q_plain[:, 16:] << 4)).astype(np.uint8)
    assert np.array_equal(packed, q_gguf), "the non-contracted form is gguf's"

    diff = q_fma != q_plain
    exact = blocks.astype(np.float64) * inv.astype(np.float64) + 8.5  # x * id + 8.5, exact
    dist = np.abs(exact - np.round(exact))
    assert diff[:len(rnd)].mean() < 1e-4, "on random data contraction almost never matters"
    assert diff.any(), "the near-boundary set must contain a case where contraction matters"
    assert np.all(np.abs(q_fma - q_plain)[diff] == 1), "contraction moves a quant by one level"
    assert np.all(dist[diff] <= 2.0**-19), "only within one ulp (at 8..16) of a boundary"


def test_store_rejects_bad_inputs(device):
    fmt = PageFormat("q8_0", 2, 64)
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=device)
    rows = torch.randn(3, 2, 64, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match=rf"uint8 \[n_pages, {fmt.page_bytes}\]"):
        store(pool[:, :-2], rows, slots, fmt)
    with pytest.raises(ValueError, match="stride"):
        store(torch.zeros(2, 2 * fmt.page_bytes, dtype=torch.uint8, device=device)[:, ::2], rows, slots, fmt)
    with pytest.raises(ValueError, match=r"rows must be \[n, 2, 64\]"):
        store(pool, rows[:, :1], slots, fmt)
    with pytest.raises(ValueError, match="rows dtype"):
        store(pool, rows.double(), slots, fmt)
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        store(pool, torch.randn(3, 2, 128, device=device)[..., ::2], slots, fmt)
    with pytest.raises(ValueError, match="slots must be contiguous int64"):
        store(pool, rows, slots.int(), fmt)


@pytest.mark.bigmem
@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_store_past_2gib(t, big_pool, device):
    fmt = PageFormat(t, 1, 64)
    pool, ids = big_pool(fmt)
    page_ids = torch.tensor([ids[0], ids[-1]])
    slots = (page_ids[:, None] * PAGE_TOKENS + torch.tensor([0, 255])).flatten()
    rows = random_blocks(4, 64, seed=4).reshape(4, 1, 64)
    store(pool, rows.to(device), slots.to(device), fmt)
    got = page_to_ggml(pool[page_ids.to(device)].cpu(), fmt)[:, [0, 255]].reshape(4, -1)
    assert torch.equal(got, gguf_quantize(rows.reshape(4, 64), t))
