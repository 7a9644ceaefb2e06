"""Decode steps as captured CUDA graphs: one capture per (width, logits kind, step shape), kept
for the cache's layout; a new streaming plan of the same shape re-points the captured copies in
place (``graph_copies``) instead of capturing again (DESIGN.md: static shapes, grids from
shapes, lengths in device tensors). The host part of a step (``cache.begin``: checks, residency
plan, positions and slots written in place into the cache's static buffers; after a plan
change, the copy of the first streamed round, which a step otherwise finds made by the step
before) and of its end (``cache.commit``: the written rows back to the host store) run
eagerly around the replay; everything between, streaming copies included, is the graph.

A step reads the plan through device tensors written in place (page tables, round keys,
positions, slots, the length) and through its copies' node parameters; its shape
(``PagedCache.step_plan``: rounds, grouping, the copies' count and the 2-D ones) is what a
capture fixes, so a decode captures once per width and shape: a page opening that keeps the
shape costs an update of its copy nodes. The graphs of one shape are kept (every width); a
new shape drops them, since their buffers share the cache's slab, sized for one shape's steps.
A re-layout (phase switch, draft eject / re-enable) drops the graphs. A pinned draft's own
graphs survive its eject and re-enable, which put its weights and KV back at the same addresses
(``DraftModel.pin``, ``PagedCache.move_to``). A greedy decode's step (``next_token``) ends with
its argmax written into its own input and the next step's positions and slots into the cache's
step buffers, so its steps chain on the device.

Eager and graphed steps run the same kernels on the same bytes in the same order, so their
logits are bit-identical: tested on the H200 (tests/test_cuda.py) up to 1K tokens, after a
32000-token prompt, across page openings, and around draft ejects / re-enables.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from dataclasses import dataclass

import torch

from kernels.argmax import argmax, scratch_for
from kernels.decode_attention import MAX_N_Q
from kvstream.cache.streams import side_stream
from kvstream.engine.graph_copies import CopyNodes, Unbound
from kvstream.engine.readback import Readback


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor | tuple  # the output buffer(s) every replay rewrites: logits, or (logits, h)
    copies: CopyNodes | None  # None: no copies, or they could not be bound (a plan change re-captures)
    plan: tuple  # the cache's plan_key its copies point at


class GraphedModel:
    """Calls like the model (``graphed(tokens, cache, all_logits)``); decode widths replay graphs.
    ``next_token``: a greedy step with its argmax in the graph. ``captures`` and ``updates`` count
    captures and plan changes served in place."""

    def __init__(self, model, max_width: int = MAX_N_Q):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        self.model = model
        self.tokens = torch.zeros(max_width, dtype=torch.long, device=model.device)
        self.feed = torch.zeros(1, dtype=torch.long, device=model.device)  # next_token's token, in and out
        self.scratch = scratch_for(model.device)  # its argmax's
        self.graphs: dict[tuple, Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()  # for caches without a slab
        # warm-ups and captures run on one side stream, so a slab's segments serve both
        self.stream = side_stream(model.device)
        self.layout = None
        self._cache = lambda: None  # a weak reference to the cache the graphs were captured with
        self.captures = self.updates = 0

    def __getattr__(self, name):  # cfg, device, dtype, ...: the model's
        return getattr(self.model, name)

    def __call__(self, tokens: torch.Tensor, cache, all_logits: bool = False, hidden: bool | tuple[int, ...] = False):
        """As ``Qwen.forward`` (``hidden``: (logits, h), an MTP head's input)."""
        n = tokens.shape[0]
        if n > self.tokens.shape[0] or not hasattr(cache, "plan_key") or cache.recycles(n):
            # prefill chunks (a short last one too: a prefill slab starts each pass empty),
            # caches without static buffers
            return self.model(tokens, cache, all_logits, hidden)
        pos = cache.begin(n)
        self.tokens[:n].copy_(tokens)
        out = self._replay((n, all_logits, hidden), pos, cache)
        # the graph's output buffers are rewritten by the next replay
        return tuple(t.clone() for t in out) if hidden else out.clone()

    def next_token(self, cache, token: torch.Tensor | None = None, readback: Readback | None = None) -> torch.Tensor:
        """A greedy decode step: ``token`` (int64 [1] on the device; None: the token this method
        returned last) goes in, its argmax (``kernels.argmax``, torch.argmax's answer) comes out,
        both in one graph: no logits leave it, no eager kernel or copy runs between steps
        (``generate``'s greedy decode). Returns the graph's token buffer [1], which the next
        call's replay rewrites. ``readback`` is started on it right after the replay, before the
        commit's write-back copies: behind them, the token's copy to the host waited for them. The
        graph also stages the next step (``stage_next_on_device``): its ``begin`` copies nothing
        from the host unless a page opening re-plans."""
        if cache.recycles(1):
            raise ValueError("next_token needs a decode-phase cache with static step buffers")
        pos = cache.begin(1)
        if token is not None and token.data_ptr() != self.feed.data_ptr():
            self.feed.copy_(token.view(1))
        self._replay((1, False, "greedy"), pos, cache, None if readback is None else lambda: readback.start(self.feed[0]))
        cache.claim_next()  # the graph staged the next step's positions and slots
        return self.feed

    def _replay(self, kind: tuple, pos: torch.Tensor, cache, after=None):
        """Replay the graph of ``kind`` (n, all_logits, hidden or "greedy") at the cache's plan, after
        its ``begin``: captured on first use, its copies re-pointed on a plan change; then ``after()``
        and the commit. Returns the graph's output buffer(s)."""
        # a new layout or another cache (not by id(): a new cache may reuse a freed one's id, and
        # replaying graphs captured on freed buffers is an illegal access): the old graphs are done
        if cache.layout_key() != self.layout or self._cache() is not cache:
            self._drop()
            self.layout, self._cache = cache.layout_key(), weakref.ref(cache)
        shape, rows = cache.step_plan()
        key, plan = (*kind[:2], shape, kind[2]), cache.plan_key()
        entry = self.graphs.get(key)
        if entry is not None and entry.plan != plan:
            t0 = time.perf_counter()
            try:
                if entry.copies is None:
                    raise Unbound("its copies are not bound")
                entry.copies.update(rows)
                entry.plan = plan
                self.updates += 1
                cache.stats.plan_change = "update"
            except Unbound:  # captured anew below (with the rest: graphs leave the slab together)
                self._drop()
                entry = None
            cache.stats.plan_s += time.perf_counter() - t0
        if entry is None:
            if any(k[2] != shape for k in self.graphs):
                # another shape's graphs keep their buffers in the cache's slab, which the reserve
                # pass sized for one shape's steps: they go before this one is captured
                self._drop()
            t0 = time.perf_counter()
            entry = self.graphs[key] = self._capture(*kind, pos, cache, rows, plan)
            cache.stats.plan_change = "capture"
            cache.stats.plan_s += time.perf_counter() - t0
        entry.graph.replay()
        if after is not None:
            after()
        cache.commit()
        return entry.out

    def _drop(self) -> None:
        """Free every graph; freeing every graph of a pool frees the pool: captures need a new one."""
        if self.graphs:
            self._release()
            self.pool = torch.cuda.graph_pool_handle()

    def _release(self) -> None:
        """Let the graphs go: the cache they were captured into holds them until told (keep_graph)."""
        cache = self._cache()
        if cache is not None and hasattr(cache, "forget_graphs"):
            cache.forget_graphs(self.graphs)
        self.graphs.clear()

    def __del__(self):
        # a discarded GraphedModel's graphs leave its cache's slab (in a garbage cycle with the
        # cache, the weak reference is already cleared and the cache's own __del__ resets them)
        if getattr(self, "graphs", None):
            self._release()

    def _capture(self, n, all_logits, hidden, pos, cache, rows, plan) -> Captured:
        if hidden == "greedy":
            def body():  # the step reads the feed and writes its argmax there: chained replays decode
                token = argmax(self.model.body(self.feed, pos, cache)[-1], self.scratch, out=self.feed)
                cache.stage_next_on_device()  # and stages the next step: no host copy before its replay
                return token
            # the capture's eager run writes the feed and stages the next step: the step's own go back
            saved = [(t, t.clone()) for t in (self.feed, cache.step_buffer)]
        else:
            body = lambda: self.model.body(self.tokens[:n], pos, cache, all_logits, hidden)
        # keep_graph: its nodes stay readable, so the copies can be re-pointed
        graph, out = capture(body, cache, self.pool, self.stream, self.graphs, keep_graph=True)
        if hidden == "greedy":
            for t, s in saved:
                t.copy_(s)
        self.captures += 1
        copies = None
        if rows:
            try:
                copies = CopyNodes(graph, rows)
            except (Unbound, AttributeError):  # AttributeError: a torch without raw_cuda_graph_exec
                pass
        return Captured(graph, out, copies, plan)


class ChainGraphs:
    """A drafting round's device work as one graph per key (feed width, draft length): the pass
    between one ``cache.begin`` and its ``commit`` (a feed, then one row per drafted token,
    ``PagedCache.sub_pass``), captured the first time a key runs and replayed after, so a round
    costs the host one launch instead of one per step. Kept while ``at`` (the weights'
    addresses and the cache's layout) holds; another ``at`` drops them (they read stale addresses)."""

    def __init__(self, device: torch.device):
        self.graphs: dict[tuple, tuple] = {}
        self.at, self.pool, self.stream = None, None, side_stream(device)
        self.captures = 0

    def run(self, key: tuple, body, cache, at: tuple) -> tuple:
        """``body()``'s outputs (a tuple of tensors), from its graph's replay: the graph's own
        buffers, valid until the next replay of ``key`` (a drafting round reads them within the
        round; clones would be two more eager kernels between the round's launches)."""
        if at != self.at:
            self.graphs, self.at, self.pool = {}, at, torch.cuda.graph_pool_handle()
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = capture(body, cache, self.pool, self.stream, self.graphs)
            self.captures += 1
        entry[0].replay()
        return entry[1]


@contextlib.contextmanager
def _no_collection():
    """No cycle collection inside: it runs the finalizers of whatever dropped objects it finds, and a
    dropped cache's (``PagedCache.__del__``) gives back its slab's memory pool, whose release during a
    capture fails torch's ``captures_underway.empty()`` assertion and aborts the process (seen on the
    H200 in tests/test_cuda.py, a collection inside a capture's Triton compile). The cycles wait for
    the next collection after the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(body, cache, pool, stream, owner: dict, keep_graph: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, its output buffers) of ``body``, device work between ``cache.begin`` and
    ``cache.commit``: run once eagerly on ``stream`` (Triton compiles, the allocator warms), then
    captured there; with a slab, the graph's buffers are the slab's (its out-of-memory errors
    too) and the cache empties ``owner`` (the dict the caller keeps it in) before the slab goes
    (``keep_graph``), else ``pool``'s. ``body`` must be idempotent: its rows are written again by the replay."""
    slab = cache.slab_pool
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), cache.compute():
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with slab.scope(route=False) if slab is not None else contextlib.nullcontext(), _no_collection():
        with torch.cuda.graph(graph, pool=pool if slab is None else slab.id, stream=stream):
            out = body()
    if keep_graph:
        graph.instantiate()
    if slab is not None:
        cache.keep_graph(graph, owner)
    return graph, out


def warm_next_token(graphed: GraphedModel, cache) -> None:
    """``next_token``'s graph captured at the cache's end and rolled back, as ``warm_widths`` does."""
    n = cache.length
    if n + 1 <= cache.max_tokens:
        graphed.next_token(cache, torch.zeros(1, dtype=torch.long, device=graphed.device))
        cache.truncate(n)


def warm_widths(step, cache, widths) -> None:
    """Run each decode (width, all_logits[, hidden]) once at the cache's end and roll it back (CUDA only):
    Triton compiles each kernel variant (the attention kernel per query count) and a
    GraphedModel captures each width here, in setup, not in the first timed steps that use
    them. Rows written past the length are dropped by the rollback, as a rejected draft's are."""
    if step.device.type != "cuda":
        return
    n = cache.length
    for width, all_logits, *hidden in widths:
        if n + width <= getattr(cache, "max_tokens", n + width):
            step(torch.zeros(width, dtype=torch.long, device=step.device), cache, all_logits, *hidden)
            cache.truncate(n)
