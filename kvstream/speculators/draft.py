"""The draft-model speculator: a small model of the same vocabulary, pinned in the target's arena.

Its weights and its KV cache live in the arena's pinned region (views into the one
allocation, ``pin``); an eject gives those bytes back to the target's page pool (``eject``)
and a re-enable pins them again from the host copy of the weights, the draft's KV coming back
from its own host store (a resident paged cache: every committed row is on the host too).

Per round the draft first catches up: the tokens of the history it has not seen are fed in
chunks (the prompt, the target's correction token, or everything generated while it was
ejected). It then drafts one token per forward pass until ``n_max`` tokens, or until its top
probability falls below ``p_min`` (llama.cpp's rule). After the round its KV holds exactly the
accepted history (``_accepted`` rolls it back past the last accepted token). A greedy device
round (``propose_device``) runs its catch-up and draft steps as one pass of the draft's cache, on
CUDA one captured graph per (catch-up width, draft length) (``ChainGraphs``): the host launches
a round once instead of once per step, and reads nothing until the verify's readback. Before that
readback, while the device verifies, ``prepare`` stages the next round (its catch-up ids and its cache
pass, at a length that hangs on the accepted count: by device ops), so after it the host only launches.
With a fixed draft length the engine launches that round before the readback (``propose_ahead``): its
catch-up is then always the two rows before and at the target's token, fed at positions the device
stages, so the device drafts while the host reads the round back (a round 0.14 ms shorter on the H200:
``results/round/draft_ahead_session15``).

Deviations from llama.cpp, and why:
- ``p_min`` is tested on the draft's full softmax at temperature 1; llama.cpp tests the top
  candidate after its draft sampler's top-k 10, which renormalises over 10 tokens and so stops
  a little later. The full softmax needs no second sampler chain.
- At T > 0 the draft samples from the target's sampling chain applied to the draft's logits
  and reports those distributions (``last_probs``) for lossless rejection sampling.
- ``window`` > 0 bounds the draft's KV: when it is full the draft restarts on the newest
  ``window / 2`` tokens (RoPE is relative, so the draft sees them as a whole short context);
  a longer catch-up (the prompt, or the tokens generated while ejected) reads only its newest
  ``window / 2`` tokens, so a windowed draft's prefill costs at most half a window.
"""

from __future__ import annotations

import torch

from kernels.argmax import scratch_for
from kernels.decode_attention import MAX_N_Q

from kvstream.cache.arena import Arena, both_slabs_bytes, pins_bytes
from kvstream.cache.factory import paged_bytes, slabs_for
from kvstream.engine.graphs import ChainGraphs, GraphedModel, warm_widths
from kvstream.model.loader import open_gguf
from kvstream.model.qwen import Qwen, load_model
from kvstream.cache.paged import PagedCache
from kvstream.cache.paged_staging import PinnedUpload
from kvstream.engine.readback import Readback
from kvstream.model.sampling import Sampler, SamplingParams
from kvstream.model.tokenizer import gguf_metadata
from kvstream.speculators.base import Speculator
from kvstream.speculators.device_draft import pick, stop_mask
from kvstream.speculators.pinned import pin_kv, unpin
from kvstream.speculators.registry import register

TOKENS = "tokenizer.ggml.tokens"


class VocabMismatch(ValueError):
    """The draft's vocabulary differs from the target's."""


def check_vocab(target_tokens: list[str], draft_tokens: list[str], draft_name: str) -> None:
    if target_tokens != draft_tokens:
        first = next((i for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)) if a != b),
                     min(len(target_tokens), len(draft_tokens)))
        raise VocabMismatch(
            f"draft {draft_name} has a different vocabulary: {len(draft_tokens)} tokens vs the target's "
            f"{len(target_tokens)}, first difference at token {first}; a draft must share the target's tokenizer")


def addresses(model: Qwen) -> tuple[int, ...]:
    """Where a model's tensors are: captured graphs read these addresses."""
    return tuple(t.data_ptr() for t in model.tensors().values())


def _top(logits: torch.Tensor) -> torch.Tensor:
    """[softmax probability of the greedy token, the token] as float64 on the device: the two
    numbers a greedy draft step needs, read back together (one host sync, not two)."""
    top, tok = torch.softmax(logits.float(), -1).max(-1)
    return torch.stack((top.double(), tok.double()))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class DraftModel(Speculator):
    """Drafts with a small model; ``pin``/``eject`` move its bytes in and out of an arena."""

    name = "draft"

    def __init__(self, host: Qwen, device: str | torch.device, *, max_tokens: int, type_k: str = "f16",
                 type_v: str = "f16", window: int = 0, n_min: int = 0, p_min: float = 0.0, chunk: int = 512,
                 sampling: SamplingParams | None = None, graphs: bool = False, run_ahead: bool | None = None,
                 max_width: int = MAX_N_Q):
        super().__init__()
        if window and window < 2 * chunk:
            raise ValueError(f"draft window of {window} tokens must hold at least two catch-up chunks ({2 * chunk})")
        self.host = host  # the weights the draft is (re-)pinned from
        self.device = torch.device(device)
        self.type_k, self.type_v = type_k, type_v
        self.kv_tokens = window or max_tokens + 16  # + a draft's own tokens beyond the history
        self.window, self.n_min, self.p_min, self.chunk = window, n_min, p_min, chunk
        self.graphs = graphs  # CUDA: the draft's one-token steps replay captured graphs
        # greedy drafting queues the next draft step before reading the token that feeds it
        # (default: on CUDA, where the host's part then overlaps the device's)
        self.run_ahead = self.device.type == "cuda" if run_ahead is None else run_ahead
        self._readback = Readback(self.device, (2,), torch.float64)
        params = sampling or SamplingParams()
        self.sampler = Sampler(SamplingParams(**{**vars(params), "seed": params.seed + 1}), self.device)
        self.model: Qwen | None = None
        self.cache: PagedCache | None = None
        self.slabs: dict[str, int] | None = None  # its compute slabs (``_reserve``)
        self.fed: list[int] = []  # every token fed; the cache holds fed[base:]
        self.base = 0
        # the history list of the last round and how many leading tokens of ``fed`` are known to be
        # its own (``_seen``): positions below that change only through ``_truncate``
        self._history: list[int] | None = None
        self._checked = 0
        self.pinned_bytes = 0
        self.enabled = False  # until pinned
        self._graphed: GraphedModel | None = None  # kept across an eject: see pin
        self._graphed_at: tuple[int, ...] = ()
        # a device round's catch-up tokens, copied from pinned buffers (a pageable copy syncs)
        self._ids = PinnedUpload(torch.zeros(MAX_N_Q, dtype=torch.long, device=self.device), buffers=4)
        self._pair = torch.arange(2, device=self.device)  # (``prepare``'s offsets, made once)
        self._argmax = scratch_for(self.device) if self.device.type == "cuda" else None  # a chain's greedy picks'
        self._round = 0  # draft tokens of the device round awaiting read_device_round
        self._ahead = None  # the next round's draft length once ``propose_ahead`` launched it
        self._fed_ahead = False  # the verified round's feedback came with the next round, launched ahead
        # the next round's (cache length, catch-up ids) that ``prepare`` staged, once its readback told
        # them ("device" until then)
        self._prepared: tuple[int, tuple[int, ...]] | str | None = None
        self.max_width = max_width  # the widest catch-up of a device round (1 + spec.n_max): what warm() captures
        # a device round's catch-up and draft steps as one graph per (catch-up width, draft length)
        self.chains = ChainGraphs(self.device) if graphs and self.device.type == "cuda" else None

    # ---- arena ------------------------------------------------------------------------

    @property
    def host_nbytes(self) -> int:
        """The weights a re-enable copies in."""
        return self.host.nbytes

    def estimated_bytes(self) -> int:
        """What ``pin`` will take, before pinning (for ``arena.mib=auto``): weights with their
        alignment, and the KV region with its compute slabs (measured here on CUDA, with the
        weights on the device for the reserve passes; ``pin`` then uses the same numbers)."""
        if self.slabs is None:
            on_device = self.host.map_tensors(lambda name, t: t.to(self.device))
            self.slabs = self._reserve(on_device)
            del on_device
            if self.device.type == "cuda":  # the copy's segments, or the process holds the weights twice
                torch.cuda.empty_cache()
        return pins_bytes([t.nbytes for t in self.host.tensors().values()]) + self._kv_bytes(self.host.cfg)

    def _kv_bytes(self, cfg) -> int:
        """The draft KV region: every page of its window resident, beside both its compute slabs."""
        return paged_bytes(cfg, self.type_k, self.type_v, self.kv_tokens, both_slabs_bytes(self.slabs))

    def _reserve(self, model) -> dict[str, int]:
        """The draft's compute slabs (``reserve_slab``), side by side in its KV region: "prefill"
        for catch-up chunks, "decode" for its steps of up to MAX_N_Q tokens and their captured
        graphs, which stay while catch-up passes come and go (``PagedCache(both_slabs=True)``)."""
        # its steps want the last logits only (every width's all-token logits: 136 vocabulary rows more)
        return slabs_for(model, self.chunk, MAX_N_Q, max_tokens=self.kv_tokens, type_k=self.type_k,
                         type_v=self.type_v, step_logits=(False,))

    def pin(self, arena: Arena) -> int:
        """Pin the weights and the draft KV into ``arena``'s pinned region; returns the bytes."""
        self._mark, before = arena.mark(), arena.pinned_bytes
        self.model = self.host.map_tensors(
            lambda name, t: arena.pin("draft." + name, tuple(t.shape), t.dtype).copy_(t, non_blocking=True))
        if self.slabs is None:
            self.slabs = self._reserve(self.model)
        if self.graphs:
            # the same bytes at the same addresses as when its graphs were captured (an eject and
            # re-enable pin the same tensors from the same mark): they stay valid, and a re-enable
            # skips re-capturing the draft's steps (about 0.1 s on the H200)
            at = addresses(self.model)
            if self._graphed is None or self._graphed_at != at:
                self._graphed, self._graphed_at = GraphedModel(self.model), at
            self._graphed.model = self.model
            self.model = self._graphed
        c = self.model.cfg
        return pin_kv(self, arena, self._kv_bytes(c), before, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads,
                      head_dim=c.head_dim, max_tokens=self.kv_tokens, type_k=self.type_k, type_v=self.type_v,
                      slabs=self.slabs, both_slabs=True, pdl=self.host.gemv)

    def eject(self, arena: Arena) -> int:
        """Give the pinned bytes back; the draft KV stays on the host. Returns the bytes freed.
        The captured graphs stay: their buffers are in the draft's step slab, which the target's
        pages now overwrite, but a replay writes every buffer it reads, and none runs before a
        re-enable pins the weights, KV and slabs at the same addresses again."""
        self.model, self._prepared = None, None
        return unpin(self, arena)

    # ---- drafting -----------------------------------------------------------------------

    def _truncate(self, n: int) -> None:
        """Keep the first ``n`` fed tokens."""
        self._checked = min(self._checked, n)  # what comes after may be fed anew
        if n < self.base:  # the window no longer reaches back that far: re-read the newest half-window
            self.base = max(0, n - self.kv_tokens // 2)
            keep = self.fed[self.base:n]
            del self.fed[self.base:]
            self.cache.truncate(0)
            if keep:
                self._feed(keep)
        elif n < len(self.fed):
            del self.fed[n:]
            self.cache.truncate(n - self.base)

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens`` after ``fed``, a chunk per forward pass; the logits after the last one."""
        self._prepared = None  # (its passes stage their own ids)
        if self.window and len(tokens) > self.kv_tokens // 2:  # a long catch-up: only the newest half-window counts
            skip = len(tokens) - self.kv_tokens // 2
            self.fed.extend(tokens[:skip])
            self.base = len(self.fed)
            self.cache.truncate(0)
            tokens = tokens[skip:]
        for lo in range(0, len(tokens), self.chunk):
            piece = tokens[lo:lo + self.chunk]
            if self.cache.length + len(piece) > self.kv_tokens:  # window full: restart on the newest half
                self.base = len(self.fed) - (self.kv_tokens // 2 - len(piece))
                piece = self.fed[self.base:] + piece
                del self.fed[self.base:]
                self.cache.truncate(0)
            ids = torch.tensor(piece, dtype=torch.long, device=self.device)
            for i in range(0, len(piece), self.chunk):
                logits = self.model(ids[i:i + self.chunk], self.cache)
            self.fed.extend(piece)
        return logits[-1]

    def _seen(self, history: list[int]) -> int:
        """How many leading tokens of ``fed`` are ``history``'s. The engine passes one list that
        grows by appends: from its second round on only the tokens past the last check are
        compared, O(a round) instead of O(the context) every round; any other list, or that one
        grown shorter than the last check, is compared whole."""
        same = history is self._history and len(history) >= self._checked
        start = min(self._checked, len(self.fed)) if same else 0
        n = start + _common_prefix(self.fed[start:], history[start:])
        self._history, self._checked = history, n
        return n

    def begin(self, prompt: list[int]) -> None:
        """Read the prompt (all but its last token, which the first round feeds) into the draft KV."""
        self._prepared = None  # a new request: nothing staged for it
        if self.model is not None and len(prompt) > 1:
            self._truncate(min(_common_prefix(self.fed, list(prompt)), len(prompt) - 1))
            if len(self.fed) < len(prompt) - 1:
                self._feed(list(prompt[len(self.fed):-1]))

    def warm(self) -> None:
        """CUDA: compile (and capture) a draft step or catch-up of each width up to MAX_N_Q, and
        (graphs) a device round's chain of each catch-up width at the longest draft."""
        self._prepared = None  # (its chains overwrite the staged ids)
        if self.model is None:
            return
        warm_widths(self.model, self.cache, [(w, False) for w in range(1, MAX_N_Q + 1)])
        n = self.max_width - 1
        if self.chains is not None and n > 0 and self.cache.length + MAX_N_Q <= self.kv_tokens:
            length = self.cache.length
            for w in range(1, min(self.max_width, MAX_N_Q - n + 1) + 1):
                self._ids.stage()[:w] = 0
                self._ids.send()
                self._run_chain(w, n)  # rows past the length, rolled back as a round's drafts are
                self.cache.truncate(length)
        if self.device.type == "cuda":  # ``prepare``'s staging kernel, compiled here (a begin discards what it stages)
            at = self.cache.length
            self.cache.stage_ahead_on_device(torch.zeros(1, dtype=torch.long, device=self.device), at,
                                             min(MAX_N_Q, self.max_width), offset=at)

    def _propose(self, history: list[int], n_max: int, state) -> list[int]:
        if self.model is None:
            return []
        # keep what the draft saw of this history, but re-feed at least the last token: its logits start the draft
        self._truncate(min(self._seen(history), len(history) - 1))
        self._at = len(history)
        logits = self._feed(history[len(self.fed):])
        draft, probs = [], []
        for i in range(n_max):
            if self.sampler.params.greedy:  # acceptance compares argmaxes: no distribution needed
                top = _top(logits)
                if i + 1 < n_max and self.run_ahead and self.cache.length < self.kv_tokens:  # (no window restart)
                    self._readback.start(top)
                    start = self.cache.length
                    logits = self.model(top[1:].long(), self.cache)[-1]  # the next step, queued
                    p, t = self._readback.read().tolist()
                    if p < self.p_min:
                        self.cache.truncate(start)  # the queued step fed a token that is not drafted
                        break
                    draft.append(int(t))
                    self.fed.append(int(t))
                    continue
                p, t = top.tolist()
                if p < self.p_min:
                    break
                tok = int(t)
            else:
                if self.p_min > 0 and float(torch.softmax(logits.float(), -1).max()) < self.p_min:
                    break
                q = self.sampler.dense(logits)
                tok = int(torch.multinomial(q, 1, generator=self.sampler.generator)[0])
                probs.append(q)
            draft.append(tok)
            if i + 1 < n_max:
                logits = self._feed([tok])
        if len(draft) < max(1, self.n_min):
            self._truncate(self._at)  # dropped: the KV keeps only the history (no feedback will come)
            return []
        self.last_probs = torch.stack(probs) if probs else None
        return draft

    def propose_device(self, history: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A greedy round with no host sync: catch up on the history's new tokens, then ``n``
        draft steps, each fed the last one's argmax on the device. Returns (tokens [n], valid
        [n]): ``valid`` is the ``p_min`` stop as a mask (a prefix; none when it is shorter than
        ``n_min``), so the round has a fixed shape. None where the round needs the host:
        sampling, no model, a catch-up wider than a decode step, a window restart. The tokens
        reach the host with the verify's readback: ``read_device_round``."""
        if self.model is None or not self.sampler.params.greedy:
            return None
        self._truncate(min(self._seen(history), len(history) - 1))
        new = history[len(self.fed):]
        if not 0 < len(new) <= MAX_N_Q or self.cache.length + len(new) + n > self.kv_tokens:
            return None
        self.stats.calls += 1
        self._at, self._round = len(history), n
        if len(new) + n - 1 > MAX_N_Q:  # all but the last new token on their own: the chain starts from it
            self._stage(new[:-1])
            self.model(self._ids.dst[:len(new) - 1], self.cache)
            self.fed.extend(new[:-1])
            new = new[-1:]
        if self._prepared != (self.cache.length, tuple(new)):  # (else ``prepare`` staged these ids on the device)
            self._stage(new)
        self._prepared = None
        out = self._run_chain(len(new), n)
        self.fed.extend(new)
        return out

    def cancel_device_round(self) -> None:
        """Drop the round ``propose_device`` launched, unverified (``Chain.cancel_device``): its
        drafted rows go, the history it fed stays; nothing staged for a next round holds."""
        if self._round:
            self.cache.truncate(len(self.fed) - self.base)
            self._round, self._prepared, self._ahead = 0, None, None
            self.stats.calls -= 1

    def _stage(self, tokens: list[int]) -> None:
        """Token ids into the static input buffer, from a pinned buffer (a pageable copy would sync)."""
        self._ids.stage().numpy()[:len(tokens)] = tokens
        self._ids.send()

    def _chain(self, w: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A device round between one ``begin(w + n - 1)`` and its ``commit``: the catch-up of the
        w staged tokens, then n - 1 draft steps, each a row of its own (``sub_pass``) fed the
        step before's argmax; (tokens [n], the ``p_min`` stop as a mask [n]: ``stop_mask``). The
        same kernels on the same rows as a catch-up and n - 1 separate steps."""
        model, cache = self.model, self.cache
        logits = model.body(self._ids.dst[:w], cache.sub_pass(0, w), cache)[-1]
        tokens, top = [], []
        for i in range(n):
            t, p = pick(logits, self.p_min, self._argmax)
            tokens.append(t.view(1))
            top += [p] if p is not None else []
            if i + 1 < n:
                logits = model.body(tokens[-1], cache.sub_pass(w + i, 1), cache)[-1]
        return torch.cat(tokens), stop_mask(top, n, self.p_min, self.n_min, self.device)

    def _run_chain(self, w: int, n: int, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``_chain``: eager, or (graphs) a graph per (w, n) for the weights' addresses and the
        draft cache's layout (``ChainGraphs``; its outputs hold until that graph's next replay,
        a round later). ``rows``: the pass's width where it is wider than the chain (``propose_ahead``)."""
        cache = self.cache
        cache.begin(rows or w + n - 1)
        if self.chains is not None:
            out = self.chains.run((w, n), lambda: self._chain(w, n), cache, (self._graphed_at, cache.layout_key()))
        else:
            with cache.compute():
                out = self._chain(w, n)
        cache.commit()
        return out

    def prepare(self, kept: torch.Tensor, start: int, h: torch.Tensor | None = None,
                accepted: torch.Tensor | None = None, fed: torch.Tensor | None = None, ahead: int = 0) -> None:
        """Stage the next device round before this one's readback, while the device verifies (the host
        would only wait): its catch-up is the target's token after the accepted drafts (and the last
        draft too when all n were kept: its row was never fed), at the length after the accepted drafts'
        rows. Both hang on ``accepted`` (int64 [1] on the device), so the ids (from ``kept`` [1 + n], the
        round's kept tokens) and the cache's pass (``stage_ahead_on_device``) are made by device ops;
        the readback then tells the host which (``read_device_round``). ``ahead``: the next round's
        draft length where the engine will launch it before the readback (``propose_ahead``); its
        catch-up is then always two rows, ``fed`` (the verify's input [1 + n]: the last history token,
        then the drafts) at ``accepted`` and the target's token, so its width does not hang on the
        count."""
        n = self._round
        if n == 0 or accepted is None or self.cache is None:
            return
        at = self.cache.length - (n - 1)  # the rows before the drafts
        if ahead > 0 and fed is not None and self._fits_ahead(at, n, ahead):
            torch.index_select(fed, 0, accepted, out=self._ids.dst[:1])  # the row before the target's token
            torch.index_select(kept, 0, accepted, out=self._ids.dst[1:2])
            self._prepared = ("ahead", at, ahead, accepted)
            return
        shift = accepted.clamp(max=n - 1)  # the accepted drafts whose rows the chain made
        # kept[shift], kept[shift + 1] (<= n): the target's token (twice: one row is read), or the last
        # draft and the target's token; straight into the ids (three launches with the clamp)
        torch.gather(kept, 0, shift + self._pair, out=self._ids.dst[:2])
        self.cache.stage_ahead_on_device(shift, at + n - 1, min(MAX_N_Q, self.max_width), offset=at)  # any next chain
        self._prepared = "device"

    def _fits_ahead(self, at: int, n: int, m: int) -> bool:
        """Whether the next round (draft length ``m``) can launch before this one's readback (``n``
        drafts after ``at`` rows): its pass, from row ``at - 1`` over every row it may write (``_pass_ahead``),
        is a decode pass of the cache's room and plan (a page opening stages from the host)."""
        rows = self._pass_ahead(n, m)
        return at > 0 and rows <= MAX_N_Q and at - 1 + rows <= self.kv_tokens and not self.cache.replans(rows, at - 1)

    @staticmethod
    def _pass_ahead(n: int, m: int) -> int:
        """The rows of a pass launched ahead, from the row before this round's drafts: its two catch-up
        rows and ``m`` - 1 draft rows start at any of this round's ``n`` + 1 acceptance counts."""
        return n + m + 1

    def propose_ahead(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next round, launched right after ``prepare(ahead=n)``, before this round's readback (the
        engine's ``_DeviceRound``): the device drafts while the host reads the round back. Its catch-up
        is two rows at positions only the device knows (``at - 1 + accepted``): the host begins a pass
        from row ``at - 1`` wide enough for every count (so its write-back covers the rows), and the
        device restages its first ``1 + n`` rows there (``restage_rows_on_device``). The same chain
        graph as a catch-up of two after the readback. ``read_device_round`` then tells the host what
        its history and length are; this round's feedback (``accepted``) is then already applied."""
        prepared, cache = self._prepared, self.cache
        if not (isinstance(prepared, tuple) and prepared[0] == "ahead" and prepared[2] == n) or cache is None:
            return None
        _, at, _, accepted = prepared
        rows = self._pass_ahead(self._round, n)
        cache.truncate(at - 1)
        cache.stage_ahead(rows)
        cache.restage_rows_on_device(0, accepted, at - 1, 1 + n)
        self._prepared, self._ahead = None, n
        self.stats.calls += 1
        return self._run_chain(2, n, rows)

    def read_device_round(self, tokens: list[int], n_valid: int, kept: list[int]) -> None:
        """The device round's tokens, read back: the KV holds the first ``n - 1`` after the history.
        ``kept``: the round's kept tokens (the accepted drafts, then the target's), which tell where
        ``prepare`` staged the next round and with which catch-up ids. With the next round launched
        ahead, the history is now this one's plus ``kept`` (that round's catch-up), and the host's
        length that round's rows."""
        if self._ahead is not None:
            n_next, self._ahead = self._ahead, None
            self.fed.extend(kept)  # (``fed`` is this round's history: its drafts were not added)
            self.cache.truncate(len(self.fed) - self.base + n_next - 1)
            self._at, self._round, self._fed_ahead = len(self.fed), n_next, n_valid > 0
            if n_valid:
                self.stats.drafts += 1
                self.stats.drafted_tokens += n_valid
            return
        if self._prepared == "device":  # ``prepare`` staged this round's successor
            done = min(len(kept) - 1, self._round - 1)  # accepted drafts whose rows the chain made
            length = self.cache.length - (self._round - 1) + done
            self.cache.claim_staged(length)
            self._prepared = (length, tuple(kept[done:]))
        self.fed.extend(tokens[:self._round - 1])
        self._round = 0
        if n_valid:
            self.stats.drafts += 1
            self.stats.drafted_tokens += n_valid
        else:  # every draft masked (p_min): no feedback comes (Speculator.accepted), so the drafted rows go now
            self._truncate(self._at)

    def _accepted(self, n_drafted: int, n_accepted: int) -> None:
        if self._fed_ahead:  # the next round, launched ahead, fed this one's outcome already
            self._fed_ahead = False
            return
        self._truncate(self._at + n_accepted)  # the draft KV holds exactly the accepted history


def load_host(path: str, target_tokens: list[str], dtype: torch.dtype, device: str | torch.device,
              gemv: bool = False, weights: str = "dense", **rope) -> Qwen:
    """A draft's weights on the host, after checking its vocabulary against ``target_tokens``;
    ``rope``: rope-scaling overrides as ``load_model`` takes them (the target's: a draft reads the
    same positions, so past the original context it needs the same YaRN); ``gemv``: its copies
    on the device decode as ``model.gemv`` says (the target's setting); ``weights``: its matrices'
    format (``spec.draft.weights``, as ``model.weights``: q8_0 blocks pin 0.53x bf16's bytes)."""
    reader = open_gguf(path)
    check_vocab(list(target_tokens), list(gguf_metadata(reader).get(TOKENS, [])), str(path))
    host = load_model(reader, dtype, "cpu", weights=weights, gemv=gemv, **rope)
    if torch.device(device).type == "cuda":  # pinned host memory: a re-enable copies at full PCIe speed
        host = host.map_tensors(lambda name, t: t.pin_memory())
    return host


@register("draft")
def _factory(host: Qwen, device: str | torch.device = "cpu", max_tokens: int = 4096, **options) -> DraftModel:
    """``spec.type=draft``: ``host`` from :func:`load_host`; ``options`` as :class:`DraftModel`."""
    return DraftModel(host, device, max_tokens=max_tokens, **options)
