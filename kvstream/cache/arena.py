"""The phase arena: ONE device allocation that bounds what a phase may use.

Bottom-up, a phase lays out its regions; top-down, a pinned region is bump-allocated::

    0                                                                      nbytes
    | slab | K ring | K pool | V ring | V pool |   free   | pinned (grows down) |

- slab: the phase's compute buffers, sized by a reserve pass that measures the phase's peak;
- ring: slots that streamed pages are copied into (K and V; one K/V page pair per slot);
- pool: resident pages, one K/V pair per (layer, logical page) that stays on the device;
- pinned: draft weights, draft KV, anything a draft widens (``pin`` / ``mark`` / ``reset``).

Ring and pool slots of one kind are adjacent, so one page table can point at either: an
attention call reads resident and streamed pages alike. Every region is a view into the one
buffer; nothing here allocates after construction.

``ArenaPlan`` is the one rule for the bytes a layout needs and the pages a size holds: the
layout itself, the automatic ring, capacity predictions and every arena sized anywhere use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.formats import PageFormat

ALIGN = 256  # bytes: every region starts aligned (kernels need 16; 256 keeps cache lines whole)
MIB = 1 << 20


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pair_bytes(type_k: str, type_v: str, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of one K page and one V page (one layer, 256 tokens)."""
    return PageFormat(type_k, n_kv_heads, head_dim).page_bytes + PageFormat(type_v, n_kv_heads, head_dim).page_bytes


def both_slabs_bytes(slabs: dict[str, int]) -> int:
    """The slab of a cache that keeps both phases' slabs side by side (``PagedCache(both_slabs=True)``):
    the prefill slab, then the decode slab aligned."""
    return align_up(slabs["prefill"]) + slabs["decode"]


def pins_bytes(sizes) -> int:
    """What pinning tensors of ``sizes`` bytes takes below an aligned top (as every arena that
    ``ArenaPlan`` sizes has): ``Arena.pin`` rounds each start down to ALIGN."""
    return sum(align_up(n) for n in sizes)


@dataclass(frozen=True)
class ArenaPlan:
    """What a phase lays out besides its resident pages: the one rule for an arena's bytes.

    ``bytes(n)`` sizes an arena for ``n`` resident page pairs; ``pool_pages(nbytes)`` is how
    many an arena of ``nbytes`` holds, the count ``Arena.lay_out`` gives. The slab is rounded up
    to ALIGN, and two ALIGN bound the V region's alignment padding (its start is aligned)."""

    slab: int        # compute slab bytes
    ring_pages: int  # ring slots (K/V page pairs)
    pair: int        # bytes of one K page and one V page
    pinned: int = 0  # bytes the pinned region takes, alignment included (``pins_bytes``)

    def bytes(self, pool_pages: int) -> int:
        """A size (a multiple of ALIGN, so pins from its top lose no more than ``pins_bytes``
        counts) whose layout holds ``pool_pages`` resident page pairs."""
        return align_up(align_up(self.slab) + 2 * ALIGN + (self.ring_pages + pool_pages) * self.pair + self.pinned)

    def mib(self, pool_pages: int) -> float:
        """``bytes(pool_pages)`` in MiB, exact (a power-of-two division): ``arena.mib`` reads it back."""
        return self.bytes(pool_pages) / MIB

    def pool_pages(self, nbytes: int) -> int:
        """Resident page pairs a layout of this plan gets in an arena of ``nbytes``."""
        fixed = align_up(self.slab) + 2 * ALIGN + self.ring_pages * self.pair + self.pinned
        return max(0, (nbytes - fixed) // self.pair)

    def capacity(self, nbytes: int, n_layers: int, max_pages: int) -> int:
        """Resident pages per layer in an arena of ``nbytes``: every layer the same, at most
        ``max_pages`` (the context's)."""
        return min(self.pool_pages(nbytes) // n_layers, max_pages)


class ArenaTooSmall(ValueError):
    """The arena cannot hold what a phase needs; the message gives needed vs given bytes."""


@dataclass(frozen=True)
class Layout:
    """Byte layout of one phase. ``pages`` counts K/V page pairs (one layer, 256 tokens)."""

    nbytes: int
    slab: int
    ring_pages: int
    pool_pages: int
    k_page: int
    v_page: int
    pinned: int

    @property
    def pair(self) -> int:
        return self.k_page + self.v_page

    @property
    def k_offset(self) -> int:
        return align_up(self.slab)

    @property
    def v_offset(self) -> int:
        return align_up(self.k_offset + (self.ring_pages + self.pool_pages) * self.k_page)

    @property
    def end(self) -> int:
        return self.v_offset + (self.ring_pages + self.pool_pages) * self.v_page

    def mib(self) -> dict[str, float]:
        """MiB per region, for reports."""
        return {
            "arena": self.nbytes / MIB,
            "slab": self.slab / MIB,
            "ring": self.ring_pages * self.pair / MIB,
            "pool": self.pool_pages * self.pair / MIB,
            "pinned": self.pinned / MIB,
            "free": (self.nbytes - self.pinned - self.end) / MIB,
        }


class Arena:
    """One ``uint8`` allocation of ``nbytes`` on ``device`` and views into it.

    ``Arena.over(view)`` manages a region of another arena instead (a draft's KV lives in its
    target's pinned region that way): no allocation of its own."""

    def __init__(self, nbytes: int, device: str | torch.device, buf: torch.Tensor | None = None):
        if nbytes <= 0:
            raise ArenaTooSmall(f"arena size must be positive, got {nbytes} bytes")
        self.nbytes = int(nbytes)
        self.buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device) if buf is None else buf
        self.top = self.nbytes  # the pinned region is [top, nbytes)
        self.floor = 0  # bytes the current layout uses from the bottom; pins may not cross it
        self.pinned: list[tuple[str, int, int]] = []  # (name, offset, nbytes), in pin order

    @classmethod
    def over(cls, view: torch.Tensor) -> "Arena":
        """An arena whose bytes are ``view`` (uint8, 1-D), a region of a larger allocation."""
        return cls(view.numel(), view.device, buf=view)

    @property
    def device(self) -> torch.device:
        return self.buf.device

    @property
    def pinned_bytes(self) -> int:
        return self.nbytes - self.top

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view of ``shape`` at byte ``offset`` (must be aligned to the dtype)."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        if offset < 0 or offset + n > self.nbytes:
            raise ValueError(f"view of {n} bytes at offset {offset} is outside the {self.nbytes}-byte arena")
        return self.buf[offset:offset + n].view(dtype).view(shape)

    # ---- pinned region, from the top --------------------------------------------------------

    def pin(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Bump-allocate a tensor from the top of the arena (below earlier pins)."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        new_top = (self.top - n) // ALIGN * ALIGN
        if new_top < self.floor:
            raise ArenaTooSmall(
                f"pinning {name!r} needs {n / MIB:.2f} MiB but only {(self.top - self.floor) / MIB:.2f} MiB "
                f"are free above the current layout ({self.pinned_bytes / MIB:.2f} MiB already pinned, "
                f"arena {self.nbytes / MIB:.2f} MiB)")
        self.top = new_top
        self.pinned.append((name, new_top, n))
        return self.view(new_top, shape, dtype)

    def mark(self) -> int:
        """A mark to ``reset`` to: everything pinned after it is released together."""
        return len(self.pinned)

    def reset(self, mark: int = 0) -> int:
        """Release the pins made after ``mark``; returns the bytes given back."""
        before = self.top
        del self.pinned[mark:]
        self.top = self.pinned[-1][1] if self.pinned else self.nbytes
        return self.top - before

    # ---- phase layout, from the bottom ------------------------------------------------------

    def lay_out(self, slab: int, ring_pages: int, k_page: int, v_page: int, min_pool_pages: int) -> Layout:
        """Lay out slab, ring and as many pool pages as fit below the pinned region."""
        plan = ArenaPlan(slab, ring_pages, k_page + v_page, self.pinned_bytes)
        pool = plan.pool_pages(self.nbytes)
        if pool < min_pool_pages:
            need = plan.bytes(min_pool_pages)
            raise ArenaTooSmall(
                f"arena of {self.nbytes / MIB:.2f} MiB is too small: slab {slab / MIB:.2f} MiB + ring "
                f"{ring_pages} pages ({ring_pages * plan.pair / MIB:.2f} MiB) + at least {min_pool_pages} resident "
                f"pages ({min_pool_pages * plan.pair / MIB:.2f} MiB) need {(need - self.pinned_bytes) / MIB:.2f} MiB"
                + (f" besides {self.pinned_bytes / MIB:.2f} MiB pinned" if self.pinned_bytes else "")
                + f"; give arena.mib >= {need / MIB:.2f}")
        layout = Layout(self.nbytes, slab, ring_pages, pool, k_page, v_page, self.pinned_bytes)
        self.floor = layout.end
        return layout

    def release_layout(self) -> None:
        """Forget the current layout (its views must no longer be used), so pins may grow down
        into the space it held; the caller lays out again afterwards (re-enabling a draft)."""
        self.floor = 0

    def pages(self, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V page spaces, uint8 [ring + pool, page bytes]: slots [0, ring) are the ring."""
        n = layout.ring_pages + layout.pool_pages
        return (self.view(layout.k_offset, (n, layout.k_page), torch.uint8),
                self.view(layout.v_offset, (n, layout.v_page), torch.uint8))
