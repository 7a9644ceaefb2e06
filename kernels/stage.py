"""A decode pass's positions, slots and lengths written by the device, in one launch: the static
step buffers a captured step reads (``kvstream.cache.paged_staging``), for a pass whose start
only the device knows or need not wait for the host (a greedy step stages its successor inside
its graph; a drafter stages its next round behind the verify).

``stage_rows(pos, slots, lens, tables, base, offset, n)``: with ``p_i = base + offset + i`` for
``i < n``, writes ``pos[i] = p_i``, ``lens[i] = p_i + 1`` and, for every layer ``l``,
``slots[l, i] = tables[l, p_i // PAGE_TOKENS] * PAGE_TOKENS + p_i % PAGE_TOKENS``; a page index
past the table reads its last column (such a pass never runs: its ``begin`` refuses the length,
or re-plans and stages again). The same numbers as ``reference.stage_rows``'s torch ops, which
took ~12 launches (a few us each on the device, and the host's time to queue them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats import PAGE_TOKENS


# the start's offset and the row count change from call to call: one compiled variant for all
@triton.jit(do_not_specialize=["offset", "n"])
def _stage_rows_kernel(pos, slots, lens, tables, base, offset, n, n_layers, n_pages, stride_s, stride_t,
                       ROWS: tl.constexpr, LAYERS: tl.constexpr, PAGE: tl.constexpr):
    start = tl.load(base) + offset
    # ``base`` may be one of the entries written below (a greedy step stages its successor from its own
    # length): every thread reads it before any writes
    tl.debug_barrier()
    i = tl.arange(0, ROWS)
    row = i < n
    p = start + i
    tl.store(pos + i, p, mask=row)
    tl.store(lens + i, p + 1, mask=row)
    layer = tl.arange(0, LAYERS)[:, None]
    m = (layer < n_layers) & row[None, :]
    page = tl.minimum(p // PAGE, n_pages - 1)[None, :]
    t = tl.load(tables + layer * stride_t + page, mask=m, other=0)
    tl.store(slots + layer * stride_s + i[None, :], t.to(tl.int64) * PAGE + (p % PAGE)[None, :], mask=m)


def stage_rows(pos: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
               base: torch.Tensor, offset: int, n: int) -> None:
    """Rows [base + offset, + n) of a pass into ``pos`` int64 [W], ``slots`` int64 [L, W] (rows
    contiguous), ``lens`` int64 [W] from the page ``tables`` int32 [L, P]; ``base``: int64 [1], on
    the device. One program; stream-ordered after whatever wrote ``base``."""
    width = pos.shape[0]
    if not 0 < n <= width:
        raise ValueError(f"stage_rows: {n} rows do not fit the step buffers' {width}")
    ok = (pos.dim() == lens.dim() == 1 and lens.shape[0] == width and slots.dim() == 2 and slots.shape[1] == width
          and slots.stride(1) == 1 and tables.dim() == 2 and tables.shape[0] == slots.shape[0]
          and tables.stride(1) == 1 and base.numel() == 1)
    if not ok:
        raise ValueError(f"stage_rows: shapes pos {tuple(pos.shape)}, slots {tuple(slots.shape)}, lens "
                         f"{tuple(lens.shape)}, tables {tuple(tables.shape)}, base {tuple(base.shape)} do not fit")
    if any(t.dtype != torch.int64 for t in (pos, slots, lens, base)) or tables.dtype != torch.int32:
        raise ValueError(f"stage_rows needs int64 pos / slots / lens / base and int32 tables, got "
                         f"{pos.dtype} / {slots.dtype} / {lens.dtype} / {base.dtype} and {tables.dtype}")
    layers = slots.shape[0]
    _stage_rows_kernel[(1,)](pos, slots, lens, tables, base, offset, n, layers, tables.shape[1], slots.stride(0),
                             tables.stride(0), ROWS=triton.next_power_of_2(width),
                             LAYERS=triton.next_power_of_2(layers), PAGE=PAGE_TOKENS, num_warps=1)
