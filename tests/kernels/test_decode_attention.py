"""Paged decode attention: reference vs SDPA, kernel vs reference, segments merge, rejects."""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.decode_attention import decode_attention, merge, round_state, splits_for
from kernels.formats import PAGE_TOKENS, PageFormat

# (K type, V type, head_dim, n_kv_heads, GQA, n_q, L, n_splits, q dtype): every type pair,
# head_dim 64/128, GQA 1/6/7, n_q 1..6 and 16, L 1/255/256/257/long, splits none/more than pages
CASES = [
    ("f16", "f16", 64, 1, 1, 1, 1, None, torch.float32),
    ("q8_0", "q8_0", 128, 2, 6, 6, 257, 3, torch.float16),
    ("q8_0", "q4_0", 64, 2, 7, 3, 255, None, torch.float32),
    ("q4_0", "q4_0", 128, 1, 7, 5, 256, 2, torch.float16),
    ("q8_0", "q4_0", 128, 2, 6, 1, 3000, None, torch.float16),
    ("f16", "f16", 128, 2, 6, 4, 2049, 5, torch.float32),
    ("q4_0", "q4_0", 64, 2, 1, 2, 4000, 7, torch.float32),
    ("q8_0", "q8_0", 64, 1, 6, 16, 600, None, torch.float16),
    ("q8_0", "q4_0", 64, 2, 7, 6, 6, 1, torch.float16),
    ("f16", "q4_0", 64, 2, 6, 2, 300, 2, torch.float16),  # f16 with a block type
    ("q8_0", "f16", 128, 1, 6, 3, 520, None, torch.float32),
]


def make_case(make_pool, gen, device, kt, vt, head_dim, n_kv_heads, gqa, n_q, L, dtype):
    kf, vf = PageFormat(kt, n_kv_heads, head_dim), PageFormat(vt, n_kv_heads, head_dim)
    n_pages = -(-L // PAGE_TOKENS)
    k_pool, v_pool = make_pool(kf, 2 * n_pages + 1), make_pool(vf, 2 * n_pages + 1)
    table = torch.randperm(2 * n_pages + 1, generator=gen)[:n_pages].int().to(device)  # sparse, permuted
    q = torch.randn(n_q, n_kv_heads * gqa, head_dim, generator=gen).to(dtype).to(device)
    return q, k_pool, v_pool, table, kf, vf


def tolerance(v_pool, table, vf):
    """Kernel vs fp32 reference: q, K, V and the probabilities are rounded to fp16 for tl.dot
    (2^-11 relative each) and the output to q.dtype; the output is a convex combination of V
    rows, so its error stays below ~2^-11 * a few * max|V|. We allow 4e-3 * max|V|."""
    vmax = reference.dequantize_pages(v_pool.cpu(), table.cpu(), vf).abs().max().item()
    return 4e-3 * vmax


@pytest.mark.parametrize("case", [c[:7] for c in CASES[:5]])
def test_reference_matches_sdpa(case, make_pool, gen):
    kt, vt, head_dim, n_kv_heads, gqa, n_q, L = case
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, "cpu", *case, torch.float32)
    k = reference.dequantize_pages(k_pool.cpu(), table.cpu(), kf)[:L]
    v = reference.dequantize_pages(v_pool.cpu(), table.cpu(), vf)[:L]
    mask = torch.arange(L)[None, :] <= (L - n_q + torch.arange(n_q))[:, None]  # causal block
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)
    got = reference.decode_attention(q, k_pool.cpu(), v_pool.cpu(), table.cpu(), L, kf, vf)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # both fp32; summation order only


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:8])))
def test_kernel_matches_reference(case, make_pool, gen, device):
    *shape, n_splits, dtype = case
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, device, *shape, dtype)
    L = shape[6]
    got = decode_attention(q, k_pool, v_pool, table, L, kf, vf, n_splits=n_splits)
    want = reference.decode_attention(q.cpu(), k_pool.cpu(), v_pool.cpu(), table.cpu(), L, kf, vf)
    assert got.dtype == q.dtype and got.shape == q.shape
    # fp16 rounding of q, K, V and p for tl.dot, of the output to q.dtype: see tolerance()
    torch.testing.assert_close(got.cpu().float(), want, rtol=0, atol=tolerance(v_pool, table, vf))


@pytest.mark.parametrize("kt,L,n_q,key_start,key_end,n_splits", [
    ("q8_0", 1, 1, None, None, None), ("q4_0", 255, 6, None, None, 2),
    ("f16", 256, 3, None, None, None), ("q8_0", 257, 6, None, None, 3),
    ("q4_0", 3001, 4, 700, None, 5), ("q8_0", 3001, 2, 255, 2049, 7),
    ("q8_0", 600, 5, 597, None, 1), ("q4_0", 600, 16, None, 590, 2),
    # the whole tiles' loop (no masks) ends exactly at a tile edge: the causal edge, the key range's end
    ("q8_0", 1039, 16, None, None, 3), ("q4_0", 1100, 2, 64, 768, 4)])
def test_visible_keys_exact(kt, L, n_q, key_start, key_end, n_splits, make_pool, gen, device):
    """Every K row equal -> every visible key gets weight exactly 1, so each output row is
    the plain mean of the V rows it may see (causal, key range, splits; the kernel masks only the
    tiles a range's edges cut, so a key dropped or added at an edge shows). f16 V and P = 1 are
    exact in fp16, so only fp32 summation order remains (1e-5); one key missing or extra at
    L = 3001 moves the mean by ~1e-4 * max|V| or more."""
    head_dim, n_kv_heads, gqa = 128, 2, 7
    kf, vf = PageFormat(kt, n_kv_heads, head_dim), PageFormat("f16", n_kv_heads, head_dim)
    n_pages = -(-L // PAGE_TOKENS)
    k_pool = torch.empty(n_pages + 2, kf.page_bytes, dtype=torch.uint8)
    c = torch.randn(1, n_kv_heads, head_dim, generator=gen)
    reference.store(k_pool, c.expand(k_pool.shape[0] * PAGE_TOKENS, -1, -1),
                    torch.arange(k_pool.shape[0] * PAGE_TOKENS), kf)
    v_pool = make_pool(vf, n_pages + 2)
    table = torch.randperm(n_pages + 2, generator=gen)[:n_pages].int().to(device)
    q = torch.randn(n_q, n_kv_heads * gqa, head_dim, generator=gen).to(device)
    got = decode_attention(q, k_pool.to(device), v_pool, table, L, kf, vf, key_start=key_start,
                           key_end=key_end, n_splits=n_splits, return_partials=True)
    got = merge(got, dtype=torch.float32).cpu()
    v = reference.dequantize_pages(v_pool.cpu(), table.cpu(), vf)[:L].repeat_interleave(gqa, 1)
    ks, ke = key_start or 0, min(L, L if key_end is None else key_end)
    for i in range(n_q):
        hi = min(ke, L - n_q + i + 1)  # keys [ks, hi) visible to query i
        want = v[ks:hi].mean(0) if hi > ks else torch.zeros_like(v[0])
        # K rows all equal: weights exactly 1, fp32 summation order only (docstring)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kt,vt,boundary", [("q8_0", "q4_0", 600), ("f16", "f16", 512),
                                            ("q4_0", "q8_0", 1)])
def test_segments_merge_to_one_pass(kt, vt, boundary, make_pool, gen, device):
    """Resident pages (arena pool) + streamed pages (ring pool), each with its own page table
    and key range, merged from partials == one pass over one table."""
    head_dim, n_kv_heads, gqa, n_q, L = 64, 2, 6, 5, 1500
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, device, kt, vt, head_dim,
                                                 n_kv_heads, gqa, n_q, L, torch.float32)
    n_pages = table.shape[0]
    first_b = boundary // PAGE_TOKENS  # first page segment B reads (shares it if unaligned)
    ring = torch.randperm(8, generator=gen)[: n_pages - first_b].int().to(device)
    k_ring = torch.zeros(8, kf.page_bytes, dtype=torch.uint8, device=device)
    v_ring = torch.zeros(8, vf.page_bytes, dtype=torch.uint8, device=device)
    k_ring[ring.long()], v_ring[ring.long()] = k_pool[table[first_b:].long()], v_pool[table[first_b:].long()]
    table_a = torch.full_like(table, -1)  # entries outside a segment are never read
    table_a[: -(-boundary // PAGE_TOKENS)] = table[: -(-boundary // PAGE_TOKENS)]
    table_b = torch.full_like(table, -1)
    table_b[first_b:] = ring

    one = decode_attention(q, k_pool, v_pool, table, L, kf, vf)
    pa = decode_attention(q, k_pool, v_pool, table_a, L, kf, vf, key_end=boundary,
                          n_splits=3, return_partials=True)
    pb = decode_attention(q, k_ring, v_ring, table_b, L, kf, vf, key_start=boundary,
                          return_partials=True)
    empty = decode_attention(q, k_ring, v_ring, table_b, L, kf, vf, key_start=boundary,
                             key_end=boundary, n_splits=2, return_partials=True)
    assert torch.all(empty.m == -math.inf) and not empty.l.any() and not empty.acc.any()
    merged = merge(pa, empty, pb, dtype=torch.float32)
    # same fp32 math, regrouped: the fp16 rounding of probabilities is relative to each
    # split's running max, so merged and one-pass differ like kernel and reference do
    atol = tolerance(v_pool, table, vf)
    torch.testing.assert_close(merged, one, rtol=0, atol=atol)
    ref = reference.decode_attention(q.cpu(), k_pool.cpu(), v_pool.cpu(), table.cpu(), L, kf, vf)
    torch.testing.assert_close(merged.cpu(), ref, rtol=0, atol=atol)

    # the reference's merge is the same math in fp32 only: tight
    args = (q.cpu(), k_pool.cpu(), v_pool.cpu(), table.cpu(), L, kf, vf)
    ra = reference.decode_attention_partials(*args, key_end=boundary)
    rb = reference.decode_attention_partials(*args, key_start=boundary)
    torch.testing.assert_close(reference.finalize(reference.merge_partials(ra, rb)), ref,
                               rtol=1e-5, atol=1e-6)

    # the three calls' partials written side by side into one buffer (as a paged cache's
    # rounds do) merge as one, without a copy: the same rows, so bit-identical
    n = [len(x.m) for x in (pa, empty, pb)]
    buf = reference.Partials(*(torch.full((sum(n) + 5, *x.shape[1:]), math.nan, device=device)
                               for x in pa))  # 5 rows more, never written nor read
    rest = lambda used: reference.Partials(*(x[used:] for x in buf))  # noqa: E731
    got = [decode_attention(q, k_pool, v_pool, table_a, L, kf, vf, key_end=boundary, n_splits=3,
                            return_partials=True, partials=rest(0)),
           decode_attention(q, k_ring, v_ring, table_b, L, kf, vf, key_start=boundary, key_end=boundary,
                            n_splits=2, return_partials=True, partials=rest(n[0])),
           decode_attention(q, k_ring, v_ring, table_b, L, kf, vf, key_start=boundary, return_partials=True,
                            partials=rest(n[0] + n[1]))]
    assert all(g.acc.data_ptr() == buf.acc[u:].data_ptr() for g, u in zip(got, (0, n[0], n[0] + n[1])))
    assert torch.equal(merge(reference.Partials(*(x[:sum(n)] for x in buf)), dtype=torch.float32), merged)

    # lengths as device tensors (CUDA-graph form) give bit-identical results
    t = lambda x: torch.tensor([x], device=device)  # noqa: E731
    pb_t = decode_attention(q, k_ring, v_ring, table_b, t(L), kf, vf, key_start=t(boundary),
                            return_partials=True)
    assert all(torch.equal(x, y) for x, y in zip(pb, pb_t))


def test_layer_and_round_offsets_need_no_new_kernel_variants():
    """Triton compiles a kernel variant per 16-byte alignment of each pointer it specializes on (its
    own specialization function decides here, on CPU). A paged cache passes each layer a row of its
    page tables, and each round key scalars and rows of one partials buffer, at offsets that follow
    the layer and the plan. Specialized, rows of 73 int32 pages gave layers 1-3 (mod 4) other
    variants than layer 0, compiled at their first multi-round step in mid-decode (a 2.3-2.5 s step
    on the H200). One variant serves every such offset now."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    import kernels.decode_attention as da
    import kernels.gather as ga

    def keys(kernel):
        free = getattr(kernel, "do_not_specialize_on_alignment", None)
        if free is None:  # the interpreter's function keeps its options in kwargs
            free = kernel.kwargs["do_not_specialize_on_alignment"]
        return lambda name, t: native_specialize_impl(BaseBackend, t, False, True, name not in set(free or ()))

    key = keys(da._decode_attention_kernel)
    tables = torch.zeros(28, 73, dtype=torch.int32)
    assert len({key("page_table", tables[layer]) for layer in range(28)}) == 1
    flat = torch.zeros(6, dtype=torch.int64)  # (start, end) of 3 rounds
    assert len({key(n, flat[i:i + 1]) for n in ("p_len", "p_start", "p_end") for i in range(6)}) == 1
    m = torch.zeros(300, 5, 14)  # partials m / l of 5 queries x 14 heads (the 0.5B): 280-byte rows
    assert len({key(n, m[u:]) for n in ("part_m", "part_l") for u in range(4)}) == 1
    acc = torch.zeros(300, 5, 14, 64)  # rows of head_dim x 4 bytes: always 16-byte aligned, specialized
    assert {key("part_acc", acc[u:])[1] for u in range(4)} == {"D"}
    # prefill gathers a round's pages: a slice of a row
    assert len({keys(ga._gather_kernel)("page_ids", tables[3][a:]) for a in range(4)}) == 1


def test_merge_many_splits(gen, device):
    """More splits than one merge pass takes (256), some of them empty (m = -inf)."""
    S, n_q, n_heads, d = 300, 2, 3, 64
    m = torch.randn(S, n_q, n_heads, generator=gen) * 4
    m[::7] = -math.inf
    l = torch.rand(S, n_q, n_heads, generator=gen) + 0.5
    l[::7] = 0
    acc = torch.randn(S, n_q, n_heads, d, generator=gen) * l[..., None]
    acc[::7] = 0
    parts = reference.Partials(m, l, acc)
    got = merge(reference.Partials(*(x.to(device) for x in parts)), dtype=torch.float32)
    torch.testing.assert_close(got.cpu(), reference.finalize(parts), rtol=1e-5, atol=1e-6)  # fp32 sums


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_merge_writes_the_outputs_q8_blocks(dtype, make_pool, gen, device):
    """``q8_out``: the output rows' q8_0 blocks (the output projection's ``xq``) are gguf's codec of the
    rounded output, bit for bit (``reference.q8_rows``), and the output is the one without them; a
    single split's call then takes the merge too."""
    n_q, L = 2, 700
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, device, "q8_0", "q4_0", 128, 2, 6, n_q, L, dtype)
    for n_splits in (1, 3):
        q8 = (torch.empty(n_q, 12 * 128, dtype=torch.int8, device=device),
              torch.empty(n_q, 12 * 4, dtype=torch.float16, device=device))
        out = decode_attention(q, k_pool, v_pool, table, L, kf, vf, n_splits=n_splits, q8_out=q8)
        want_q, want_d = reference.q8_rows(out.reshape(n_q, -1).cpu())
        assert torch.equal(q8[0].cpu(), want_q) and torch.equal(q8[1].cpu(), want_d)
        if n_splits > 1:  # the same merge, its blocks written beside
            assert torch.equal(out, decode_attention(q, k_pool, v_pool, table, L, kf, vf, n_splits=n_splits))


def test_decode_rejects_bad_inputs(device):
    kf, vf = PageFormat("q8_0", 2, 64), PageFormat("q4_0", 2, 64)
    kp = torch.zeros(3, kf.page_bytes, dtype=torch.uint8, device=device)
    vp = torch.zeros(3, vf.page_bytes, dtype=torch.uint8, device=device)
    table = torch.arange(3, dtype=torch.int32, device=device)
    q = torch.randn(2, 12, 64, device=device)
    ok = lambda **kw: dict(dict(q=q, k_pool=kp, v_pool=vp, page_table=table, seq_len=600,  # noqa: E731
                                k_fmt=kf, v_fmt=vf), **kw)
    bad = [
        (dict(q=q.to(torch.int32)), "q must be .* in"),
        (dict(q=torch.randn(2, 12, 128, device=device)[..., ::2]), "last dim contiguous"),
        (dict(q=torch.randn(2, 12, 128, device=device)), r"q must be \[n_q, a multiple of 2, 64\]"),
        (dict(q=torch.randn(2, 11, 64, device=device)), "a multiple of 2"),
        (dict(q=torch.randn(17, 12, 64, device=device)), r"n_q must be in \[1, 16\]"),
        (dict(q=torch.randn(16, 24, 64, device=device)), "must be <= 128"),
        (dict(page_table=table.long()), "page_table must be contiguous int32"),
        (dict(k_pool=vp), rf"k_pool must be uint8 \[n_pages, {kf.page_bytes}\]"),
        (dict(v_fmt=PageFormat("q4_0", 1, 64)), "must agree on n_kv_heads"),
        (dict(seq_len=torch.tensor([600.0], device=device)), "seq_len must be an int or a 1-element"),
        (dict(seq_len=800), r"covers 768 tokens, the key range needs 800 \(4 pages\)"),
        (dict(n_splits=3, partials=reference.Partials(*(torch.empty(2, 2, 12, *d, device=device)
                                                         for d in ((), (), (64,))))),
         r"partials must be contiguous fp32 m, l \[>= 3, 2, 12\]"),
        (dict(out=torch.empty(2, 12, 32, device=device)), r"out must be \[2, 12, 64\] in"),
        (dict(out=torch.empty(2, 12, 128, device=device)[..., ::2]), r"out must be .* last dim contiguous"),
        (dict(out=q.to(torch.int32)), r"out must be \[2, 12, 64\] in"),
        (dict(page_table=table.to("meta")), "must share a device"),
        (dict(q8_out=(torch.empty(2, 768, dtype=torch.int8, device=device),
                      torch.empty(2, 12, dtype=torch.float16, device=device))), r"q8_out must be contiguous"),
        (dict(return_partials=True, q8_out=(torch.empty(2, 768, dtype=torch.int8, device=device),
                                            torch.empty(2, 24, dtype=torch.float16, device=device))),
         "returns partials has none"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            decode_attention(**ok(**kw))


def test_merge_rejects_bad_partials(device):
    part = lambda S, n_q=2, h=3, d=64, dt=torch.float32: reference.Partials(  # noqa: E731
        torch.zeros(S, n_q, h, dtype=dt, device=device), torch.zeros(S, n_q, h, dtype=dt, device=device),
        torch.zeros(S, n_q, h, d, dtype=dt, device=device))
    bad = [
        ((), {}, "merge needs at least one Partials"),
        ((part(2, dt=torch.float16),), {}, r"partials must be fp32 m, l \[S, 2, 3\]"),
        ((part(2), part(2, h=4)), {}, r"acc \[S, 2, 3, 64\], got .* \(2, 2, 4, 64\)"),
        ((part(2),), dict(out=torch.empty(2, 3, 32, device=device)), r"out must be \[2, 3, 64\]"),
        ((part(2),), dict(out=torch.empty(2, 3, 128, device=device)[..., ::2]), "last dim contiguous"),
        ((part(2),), dict(q8_out=(torch.empty(2, 192, dtype=torch.int8, device=device),
                                  torch.empty(2, 6, dtype=torch.float32, device=device))), "q8_out must be contiguous"),
    ]
    for args, kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            merge(*args, **kw)


@pytest.mark.bigmem
@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_decode_past_2gib(t, big_pool, make_pool, gen, device):
    fmt = PageFormat(t, 1, 64)
    pool, ids = big_pool(fmt)  # one page table for K and V: both read this pool (K = V data)
    table = torch.tensor([ids[-1], ids[0], ids[1]], dtype=torch.int32, device=device)
    pool[table.long()] = make_pool(fmt, 3)
    q = torch.randn(2, 6, 64, generator=gen).to(device)
    got = decode_attention(q, pool, pool, table, 700, fmt, fmt, n_splits=2)
    small = pool[table.long()].cpu()
    want = reference.decode_attention(q.cpu(), small, small, torch.arange(3, dtype=torch.int32),
                                      700, fmt, fmt)
    # the same fp16 roundings as test_kernel_matches_reference (tolerance())
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=tolerance(small, torch.arange(3), fmt))


@pytest.mark.parametrize("kt,vt,L,n_q,cuts,n_sm,n_kv", [
    ("q8_0", "q4_0", 1000, 3, (256, 512), 4, 2),   # splits straddle the rounds
    ("f16", "f16", 700, 1, (256,), 1, 4),          # one split: the last round writes the output
    ("q4_0", "q4_0", 2049, 6, (512, 1024, 1536, 2048), 4, 2),  # a last round of one key
    ("q8_0", "q8_0", 600, 16, (256,), 132, 2),     # more splits than tiles: some never get one
])
def test_rounds_equal_one_call(kt, vt, L, n_q, cuts, n_sm, n_kv, make_pool, gen, device, monkeypatch):
    """Keys read in rounds (page-aligned ranges in order, as a streaming cache reads its ring):
    each of one call's splits carried across the rounds gives the one call's output, bit for
    bit (same tiles, same order, same merge)."""
    import kernels.decode_attention as da

    monkeypatch.setattr(da, "_n_sm", lambda _: n_sm)
    q, k_pool, v_pool, table, kf, vf = make_case(make_pool, gen, device, kt, vt, 64, n_kv, 12 // n_kv, n_q, L,
                                                 torch.float16)
    one = decode_attention(q, k_pool, v_pool, table, L, kf, vf)
    state = round_state(q, table, kf)
    assert state.m.shape[0] == splits_for(n_q, 12, n_kv, table.shape[0] * PAGE_TOKENS, device)
    assert (state.m.shape[0] == 1) == (n_kv == 4)
    for x in state:
        x.fill_(float("nan"))  # never-written rows would show
    edges = [0, *cuts, None]
    for r in range(len(edges) - 1):
        last = r == len(edges) - 2
        got = decode_attention(q, k_pool, v_pool, table, L, kf, vf, key_start=edges[r], key_end=edges[r + 1],
                               partials=state, carry=r > 0, return_partials=not last)
    assert torch.equal(got, one)
