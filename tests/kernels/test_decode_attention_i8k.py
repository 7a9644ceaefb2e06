"""Benchmark-only int8-QK decode attention (kernels/decode_attention_i8k.py) vs the fp32 reference."""
import pytest
import torch

from kernels import reference
from kernels.decode_attention import decode_attention as current, merge
from kernels.decode_attention_i8k import decode_attention
from kernels.formats import PAGE_TOKENS, PageFormat
from kernels.reference import LOG2E

# (V type, head_dim, n_kv_heads, GQA, n_q, L, n_splits, qrow): head_dim 64/128, GQA 1/6, n_q 1/6,
# L 1/257/1000, one pass and split; K is q8_0 throughout (the int8 path)
CASES = [
    ("q4_0", 64, 2, 1, 1, 1, None, False),
    ("q4_0", 128, 2, 6, 1, 1000, None, False),
    ("q8_0", 128, 2, 6, 6, 257, 3, False),
    ("q4_0", 64, 1, 6, 6, 1000, 2, False),
    ("q8_0", 128, 1, 1, 6, 257, None, False),
    ("q8_0", 64, 2, 6, 1, 257, 5, False),
    ("q4_0", 128, 2, 6, 1, 1000, None, True),
    ("q4_0", 128, 2, 6, 6, 257, 2, True),
]


def make_case(make_pool, gen, device, vt, head_dim, n_kv_heads, gqa, n_q, L):
    kf, vf = PageFormat("q8_0", n_kv_heads, head_dim), PageFormat(vt, n_kv_heads, head_dim)
    n_pages = -(-L // PAGE_TOKENS)
    k_pool, v_pool = make_pool(kf, 2 * n_pages + 1), make_pool(vf, 2 * n_pages + 1)
    table = torch.randperm(2 * n_pages + 1, generator=gen)[:n_pages].int().to(device)
    q = torch.randn(n_q, n_kv_heads * gqa, head_dim, generator=gen).to(device)
    return q, k_pool, v_pool, table, kf, vf


def quantized_query(q, qrow):
    """The kernel's query, emulated in fp32 (same ops, correctly rounded division): x = q * scale *
    log2 e, per row and 32-block (or per row) q8 = round-half-away(x * 127 / amax), qd = amax / 127.
    Returns x, x_hat = q8 * qd and qd per element, each [n_q, n_heads, D]."""
    n_q, n_heads, d = q.shape
    x = q.float() * torch.tensor(LOG2E / d ** 0.5, dtype=torch.float32)
    xb = x.view(n_q, n_heads, -1 if qrow else d // 32, d if qrow else 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0.0)
    r = xb * inv
    q8 = torch.trunc(r + torch.where(r >= 0, 0.5, -0.5)).clamp(-127, 127)
    qd = (amax / 127).expand_as(xb)
    return x, (q8 * qd).reshape(x.shape), qd.reshape(x.shape)


def logit_bounds(q, k_pool, table, kf, qrow):
    """Per (query row, head): a bound on |kernel logit - fp32 logit| (base 2) over all keys, and the
    part of it that fp32 rounding alone can cause.
    - q rounding: |x_j - q8_j qd_j| <= qd_j / 2, and K is exact (int8 quants times their fp16 scale,
      int32 dot, |dot| < 2^19), so |ds| <= sum_j (qd_j / 2) |k_j| (1.01: qd's own fp32 rounding);
    - fp32 products and sums of the per-block path (relative <= 2^-24 each, a few per logit):
      1e-6 * sum_j |x_j k_j|;
    - qrow: block b's fp32 is (2^23 + 2^22 + dot_b) kd_b (the MAGIC accumulator), so every partial
      sum of the logit is below 2^24 sum_b kd_b; the start value, NB products and NB sums (unfused in
      the interpreter) round by <= 2^-24 of that each: (2 NB + 1) qd sum_b kd_b."""
    x, _, qd = quantized_query(q.cpu(), qrow)
    k = reference.dequantize_pages(k_pool.cpu(), table.cpu(), kf)  # [T, H, D] fp32, exact
    gqa = q.shape[1] // kf.n_kv_heads
    k = k.repeat_interleave(gqa, 1)
    fp = 1e-6 * torch.einsum("qhd,thd->qht", x.abs(), k.abs()).amax(-1)
    delta = 1.01 * torch.einsum("qhd,thd->qht", qd / 2, k.abs()).amax(-1)
    if qrow:
        nb = kf.head_dim // 32
        _, s = reference._page_views(k_pool.cpu()[table.cpu().long()], kf)  # [pages, H, 256, 2 nb] bytes
        kd = s.contiguous().view(torch.float16).float().abs().sum(-1)  # [pages, H, 256]: sum_b |kd_b|
        kd = kd.amax(0).amax(-1).repeat_interleave(gqa)  # [n_heads]: the largest over keys
        fp = fp + (2 * nb + 1) * qd[..., 0] * kd
    return delta + fp, fp


def fp16_tolerance(v_pool, table, vf):
    """As tests/kernels/test_decode_attention.py: P and V rounded to fp16 for tl.dot (2^-11 relative
    each), the output a convex combination of V rows: 4e-3 * max|V|."""
    return 4e-3 * reference.dequantize_pages(v_pool.cpu(), table.cpu(), vf).abs().max().item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_i8k_matches_reference(case, make_pool, gen, device):
    vt, head_dim, n_kv_heads, gqa, n_q, L, n_splits, qrow = case
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, device, vt, head_dim, n_kv_heads, gqa, n_q, L)
    got = decode_attention(q, k_pool, v_pool, table, L, kf, vf, n_splits=n_splits, qrow=qrow).cpu()
    args = (k_pool.cpu(), v_pool.cpu(), table.cpu(), L, kf, vf)
    want = reference.decode_attention(q.cpu(), *args)
    vmax = reference.dequantize_pages(v_pool.cpu(), table.cpu(), vf).abs().max().item()
    fp16 = fp16_tolerance(v_pool, table, vf)
    delta, fp = logit_bounds(q, k_pool, table, kf, qrow)
    # 1) vs the plain fp32 reference. Every logit of a row moves by at most delta (base 2), so each
    # weight 2^s / sum 2^s moves by a factor within 2^(+-2 delta): sum |w' - w| <= 2^(2 delta) - 1,
    # and the output moves by at most that times max|V|; plus fp16 P and V as the current kernel.
    # (A worst case: the rounding errors of q add up in sign; the typical error is ~sqrt(D) smaller.)
    atol = ((2 ** (2 * delta) - 1) * vmax + fp16)[..., None]
    err = (got - want).abs()
    assert (err <= atol).all(), f"max err {err.max():.3g}, bound {atol.min():.3g}..{atol.max():.3g}"
    # 2) vs the fp32 reference on the kernel's own rounded query (emulated): only fp32 rounding
    # (fp, and the MAGIC sums when qrow) and fp16 P, V remain. Catches a wrong block scale or block
    # order, which the worst-case bound above (~0.1-0.3 * max|V| here) could let through.
    _, x_hat, _ = quantized_query(q.cpu(), qrow)
    want_hat = reference.decode_attention(x_hat, *args, scale=1 / LOG2E)  # scale * log2 e == 1.0
    atol_hat = ((2 ** (2 * fp) - 1) * vmax + fp16)[..., None]
    err_hat = (got - want_hat).abs()
    assert (err_hat <= atol_hat).all(), f"max err {err_hat.max():.3g}, bound {atol_hat.min():.3g}"
    assert err_hat.max() < err.max() or err.max() < fp16  # the rounded query explains the error


@pytest.mark.parametrize("qrow", [False, True])
def test_i8k_split_partials_merge_to_one_pass(qrow, make_pool, gen, device):
    """Split partials, and two segments' partials (key ranges), merged with the current merge ==
    the one-pass result. Same int8 logits in every split; only the fp16 rounding of P relative to
    each split's running max differs (as in test_segments_merge_to_one_pass)."""
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, device, "q4_0", 64, 2, 6, 6, 1000)
    one = decode_attention(q, k_pool, v_pool, table, 1000, kf, vf, n_splits=1, qrow=qrow)
    split = decode_attention(q, k_pool, v_pool, table, 1000, kf, vf, n_splits=4, return_partials=True, qrow=qrow)
    pa = decode_attention(q, k_pool, v_pool, table, 1000, kf, vf, key_end=600, n_splits=3,
                          return_partials=True, qrow=qrow)
    pb = decode_attention(q, k_pool, v_pool, table, 1000, kf, vf, key_start=600, return_partials=True, qrow=qrow)
    atol = fp16_tolerance(v_pool, table, vf)
    torch.testing.assert_close(merge(split, dtype=torch.float32), one.float(), rtol=0, atol=atol)
    torch.testing.assert_close(merge(pa, pb, dtype=torch.float32), one.float(), rtol=0, atol=atol)


def test_other_k_types_call_the_current_kernel(make_pool, gen, device):
    kf, vf = PageFormat("q4_0", 2, 64), PageFormat("q4_0", 2, 64)
    k_pool, v_pool = make_pool(kf, 3), make_pool(vf, 3)
    table = torch.tensor([2, 0], dtype=torch.int32, device=device)
    q = torch.randn(2, 12, 64, generator=gen).to(device)
    assert torch.equal(decode_attention(q, k_pool, v_pool, table, 300, kf, vf),
                       current(q, k_pool, v_pool, table, 300, kf, vf))
