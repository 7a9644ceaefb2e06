"""Target states an ejected MTP head has not read yet, kept in host memory (``MTPDraft``'s backlog).

Rows go into blocks of ``BLOCK`` rows, allocated pinned on CUDA as the backlog first reaches them
and reused after each catch-up. A decode step's row is one asynchronous device -> host copy into
a block, not an allocation: a pinned allocation (``cudaHostAlloc``) costs far more than the
copy. Copies out of and back into a block are ordered on the current stream.
"""

from __future__ import annotations

import torch

BLOCK = 4096  # rows per block: 12 MiB for the 1.5B's bf16 states


class HostRows:
    """States [m, d] by first position; ``take`` returns them in runs of consecutive positions."""

    def __init__(self, d: int, dtype: torch.dtype, pin: bool):
        self.d, self.dtype, self.pin = d, dtype, pin
        self.blocks: list[torch.Tensor] = []
        self.rows = 0  # rows stored since the last take
        self.runs: list[list[int]] = []  # [first position, first stored row, count]

    def __bool__(self) -> bool:
        return self.rows > 0

    def add(self, h: torch.Tensor, start: int) -> None:
        """Keep ``h`` [m, d], the states at positions start..start+m-1."""
        m = h.shape[0]
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] + last[2] == start:
            last[2] += m
        else:
            self.runs.append([start, self.rows, m])
        done = 0
        while done < m:
            b, at = divmod(self.rows, BLOCK)
            if b == len(self.blocks):
                self.blocks.append(torch.empty(BLOCK, self.d, dtype=self.dtype, pin_memory=self.pin))
            k = min(m - done, BLOCK - at)
            self.blocks[b][at:at + k].copy_(h[done:done + k], non_blocking=True)
            done += k
            self.rows += k

    def take(self, device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """(first position, states [count, d] on ``device``) of each run, in order; empties the store."""
        out = []
        for start, row, count in self.runs:
            parts, end = [], row + count
            while row < end:
                b, at = divmod(row, BLOCK)
                k = min(end - row, BLOCK - at)
                parts.append(self.blocks[b][at:at + k].to(device, non_blocking=True))
                row += k
            out.append((start, torch.cat(parts)))
        self.rows, self.runs = 0, []
        return out
