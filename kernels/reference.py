"""Plain-torch references: GGML block codec, quantize-on-store, page gather, paged decode
attention with partials and their merge.

The codec follows ``gguf.quants`` operation by operation in float32 (each step a separate
torch op, so nothing is contracted into an FMA): q8_0 ``d = amax / 127``, ``id = 1 / d``,
``q = roundf(x * id)`` (half away from zero); q4_0 ``d = v / -8`` with ``v`` the first
element of largest magnitude, ``q = min(15, trunc(x * id + 8.5))``. The quants use the
float32 ``d``; only the stored scale is rounded to fp16. Non-finite ``x * id`` (only when
``1 / d`` overflows, i.e. every |x| < ~2^-125) gives quant 0, which is what gguf's numpy
float -> uint8 cast gives on x86.

Partials of attention are in base 2: ``m`` = max of ``q.k * scale * log2(e)`` over the
visible keys, ``l = sum 2^(s - m)``, ``acc = sum 2^(s - m) v``; a segment with no visible
key has ``m = -inf, l = 0, acc = 0``. On CPU these functions are the runtime's kernels.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kernels.formats import BLOCK, F16, PAGE_TOKENS, PageFormat, KVType, kv_type

LOG2E = 1.4426950408889634


class Partials(NamedTuple):
    """Unnormalised attention over some keys. m, l: [S, n_q, n_heads]; acc: [S, n_q, n_heads, D]."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor


# ---- GGML codec ------------------------------------------------------------------------

def _finite_or_zero(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v.abs() < 256, v, torch.zeros_like(v))  # NaN/inf -> 0 (x86 numpy cast)


def quantize(x: torch.Tensor, t: str | KVType) -> torch.Tensor:
    """float [..., 32k] -> uint8 [..., k * block_bytes] GGML blocks, byte-exact with gguf."""
    t = kv_type(t)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"last dim must be a multiple of {BLOCK}, got {tuple(x.shape)}")
    lead, n = x.shape[:-1], x.shape[-1] // BLOCK
    if t is F16:
        return x.to(torch.float16).view(torch.uint8).reshape(*lead, n * t.block_bytes)
    b = x.to(torch.float32).reshape(-1, BLOCK)
    if t.code == 1:  # q8_0
        d = b.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        v = b * inv
        a = v.abs()
        fl = a.floor()
        r = _finite_or_zero(torch.sign(v) * (fl + (2 * (a - fl)).floor()))
        qs = r.to(torch.int8).view(torch.uint8)
    else:  # q4_0
        mx = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # first of largest magnitude
        d = mx / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        v = b * inv
        v = v + 8.5
        q = _finite_or_zero(v.trunc()).to(torch.int32).clamp(max=15).to(torch.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
    sc = d.to(torch.float16).view(torch.uint8)
    return torch.cat([sc, qs], dim=-1).reshape(*lead, n * t.block_bytes)


def dequantize(blocks: torch.Tensor, t: str | KVType) -> torch.Tensor:
    """uint8 [..., k * block_bytes] GGML blocks -> float32 [..., 32k] (exact)."""
    t = kv_type(t)
    lead = blocks.shape[:-1]
    b = blocks.reshape(-1, t.block_bytes)
    if t is F16:
        return b.contiguous().view(torch.float16).float().reshape(*lead, -1)
    d = b[:, :2].contiguous().view(torch.float16).float()
    if t.code == 1:
        q = b[:, 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[:, 2:].to(torch.int16)
        q = (torch.cat([qs & 15, qs >> 4], dim=-1) - 8).float()
    return (q * d).reshape(*lead, -1)


# ---- pages -----------------------------------------------------------------------------

def _page_views(pool: torch.Tensor, fmt: PageFormat):
    """pool [n_pages, page_bytes] -> quants [n_pages, H, 256, qrow], scales [n_pages, H, 256, 2*nb]."""
    n, h = pool.shape[0], fmt.n_kv_heads
    q = pool[:, : fmt.scale_offset].view(n, h, PAGE_TOKENS, fmt.qrow_bytes)
    s = pool[:, fmt.scale_offset :].view(n, h, PAGE_TOKENS, fmt.blocks_per_head * fmt.kv_type.scale_bytes)
    return q, s


def _words(x: torch.Tensor) -> torch.Tensor:
    """The same bytes as the widest integer words that divide the last dim: indexing and
    copying uint8 element by element is ~8x slower on CPU than int64 words."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if x.shape[-1] % dt.itemsize == 0:
            return x.view(dt)
    return x


def store(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, fmt: PageFormat) -> None:
    """Quantize rows [n, H, D] into pool [n_pages, page_bytes] at flat slots [n] (page * 256 +
    token); negative slots are skipped."""
    keep = slots >= 0
    rows, slots = rows[keep], slots[keep].long()
    t, nb = fmt.kv_type, fmt.blocks_per_head
    g = quantize(rows, t).view(-1, fmt.n_kv_heads, nb, t.block_bytes)  # [n, H, nb, bb]
    q, s = _page_views(pool, fmt)
    page, tok = slots // PAGE_TOKENS, slots % PAGE_TOKENS
    _words(q)[page, :, tok] = _words(g[..., t.scale_bytes :].reshape(len(slots), fmt.n_kv_heads, -1).contiguous())
    if t.scale_bytes:
        _words(s)[page, :, tok] = _words(g[..., : t.scale_bytes].reshape(len(slots), fmt.n_kv_heads, -1).contiguous())


def dequantize_pages(pool: torch.Tensor, page_ids: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """Pages page_ids [n] of pool -> float32 [n * 256, H, D]."""
    t, nb = fmt.kv_type, fmt.blocks_per_head
    ids = page_ids.long()
    q, s = _page_views(_words(pool).index_select(0, ids).view(torch.uint8), fmt)  # the pages, in order
    qb = q.reshape(-1, nb, t.quant_bytes)
    blocks = torch.cat([s.reshape(-1, nb, t.scale_bytes), qb], -1) if t.scale_bytes else qb
    x = dequantize(blocks.reshape(len(ids), fmt.n_kv_heads, PAGE_TOKENS, -1), t)
    return x.transpose(1, 2).reshape(-1, fmt.n_kv_heads, fmt.head_dim)


def gather(pool, page_ids, n_tokens: int, fmt: PageFormat, dtype=torch.float16) -> torch.Tensor:
    """Pages -> contiguous dequantized [n_tokens, H, D] in dtype (tokens 0.. of page_ids[0])."""
    n_pages = -(-n_tokens // PAGE_TOKENS)
    return dequantize_pages(pool, page_ids[:n_pages], fmt)[:n_tokens].to(dtype)


# ---- attention -------------------------------------------------------------------------

def _key_range(seq_len, key_start, key_end) -> tuple[int, int, int]:
    L = int(seq_len)
    return L, 0 if key_start is None else max(int(key_start), 0), L if key_end is None else min(int(key_end), L)


def range_kv(k_pool, v_pool, page_table, seq_len, k_fmt: PageFormat, v_fmt: PageFormat,
             key_start=None, key_end=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K, V, positions) fp32 of the whole pages that hold keys [key_start, min(key_end, L)),
    V zero outside that range: what ``decode_attention_partials`` reads. Ranges on page
    boundaries concatenate to the rows of their union."""
    L, ks, ke = _key_range(seq_len, key_start, key_end)
    pg0, pg1 = ks // PAGE_TOKENS, max(-(-ke // PAGE_TOKENS), ks // PAGE_TOKENS)
    ids = page_table[pg0:pg1].long()
    k = dequantize_pages(k_pool, ids, k_fmt)  # [T, H, D], token pg0 * 256 + i
    v = dequantize_pages(v_pool, ids, v_fmt)
    pos = pg0 * PAGE_TOKENS + torch.arange(k.shape[0], device=k.device)
    # rows past the range are stale or never-written bytes (may decode to inf/NaN): 0 * NaN
    # would leak into acc, so they are zeroed, as the kernel's masked loads do
    return k, torch.where(((pos >= ks) & (pos < ke))[:, None, None], v, 0.0), pos


def decode_attention_partials(q, k_pool, v_pool, page_table, seq_len, k_fmt: PageFormat,
                              v_fmt: PageFormat, scale=None, key_start=None, key_end=None,
                              kv=None) -> Partials:
    """One-split partials of q [n_q, n_heads, D] at positions [L - n_q, L) over the keys in
    [key_start, min(key_end, L)); page_table[i] is the pool page of logical page i. ``kv``:
    that range's ``range_kv``, when the caller has it (read in rounds)."""
    L, ks, ke = _key_range(seq_len, key_start, key_end)
    n_q, n_heads, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    k, v, pos = kv if kv is not None else range_kv(k_pool, v_pool, page_table, L, k_fmt, v_fmt, ks, ke)
    gqa = n_heads // k_fmt.n_kv_heads
    k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)  # [T, n_heads, D]
    s = torch.einsum("qhd,thd->qht", q.float() * (scale * LOG2E), k)
    qpos = L - n_q + torch.arange(n_q, device=q.device)
    vis = (pos >= ks) & (pos < ke) & (pos[None, :] <= qpos[:, None])  # [n_q, T]
    s = s.masked_fill(~vis[:, None, :], -math.inf)
    m = s.amax(-1) if s.shape[-1] else s.new_full((n_q, n_heads), -math.inf)
    p = torch.exp2(s - torch.where(m == -math.inf, 0.0, m)[..., None])
    acc = torch.einsum("qht,thd->qhd", p, v)
    return Partials(m[None], p.sum(-1)[None], acc[None])


def merge_partials(*parts: Partials) -> Partials:
    """Merge partials over disjoint key sets (any number of splits each) into one split."""
    m = torch.cat([p.m for p in parts])
    l = torch.cat([p.l for p in parts])
    acc = torch.cat([p.acc for p in parts])
    mx = m.amax(0)
    w = torch.exp2(m - torch.where(mx == -math.inf, 0.0, mx))  # -inf splits weigh 0
    return Partials(mx[None], (w * l).sum(0)[None], (w[..., None] * acc).sum(0)[None])


def finalize(p: Partials) -> torch.Tensor:
    """Partials -> attention output float32 [n_q, n_heads, D] (0 where no key is visible)."""
    p = merge_partials(p) if p.m.shape[0] != 1 else p
    l = p.l[0]
    return p.acc[0] / torch.where(l == 0, 1.0, l)[..., None]


def decode_attention(q, k_pool, v_pool, page_table, seq_len, k_fmt, v_fmt, scale=None,
                     key_start=None, key_end=None) -> torch.Tensor:
    """Attention output float32 [n_q, n_heads, D]; see decode_attention_partials."""
    return finalize(decode_attention_partials(q, k_pool, v_pool, page_table, seq_len, k_fmt,
                                              v_fmt, scale, key_start, key_end))


# ---- the layer's elementwise operations (kernels/rms_norm.py, rope.py, swiglu.py) ----------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # the variance in fp32 whatever the compute dtype, as HF and llama.cpp do
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s) * w) with s = x + delta (s = x without delta)."""
    s = x if delta is None else x + delta
    return s, rms_norm(s, w, eps)


def rope_inv_freq(head_dim: int, base: float, device=None, factor: float = 1.0, orig_ctx: int = 0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [D/2], the cos/sin scale) that ``rope_angles`` and ``kernels.rope.rope`` take.

    ``factor`` 1: plain RoPE, base^(-2i/D), scale 1. Above 1, YaRN over an original context
    of ``orig_ctx`` tokens, op for op as transformers' ``_compute_yarn_parameters`` (truncated
    correction range): band i keeps its frequency where it turns more than ``beta_fast`` times over
    ``orig_ctx``, is divided by the factor where it turns fewer than ``beta_slow`` times, and is
    blended linearly between; the scale is 0.1 ln(factor) + 1.
    """
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if factor == 1.0:
        return 1.0 / pos_freqs, 1.0

    def band(turns: float) -> float:  # the (fractional) band index that turns this often over orig_ctx
        return head_dim * math.log(orig_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(band(beta_fast)), 0), min(math.ceil(band(beta_slow)), head_dim - 1)
    if high == low:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device)  # 1: the band keeps its frequency (extrapolates), 0: interpolated
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, 0.1 * math.log(factor) + 1.0


def rope_angles(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """cos, sin [n, 1, D/2] in dtype for positions pos [n], each times ``scale`` (YaRN's
    attention factor) in fp32 before the cast, as transformers scales them."""
    freqs = pos.float()[:, None] * inv_freq[None, :]
    return (freqs.cos() * scale).to(dtype)[:, None, :], (freqs.sin() * scale).to(dtype)[:, None, :]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D]; cos/sin [n, 1, D/2] (NEOX halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor, slots: torch.Tensor, k_fmt: PageFormat, v_fmt: PageFormat) -> torch.Tensor:
    """``kernels.rope_store``: qk [n, n_heads + KVH, D] rotated, its K heads and v stored at ``slots``;
    returns the rotated q heads."""
    qk = rope(qk, cos, sin)
    h = k_fmt.n_kv_heads
    store(k_pool, qk[:, -h:], slots, k_fmt)
    store(v_pool, v, slots, v_fmt)
    return qk[:, :-h]


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---- q8_0 weights (kernels/q8_linear.py) ----------------------------------------------------

def q8_weight(w: torch.Tensor, rows_per_pass: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """float W [N, K] -> (q int8 [K/32, N, 32], d fp16 [K/32, N]): W's q8_0 blocks byte for byte
    as gguf writes them (``quantize``), stored block-major; ``rows_per_pass`` bounds the
    codec's fp32 temporaries."""
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"a q8_0 weight needs K a multiple of {BLOCK}, got [{N}, {K}]")
    q = torch.empty((K // BLOCK, N, BLOCK), dtype=torch.int8, device=w.device)
    d = torch.empty((K // BLOCK, N), dtype=torch.float16, device=w.device)
    for lo in range(0, N, rows_per_pass):
        b = quantize(w[lo:lo + rows_per_pass], "q8_0").view(-1, K // BLOCK, 34)
        d[:, lo:lo + b.shape[0]] = b[..., :2].contiguous().view(torch.float16)[..., 0].T
        q[:, lo:lo + b.shape[0]] = b[..., 2:].contiguous().view(torch.int8).transpose(0, 1)
    return q, d


def q8_dense(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q [K/32, N, 32], d [K/32, N]) -> W float32 [N, K] (exact: int8 x fp16 fits fp32)."""
    return (q.float() * d.float()[..., None]).transpose(0, 1).reshape(q.shape[1], -1)


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., 32k] in fp32 after a round trip through q8_0 blocks (gguf's codec): the values an int8
    dot product multiplies (``kernels/q8_gemv.py`` with ``int8``)."""
    return dequantize(quantize(x.float(), "q8_0"), "q8_0").reshape(x.shape)


def q8_linear(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None,
              rows_per_pass: int = 16384) -> torch.Tensor:
    """x [n, K] @ W^T (+ bias) in float32, rounded once to x's dtype; W dequantized
    ``rows_per_pass`` rows at a time (an LM head's fp32 copy would be ~1 GB)."""
    xf = x.float()
    y = torch.cat([xf @ q8_dense(q[:, lo:lo + rows_per_pass], d[:, lo:lo + rows_per_pass]).T
                   for lo in range(0, q.shape[1], rows_per_pass)], dim=1)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def q8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, K] -> its rows' q8_0 blocks as gguf quantizes them, in row order: (quants int8 [n, K], scales
    fp16 [n, K/32]) (what ``kernels/q8_gemv.py`` takes as ``xq`` and producer kernels write)."""
    q, d = q8_weight(x.float())
    return q.transpose(0, 1).reshape(x.shape).contiguous(), d.T.contiguous()


def q8_rows_dense(xq: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``q8_rows``' blocks -> their fp32 values [n, K] (``q8_round`` of the rows they were made from)."""
    q, d = xq
    return (q.float().view(q.shape[0], -1, BLOCK) * d.float()[..., None]).view(q.shape)


# ---- step staging ----------------------------------------------------------------------

def stage_rows(pos: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
               base: torch.Tensor, offset: int, n: int) -> None:
    """``kernels.stage.stage_rows``: rows [base + offset, + n)'s positions, every layer's slots
    (a page index past the table clamped to its last column) and the lengths after each row."""
    p = base.view(1) + offset + torch.arange(n, device=pos.device)
    pos[:n] = p
    page = (p // PAGE_TOKENS).clamp(max=tables.shape[1] - 1)
    slots[:, :n] = tables[:, page].long() * PAGE_TOKENS + p % PAGE_TOKENS
    lens[:n] = p + 1


# ---- greedy acceptance ------------------------------------------------------------------

def accept(logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
           keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.accept.accept``: (result [accepted, valid count, tokens, the 1 + n argmaxes],
    kept [the accepted drafts, then the target's token after them, repeated]) of a verify pass's
    logits [1 + n, V] for the drafted tokens [n]; ``keep``: synthetic acceptance's draws."""
    n = tokens.shape[0]
    top = logits.argmax(-1)
    ok = (keep if keep is not None else top[:n] == tokens) & valid
    accepted = torch.cumprod(ok.int(), 0).sum()
    result = torch.cat((accepted.view(1).long(), valid.sum().view(1).long(), tokens, top))
    i = torch.arange(n + 1, device=logits.device)
    kept = torch.where(i < accepted, torch.cat((tokens, top[n:])), top.gather(0, accepted.view(1)))
    return result, kept
