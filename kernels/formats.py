"""KV page formats: GGML block types and the layout of one page.

A page holds ``PAGE_TOKENS`` (256) token rows of one layer's K (or V) for all KV heads.
Its GGML form is 256 rows of ``n_kv_heads * head_dim`` values in GGML blocks of 32
(q8_0: fp16 scale + 32 int8 = 34 bytes; q4_0: fp16 scale + 16 bytes, byte j holds element
j in its low nibble and element j + 16 in its high nibble = 18 bytes; f16: plain fp16).

In memory (device pool, host store, ring slots) a page is *split*, head-major:

    [ quants: n_kv_heads x 256 x qrow bytes | scales: n_kv_heads x 256 x head_dim/32 fp16 ]

where ``qrow`` is the quant bytes of one (head, token) row (q8_0: head_dim, q4_0: head_dim/2,
f16: 2*head_dim with no scale section). Why: one KV head's 256 rows are one contiguous run,
so an attention program streams its head without touching the others, every quant row
starts 16-byte aligned (wide loads; a GGML block is 34 or 18 bytes, never aligned), and
the scales of a tile are one small contiguous run. Within a row the block order and the
q4_0 nibble order are GGML's. The page has exactly the GGML byte size, so capacity math
is the same as for GGML rows; ``page_to_ggml`` / ``ggml_to_page`` convert byte-exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_TOKENS = 256  # tokens per page
BLOCK = 32  # values per GGML block
HEAD_DIMS = (64, 128)  # head sizes the kernels support (power-of-two halves of 32-blocks)


@dataclass(frozen=True)
class KVType:
    """One GGML block type: ``code`` is the constexpr the kernels branch on."""

    name: str
    code: int
    block_bytes: int  # bytes of 32 values in GGML form
    quant_bytes: int  # bytes of those 32 values without the scale
    scale_bytes: int  # 2 (fp16 scale) or 0


F16 = KVType("f16", 0, 64, 64, 0)
Q8_0 = KVType("q8_0", 1, 34, 32, 2)
Q4_0 = KVType("q4_0", 2, 18, 16, 2)
KV_TYPES = {t.name: t for t in (F16, Q8_0, Q4_0)}


def kv_type(t: str | KVType) -> KVType:
    """The KVType for a name ("f16", "q8_0", "q4_0") or the type itself."""
    if isinstance(t, KVType):
        return t
    if t not in KV_TYPES:
        raise ValueError(f"unknown KV type {t!r}; expected one of {sorted(KV_TYPES)}")
    return KV_TYPES[t]


@dataclass(frozen=True)
class PageFormat:
    """Pages of one pool: block type, KV heads, head size. All sizes in bytes."""

    kv_type: KVType
    n_kv_heads: int
    head_dim: int

    def __post_init__(self):
        object.__setattr__(self, "kv_type", kv_type(self.kv_type))
        if self.n_kv_heads < 1:
            raise ValueError(f"n_kv_heads must be >= 1, got {self.n_kv_heads}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")

    def __str__(self) -> str:
        return f"{self.kv_type.name} pages of {self.n_kv_heads} KV heads x {self.head_dim}"

    @property
    def blocks_per_head(self) -> int:
        return self.head_dim // BLOCK

    @property
    def qrow_bytes(self) -> int:
        """Quant bytes of one (head, token) row."""
        return self.blocks_per_head * self.kv_type.quant_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's GGML row (all KV heads)."""
        return self.n_kv_heads * self.blocks_per_head * self.kv_type.block_bytes

    @property
    def page_bytes(self) -> int:
        return PAGE_TOKENS * self.row_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scale section in a page (= page_bytes for f16)."""
        return PAGE_TOKENS * self.n_kv_heads * self.qrow_bytes

    def row_spans(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(byte offset, bytes) of the runs in a page that hold token rows [lo, hi): the whole page
        as one run, else one run per KV head in the quants and one in the scales (head-major)."""
        if not 0 <= lo < hi <= PAGE_TOKENS:
            raise ValueError(f"token rows [{lo}, {hi}) are not in a page of {PAGE_TOKENS}")
        if (lo, hi) == (0, PAGE_TOKENS):
            return [(0, self.page_bytes)]
        sections = [(0, self.qrow_bytes)]
        if self.kv_type.scale_bytes:
            sections.append((self.scale_offset, self.blocks_per_head * self.kv_type.scale_bytes))
        return [(base + (h * PAGE_TOKENS + lo) * row, (hi - lo) * row)
                for base, row in sections for h in range(self.n_kv_heads)]


def page_bytes(n_kv_heads: int, head_dim: int, t: str | KVType) -> int:
    """Bytes of one page: 256 tokens of one layer's K (or V), all KV heads."""
    return PageFormat(kv_type(t), n_kv_heads, head_dim).page_bytes


def page_to_ggml(pages: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """uint8 [..., page_bytes] split pages -> uint8 [..., 256, row_bytes] GGML rows."""
    t, h, nb = fmt.kv_type, fmt.n_kv_heads, fmt.blocks_per_head
    lead = pages.shape[:-1]
    q = pages[..., : fmt.scale_offset].reshape(*lead, h, PAGE_TOKENS, nb, t.quant_bytes)
    parts = [q]
    if t.scale_bytes:
        s = pages[..., fmt.scale_offset :].reshape(*lead, h, PAGE_TOKENS, nb, t.scale_bytes)
        parts = [s, q]
    rows = torch.cat(parts, dim=-1).transpose(-4, -3)  # [..., 256, h, nb, block_bytes]
    return rows.reshape(*lead, PAGE_TOKENS, fmt.row_bytes)


def ggml_to_page(rows: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """uint8 [..., 256, row_bytes] GGML rows -> uint8 [..., page_bytes] split pages."""
    t, h, nb = fmt.kv_type, fmt.n_kv_heads, fmt.blocks_per_head
    lead = rows.shape[:-2]
    b = rows.reshape(*lead, PAGE_TOKENS, h, nb, t.block_bytes).transpose(-4, -3)
    q = b[..., t.scale_bytes :].reshape(*lead, -1)
    if not t.scale_bytes:
        return q.contiguous()
    s = b[..., : t.scale_bytes].reshape(*lead, -1)
    return torch.cat([q, s], dim=-1)
