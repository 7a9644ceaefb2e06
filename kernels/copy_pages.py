"""Row copy by index lists: ``dst[dst_rows[i]] = src[src_rows[i]]``, one launch, for streaming
pages host -> device ring slots with SM loads instead of the copy engine.

``copy_rows(src, dst, src_rows, dst_rows)``: src, dst are 2-D uint8 tensors of one row width
(a multiple of 16 bytes; rows contiguous, 16-byte aligned); src is a pinned host tensor (read
zero-copy: under unified addressing its address is valid on the device, and Triton's launcher
accepts it, resolving it with ``cuPointerGetAttribute``) or a tensor on dst's device; the
index lists are int32 / int64 tensors on dst's device, so a launch can be captured in a CUDA
graph (the grid comes from shapes only). ``copy_jobs`` does one or two such jobs (K and V
pages, rows of different widths) in one launch. Bytes are copied exactly, 16 per load.

Each program takes 16 KB tiles (rows split in blocks of up to 4 KB; a tile holds one job's
blocks) round robin over both jobs' tiles: a tile's
loads are all issued before its stores, so ``programs`` x 16 KB are in flight (PCIe needs
~55 GB/s x ~1.5 us ~ 80 KB to run at its rate). The tile loads are volatile (sm_90 PTX:
``ld.volatile.global.v4.b32``, SASS ``LDG.E.128.STRONG.SYS``, all 8 of a thread's issued before
its stores): the L2 may cache system-memory lines and the host store changes between copies
(Triton 3.6 drops ``cache_modifier=".cv"`` on NVIDIA, so ``.cv`` is not an option). Not
checked (that would read values back to the host):
indices in range; repeated destination rows (they race: which source wins is undefined;
repeated source rows are fine).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INDEX_DTYPES = (torch.int32, torch.int64)
TILE_WORDS = 4096  # 16 KB of int32 words per tile: 8 16-byte loads per thread at 4 warps
MAX_BLOCK_WORDS = 1024  # a row is split in blocks of up to 4 KB (real pages: 17 / 9 whole blocks)
NUM_WARPS = 4
# Unmeasured default: 32 programs x 16 KB = 512 KB in flight, several times the link's
# bandwidth-delay product; experiments/bench_copies.py sweeps 8..132 (kernel_layer / kernel_step).
DEFAULT_PROGRAMS = 32


@triton.jit
def _copy_tiles(
    src,  # [*, ROW_WORDS * 4] uint8, host (pinned) or device, 16-byte aligned rows
    dst,  # [*, ROW_WORDS * 4] uint8, device
    src_rows,  # [n] int32 / int64
    dst_rows,  # [n] int32 / int64
    n,
    first,  # this program's tiles of the job: first, first + step, ...
    step,
    ROW_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,  # int32 words per block (a power of two)
    ITEMS: tl.constexpr,  # blocks per tile
):
    BLOCKS: tl.constexpr = (ROW_WORDS + BLOCK - 1) // BLOCK
    n_items = n.to(tl.int64) * BLOCKS
    p_src = src.to(tl.pointer_type(tl.int32))
    p_dst = dst.to(tl.pointer_type(tl.int32))
    o_i = tl.arange(0, ITEMS)
    o_w = tl.arange(0, BLOCK)
    for i_t in range(first, tl.cdiv(n_items, ITEMS), step):
        o_item = i_t * ITEMS + o_i  # [ITEMS] blocks: row o_item // BLOCKS of the index lists
        m_i = o_item < n_items
        i_r = tl.where(m_i, o_item, 0) // BLOCKS
        o_blk = (o_item % BLOCKS) * BLOCK
        o_s = tl.load(src_rows + i_r, mask=m_i, other=0).to(tl.int64) * ROW_WORDS + o_blk
        o_d = tl.load(dst_rows + i_r, mask=m_i, other=0).to(tl.int64) * ROW_WORDS + o_blk
        m_x = m_i[:, None] & (o_w[None, :] < (ROW_WORDS - o_blk)[:, None])  # a multiple of 4 words
        b_x = tl.load(p_src + o_s[:, None] + o_w[None, :], mask=m_x, volatile=True)
        tl.store(p_dst + o_d[:, None] + o_w[None, :], b_x, mask=m_x)


@triton.jit(do_not_specialize=["a_n", "b_n"])
def _copy_kernel(
    a_src, a_dst, a_src_rows, a_dst_rows, a_n,  # job a, as _copy_tiles
    b_src, b_dst, b_src_rows, b_dst_rows, b_n,  # job b (ignored unless TWO)
    A_ROW_WORDS: tl.constexpr,
    A_BLOCK: tl.constexpr,
    A_ITEMS: tl.constexpr,
    B_ROW_WORDS: tl.constexpr,
    B_BLOCK: tl.constexpr,
    B_ITEMS: tl.constexpr,
    TWO: tl.constexpr,
):
    # Tiles never mix jobs (a select between two jobs' pointers costs the 16-byte accesses in
    # Triton 3.9): job b's tiles follow job a's in one round robin over all tiles.
    i_p = tl.program_id(0).to(tl.int64)  # so the tile loops' counters are int64
    n_p = tl.num_programs(0).to(tl.int64)
    _copy_tiles(a_src, a_dst, a_src_rows, a_dst_rows, a_n, i_p, n_p, A_ROW_WORDS, A_BLOCK, A_ITEMS)
    if TWO:
        a_tiles = tl.cdiv(a_n.to(tl.int64) * ((A_ROW_WORDS + A_BLOCK - 1) // A_BLOCK), A_ITEMS)
        _copy_tiles(b_src, b_dst, b_src_rows, b_dst_rows, b_n, (i_p + n_p - a_tiles % n_p) % n_p, n_p,
                    B_ROW_WORDS, B_BLOCK, B_ITEMS)


def _check_job(job, name: str) -> None:
    if not (isinstance(job, (tuple, list)) and len(job) == 4):
        raise ValueError(f"{name} must be a (src, dst, src_rows, dst_rows) tuple, got {type(job).__name__}"
                         f"{' of ' + str(len(job)) if isinstance(job, (tuple, list)) else ''}")
    src, dst, src_rows, dst_rows = job
    for t, what in ((src, "src"), (dst, "dst"), (src_rows, "src_rows"), (dst_rows, "dst_rows")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} {what} must be a torch.Tensor, got {type(t).__name__}")
    for t, what in ((src, "src"), (dst, "dst")):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name} {what} must be a 2-D uint8 tensor [rows, bytes], got {t.dtype} {tuple(t.shape)}")
    width = dst.shape[1]
    if src.shape[1] != width:
        raise ValueError(f"{name} src and dst rows must have one width, got {src.shape[1]} and {width} bytes")
    if width == 0 or width % 16:
        raise ValueError(f"{name} row width must be a positive multiple of 16 bytes (16-byte loads), got {width}")
    for t, what in ((src, "src"), (dst, "dst")):
        if t.stride() != (width, 1) and t.shape[0] > 1:
            raise ValueError(f"{name} {what} rows must be contiguous: stride ({width}, 1) expected, got {t.stride()}")
        if t.stride(1) != 1:
            raise ValueError(f"{name} {what} bytes must be contiguous (stride 1), got strides {t.stride()}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} {what} must start 16-byte aligned, data_ptr % 16 = {t.data_ptr() % 16}")
    for t, what in ((src_rows, "src_rows"), (dst_rows, "dst_rows")):
        if t.dtype not in INDEX_DTYPES or t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} {what} must be a contiguous 1-D int32 / int64 tensor, got {t.dtype} "
                             f"{tuple(t.shape)} stride {t.stride()}")
        if t.device != dst.device:
            raise ValueError(f"{name} {what} must be on dst's device {dst.device} (read by the kernel; no "
                             f"host round trip, so the launch can be graph-captured), got {t.device}")
    if src_rows.numel() != dst_rows.numel():
        raise ValueError(f"{name} src_rows and dst_rows must have one length, got {src_rows.numel()} "
                         f"and {dst_rows.numel()}")
    if dst.device.type == "cuda" and src.device.type == "cpu":
        if not src.is_pinned():
            raise ValueError(f"{name} src on the host must be pinned (page-locked, so the GPU can read it "
                             f"zero-copy), got pageable memory; use .pin_memory()")
    elif src.device != dst.device:
        raise ValueError(f"{name} src must be on dst's device {dst.device} (or pinned host memory for a "
                         f"CUDA dst), got {src.device}")


def copy_jobs(jobs, programs: int | None = None) -> None:
    """One launch for one or two jobs ``(src, dst, src_rows, dst_rows)`` (e.g. a layer's K and V
    pages): ``dst[dst_rows[i]] = src[src_rows[i]]`` for each, on the current stream."""
    if not isinstance(jobs, (tuple, list)) or len(jobs) not in (1, 2):
        raise ValueError(f"jobs must be a list of 1 or 2 (src, dst, src_rows, dst_rows) tuples, got "
                         f"{len(jobs) if isinstance(jobs, (tuple, list)) else type(jobs).__name__}")
    for j, job in enumerate(jobs):
        _check_job(job, f"job {j}:")
    if len(jobs) == 2 and jobs[0][1].device != jobs[1][1].device:
        raise ValueError(f"both jobs' dst must be on one device, got {jobs[0][1].device} and {jobs[1][1].device}")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be None or an int >= 1, got {programs!r}")
    a, b = jobs[0], jobs[-1]
    shapes = [_tiling(job) for job in jobs]  # (row words, block words, blocks per tile, tiles)
    tiles = sum(t[-1] for t in shapes)
    if tiles == 0:
        return
    (aw, ab, ai, _), (bw, bb, bi, _) = shapes[0], shapes[-1]
    _copy_kernel[(min(programs or DEFAULT_PROGRAMS, tiles),)](
        a[0], a[1], a[2], a[3], a[2].numel(), b[0], b[1], b[2], b[3], b[2].numel(),
        A_ROW_WORDS=aw, A_BLOCK=ab, A_ITEMS=ai, B_ROW_WORDS=bw, B_BLOCK=bb, B_ITEMS=bi, TWO=len(jobs) == 2,
        num_warps=NUM_WARPS,
    )


def _tiling(job) -> tuple[int, int, int, int]:
    """A job's row words, block words (up to 4 KB), blocks per 16 KB tile and tile count."""
    words = job[1].shape[1] // 4
    block = min(MAX_BLOCK_WORDS, triton.next_power_of_2(words))
    items = TILE_WORDS // block
    return words, block, items, triton.cdiv(job[2].numel() * triton.cdiv(words, block), items)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
              programs: int | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` (rows of uint8 bytes), one launch."""
    copy_jobs([(src, dst, src_rows, dst_rows)], programs)


def reference(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Plain torch: ``dst[dst_rows[i]] = src[src_rows[i]]`` (destination rows distinct)."""
    dst[dst_rows.long().to(dst.device)] = src[src_rows.long().to(src.device)].to(dst.device)
