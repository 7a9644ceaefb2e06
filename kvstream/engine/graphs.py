"""Decode steps as captured CUDA graphs: one capture per (width, logits kind, cache plan),
replayed while the plan holds (DESIGN.md: static shapes, grids from shapes, lengths in device
tensors). The host part of a step (``cache.begin``: checks, residency plan, positions and
slots written in place into the cache's static buffers; after a plan change, the copy of the
first streamed round, which a step otherwise finds made by the step before) and of its end
(``cache.commit``: the written pages back to the host store) run eagerly around the replay;
everything between, streaming copies included, is the graph. A plan that streams pages gets
new graphs when its streamed pages change (every page, or every ``cache.residency_step``
pages), in one round or several; a resident plan keeps them (the page table is read in place);
a re-layout (phase switch, draft eject / re-enable) drops them. A pinned draft's own graphs
survive its eject and re-enable, which put its weights and KV back at the same addresses
(``DraftModel.pin``, ``PagedCache.move_to``).

Eager and graphed steps run the same kernels on the same bytes in the same order, so their
logits are bit-identical: tested on the H200 (tests/test_cuda.py) up to 1K tokens, after a
32000-token prompt, and around draft ejects / re-enables.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from kernels.decode_attention import MAX_N_Q
from kvstream.cache.streams import side_stream


class GraphedModel:
    """Calls like the model (``graphed(tokens, cache, all_logits)``); decode widths replay graphs."""

    def __init__(self, model, max_width: int = MAX_N_Q):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        self.model = model
        self.tokens = torch.zeros(max_width, dtype=torch.long, device=model.device)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()  # for caches without a slab
        # warm-ups and captures run on one side stream, so a slab's segments serve both
        self.stream = side_stream(model.device)
        self.plan = None
        self._cache = lambda: None  # a weak reference to the cache the graphs were captured with
        self.captures = 0

    def __getattr__(self, name):  # cfg, device, dtype, ...: the model's
        return getattr(self.model, name)

    def __call__(self, tokens: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor:
        n = tokens.shape[0]
        if n > self.tokens.shape[0] or not hasattr(cache, "plan_key") or cache.recycles(n):
            # prefill chunks (a short last one too: a prefill slab starts each pass empty),
            # caches without static buffers
            return self.model(tokens, cache, all_logits)
        pos = cache.begin(n)
        plan = cache.plan_key()
        # a new plan or another cache (not by id(): a new cache may reuse a freed one's id, and
        # replaying graphs captured on freed buffers is an illegal access): the old graphs are done
        if plan != self.plan or self._cache() is not cache:
            if self.graphs:  # freeing every graph of a pool frees the pool: captures need a new one
                self.graphs.clear()
                self.pool = torch.cuda.graph_pool_handle()
            self.plan, self._cache = plan, weakref.ref(cache)
        key = (n, all_logits)
        self.tokens[:n].copy_(tokens)
        if key not in self.graphs:
            self.graphs[key] = self._capture(n, pos, cache, all_logits)
        graph, out = self.graphs[key]
        graph.replay()
        cache.commit()
        return out.clone()  # the graph's output buffer is rewritten by the next replay

    def _capture(self, n, pos, cache, all_logits):
        body = lambda: self.model.body(self.tokens[:n], pos, cache, all_logits)
        side, slab = self.stream, cache.slab_pool
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), cache.compute():  # warm-up outside the capture (Triton compiles, allocator)
            body()  # rewrites the same rows the replay writes: idempotent
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # with a slab, the captured step's buffers are the slab's (its out-of-memory errors too)
        with slab.scope(route=False) if slab is not None else contextlib.nullcontext():
            with torch.cuda.graph(graph, pool=self.pool if slab is None else slab.id, stream=side):
                out = body()
        self.captures += 1
        return graph, out


def warm_widths(step, cache, widths) -> None:
    """Run each decode (width, all_logits) once at the cache's end and roll it back (CUDA only):
    Triton compiles each kernel variant (the attention kernel per query count) and a
    GraphedModel captures each width here, in setup, not in the first timed steps that use
    them. Rows written past the length are dropped by the rollback, as a rejected draft's are."""
    if step.device.type != "cuda":
        return
    n = cache.length
    for width, all_logits in widths:
        if n + width <= getattr(cache, "max_tokens", n + width):
            step(torch.zeros(width, dtype=torch.long, device=step.device), cache, all_logits)
            cache.truncate(n)
