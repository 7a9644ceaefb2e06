"""A captured decode step's ring copies, re-pointed in place when the streaming plan changes.

When a page opens, a streaming plan copies other host rows into the ring (other pages, another
count of them); the kernels, waits and ring halves stay as they were (``PagedCache.step_plan``'s
shape). Instead of capturing the step again (48-83 ms on the H200, ``results/capture``), the
instantiated graph's memcpy nodes get the new copies' parameters
(``cudaGraphExecMemcpyNodeSetParams``, ~13 us a node): the way llama.cpp's CUDA backend updates
node parameters when only pointers or sizes change. The CUDA runtime re-points 1-D copies only,
so a grouped plan's 2-D copies are part of the step's shape (``kvstream.cache.paged_ring`` keeps
their shape fixed while pages open). An update never touches a replay already queued: the host
may re-point a graph while the device still runs it.
"""

from __future__ import annotations

import torch

from kvstream.cache.cudart import memcpy_nodes, retarget, set_exec_memcpy


class Unbound(RuntimeError):
    """The graph's memcpy nodes cannot be matched one-to-one with the step's copies."""


class CopyNodes:
    """The memcpy nodes of one instantiated graph, in the order of the step's copies (``rows``:
    ``rows_of`` tuples, as the step was captured with them)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, rows: list[tuple[int, ...]]):
        if len(set(rows)) != len(rows):
            raise Unbound("two of the step's copies have the same parameters")
        at = {r: i for i, r in enumerate(rows)}
        self.nodes: list = [None] * len(rows)
        for node, params in memcpy_nodes(graph.raw_cuda_graph()):  # the graph's own copies (torch's) are left alone
            i = at.get(params.rows())
            if i is not None:
                self.nodes[i] = (node, params)
        missing = sum(n is None for n in self.nodes)
        if missing:
            raise Unbound(f"{missing} of the step's {len(rows)} copies are not among the graph's memcpy nodes")
        self.graph, self.rows = graph, list(rows)

    def update(self, rows: list[tuple[int, ...]]) -> int:
        """Re-point the changed copies at ``rows`` (same count, same 2-D ones); returns how many
        changed. Raises ``Unbound`` where the runtime refuses one (the graph is then stale)."""
        if len(rows) != len(self.rows):
            raise Unbound(f"{len(rows)} copies for a step captured with {len(self.rows)}")
        exec_, changed = self.graph.raw_cuda_graph_exec(), 0
        for i, (new, old) in enumerate(zip(rows, self.rows)):
            if new != old:
                node, params = self.nodes[i]
                retarget(params, new)
                err = set_exec_memcpy(exec_, node, params)
                if err:
                    raise Unbound(f"the CUDA runtime refused to re-point copy {i} (error {err}): {old} -> {new}")
                self.rows[i] = new
                changed += 1
        return changed
