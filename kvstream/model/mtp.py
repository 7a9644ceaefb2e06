"""The MTP draft head: one decoder block on top of a frozen Qwen2 target (EAGLE / DeepSeek-V3 MTP).

    x      = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])     # 2d -> d; DeepSeek-V3's order, e first
    g      = x + attn(attn_norm(x));  g = g + ffn(ffn_norm(g))  # one block, the target's attention shape
    logits = lm_head(out_norm(g))                               # the target's own tensors, shared

``h_t`` is the target's residual stream after its last block, before its final norm
(``Qwen.body(..., hidden=True)``), or (``features``, EAGLE-3) the streams entering several of
its blocks side by side, which ``fc`` (F x d -> d) fuses into one d-vector first; ``x_{t+1}``
sits at position t+1 and the head predicts the token after it. Drafting chains: step j+1 reads
step j's ``g`` (d values: no fusion) and the token step j drafted, one position further on. The
block has Qwen2's q/k/v biases and RoPE with the target's ``inv_freq``; its FFN width is a knob.
``embed``, ``out_norm``, ``lm_head`` and ``inv_freq`` are the target's tensors (never copied,
never trained, not in the state dict).

Draft vocabulary (optional): ``d2t`` [N], the N most frequent target ids of the training data; the
head then scores only those rows and ``to_target`` maps its argmax back. Rows picked by an index
cannot be a view, so the N rows are gathered ONCE into ``lm_rows`` (N x d, e.g. 32768 x 896 x 2 B =
56 MiB for the 0.5B in bf16, beside the 260 MiB tied embedding it is taken from); gathering them per
step instead would read 2N rows and write N before the N-row matmul, which beats the full V-row head
only for N < V / 3. The head's LM matmul shrinks by V / N (4.6x at N = 32768).

Training-time test (EAGLE-3): ``unroll`` runs k draft steps over a whole sequence at once. At step s
the query of row i (the chain that starts from true target features at i) attends to the step-1 keys
of rows <= i, which are what the committed context's head KV holds when drafting from i (each built
from true target features), and to its own chain's keys from steps 2..s at row i (a diagonal): the
keys drafting from i would have appended. So every unrolled logit equals the one ``step`` computes
in a real drafting chain with the same tokens (tests/test_mtp.py checks it), and the head is trained
on its own fed-back hidden states, as it will be used, instead of only on the target's (EAGLE-1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


from kvstream.cache.contiguous import ContiguousCache
from kvstream.model.layer_ops import LayerOps
from kvstream.model.qwen import Qwen, features as feature_taps
from kvstream.model.weights import Q8, embedding, linear, swiglu


REFERENCE = LayerOps(torch.device("cpu"))  # the plain-torch references (any device), for training


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
    """q [n, H, D]; ks / vs: per unrolled step so far, [n, KVH, D] -> [n, H, D]. Row i sees the
    first step's rows <= i and row i of every later step (module docstring)."""
    n, H, _ = q.shape
    rep = H // ks[0].shape[1]
    k = torch.cat(ks).repeat_interleave(rep, 1)  # explicit GQA: SDPA's masked CUDA kernels take equal heads
    v = torch.cat(vs).repeat_interleave(rep, 1)
    i = torch.arange(n, device=q.device)
    mask = torch.cat([i[:, None] >= i[None, :]] + [i[:, None] == i[None, :]] * (len(ks) - 1), 1)
    t = lambda x: x.transpose(0, 1)[None]
    return F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=mask)[0].transpose(0, 1)


class MTPHead(torch.nn.Module):
    """The head's own weights (parameters) and views of the target's shared tensors."""

    def __init__(self, target: Qwen, ffn: int | None = None, d2t: torch.Tensor | None = None, seed: int = 0,
                 features: tuple[int, ...] | None = None):
        super().__init__()
        c = target.cfg
        if c.arch != "qwen2":
            raise ValueError(f"the MTP head is built for qwen2 targets (q/k/v biases, no q/k norms), not {c.arch}")
        self.cfg, self.ffn = c, ffn or c.ffn
        # the target's streams it reads (``Qwen.body``'s ``hidden``): the last by default
        self.features = feature_taps(c.n_layers, True if features is None else tuple(features))
        d, H, KVH, D = c.hidden, c.n_heads, c.n_kv_heads, c.head_dim
        g = torch.Generator().manual_seed(seed)
        mat = lambda rows, cols: torch.nn.Parameter(torch.randn(rows, cols, generator=g) / cols ** 0.5)
        ones = lambda n: torch.nn.Parameter(torch.ones(n))
        # several streams: fused to d values before the input norm (EAGLE-3's fc)
        self.fc = mat(d, len(self.features) * d) if len(self.features) > 1 else None
        self.enorm, self.hnorm, self.eh_proj = ones(d), ones(d), mat(d, 2 * d)
        self.attn_norm, self.wqkv = ones(d), mat((H + 2 * KVH) * D, d)
        self.bqkv = torch.nn.Parameter(torch.zeros((H + 2 * KVH) * D))
        self.wo, self.ffn_norm = mat(d, H * D), ones(d)
        self.w_gate_up, self.w_down = mat(2 * self.ffn, d), mat(d, self.ffn)
        # shared with the target: plain attributes, so .to() / state_dict() / parameters() leave them alone
        self.embed, self.out_norm, self.lm_head, self.inv_freq = target.embed, target.out_norm, target.lm_head, target.inv_freq
        self._layer_ops: dict[torch.device, LayerOps] = {}
        # its inference follows the target's model.gemv: decode rows by kernels/gemv*.py, PDL launches
        self.gemv = getattr(target, "gemv", False)
        self.d2t = None if d2t is None else d2t.to(device=self.embed.device, dtype=torch.long)
        self.lm_rows = self.lm_head if d2t is None else self.lm_head.index_select(0, self.d2t)
        assert self.shares(target)

    def shares(self, target: Qwen) -> bool:
        """The embedding, final norm, LM head and RoPE frequencies are ``target``'s storage, and no
        weight of the head's own is (to assert after moving either, e.g. into an arena)."""
        ours = [(self.embed, target.embed), (self.out_norm, target.out_norm), (self.lm_head, target.lm_head),
                (self.inv_freq, target.inv_freq)]
        theirs = {t.data_ptr() for t in target.tensors().values()}
        return (all(a.data_ptr() == b.data_ptr() and a.shape == b.shape for a, b in ours)
                and not theirs & {p.data_ptr() for p in self.parameters()})

    @property
    def nbytes(self) -> int:
        """Bytes the head adds to the target: its own weights, and the gathered LM-head rows of a
        draft vocabulary (its one layer of KV is the cache's)."""
        own = sum(p.numel() * p.element_size() for p in self.parameters())
        return own + (0 if self.d2t is None else self.lm_rows.nbytes)

    @property
    def feature_dim(self) -> int:
        """Values per row of the target's states the head reads: d per tapped stream."""
        return len(self.features) * self.cfg.hidden

    @property
    def draft_vocab(self) -> int:
        return self.lm_rows.shape[0]

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (the identity without a draft vocabulary). A gather,
        never a host read: indexing with a 0-d tensor would read its value (a sync, which a CUDA
        graph capture refuses)."""
        return ids if self.d2t is None else self.d2t.index_select(0, ids.reshape(-1)).view(ids.shape)

    # ---- the block, in pieces shared by `step` and `unroll` ---------------------------------------

    # ``ops``: the layer's elementwise operations. Inference (``block``) takes the device's (fused
    # Triton kernels on CUDA: a head step is ~30 kernels instead of ~70; launched as programmatic
    # dependents with the target's model.gemv, whose decode matmuls it then takes too: ``_decode``);
    # training (``unroll``) the plain-torch references, which have a backward pass
    def _ops(self, device: torch.device) -> LayerOps:
        if device not in self._layer_ops:
            self._layer_ops[device] = LayerOps(device, self.gemv)
        return self._layer_ops[device]

    def _decode(self, ops: LayerOps) -> bool:
        """Whether the matmuls take ``weights.decode_matmul``'s kernels: inference with model.gemv."""
        return self.gemv and ops is not REFERENCE

    def _norm(self, x: torch.Tensor, w: torch.Tensor, ops: LayerOps, delta=None):
        return ops.add_rms_norm(x, w, self.cfg.rms_eps, delta)

    def _input(self, h: torch.Tensor, tokens: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """h: the target's features [n, feature_dim] (fused by ``fc`` when several) or a step's own
        output [n, d] (never fused): told apart by their width."""
        dt = self.eh_proj.dtype
        e = embedding(tokens, self.embed, dt).to(dt)
        h = h.to(dt)
        if h.shape[-1] not in (self.cfg.hidden, self.feature_dim):
            raise ValueError(f"the head's input rows are {h.shape[-1]} wide: the target's states it reads are "
                             f"{self.feature_dim} ({len(self.features)} streams), its own {self.cfg.hidden}")
        if h.shape[-1] != self.cfg.hidden:
            h = linear(h, self.fc, None, self._decode(ops))
        return linear(torch.cat((self._norm(e, self.enorm, ops)[1], self._norm(h, self.hnorm, ops)[1]), -1),
                      self.eh_proj, None, self._decode(ops))

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, ops: LayerOps):
        c, n = self.cfg, x.shape[0]
        qkv = linear(self._norm(x, self.attn_norm, ops)[1], self.wqkv, self.bqkv, self._decode(ops))
        w = (c.n_heads + c.n_kv_heads) * c.head_dim
        qk = ops.rope(pos, self.inv_freq, qkv.dtype, 1.0)(qkv[:, :w].view(n, -1, c.head_dim))
        return qk[:, :c.n_heads], qk[:, c.n_heads:], qkv[:, w:].view(n, c.n_kv_heads, c.head_dim)

    def _block_out(self, x: torch.Tensor, a: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        decode = self._decode(ops)
        g, h, _ = self._norm(x, self.ffn_norm, ops, linear(a.reshape(x.shape[0], -1), self.wo, None, decode))  # + residual
        s, sq = swiglu(h, self.w_gate_up, ops.silu_mul, decode)
        return g + linear(s, self.w_down, None, decode, sq)

    def logits(self, g: torch.Tensor, ops: LayerOps | None = None) -> torch.Tensor:
        """[n, d] block outputs -> [n, draft_vocab] float32 logits."""
        h = self._norm(g, self.out_norm, ops or self._ops(g.device))[1]
        return linear(h if isinstance(self.lm_rows, Q8) else h.to(self.lm_rows.dtype), self.lm_rows).float()

    # ---- inference ---------------------------------------------------------------------------------

    def new_cache(self, max_tokens: int, dtype: torch.dtype | None = None) -> ContiguousCache:
        """The head's one layer of K/V; ``truncate(length)`` drops rejected draft rows."""
        c = self.cfg
        return ContiguousCache(1, c.n_kv_heads, c.head_dim, max_tokens, dtype or self.eh_proj.dtype, self.eh_proj.device)

    def step(self, h: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, feature_dim] (the target's states) or [n, d] (the previous step's output), tokens [n] at positions
        pos [n] int64 (the rows continue ``kv``) -> (logits [n, draft_vocab], h_out [n, d]).
        Appends n rows to ``kv``; each row attends to the cache's rows and the new ones up to its own."""
        kv.begin(tokens.shape[0])
        out = self.block(h, tokens, pos, kv)
        kv.commit()
        return out

    def block(self, h: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` between ``kv.begin`` and ``kv.commit``: device work only (a CUDA graph can hold it)."""
        ops = self._ops(h.device)
        x = self._input(h, tokens, ops)
        q, k, v = self._qkv(x, pos, ops)
        g = self._block_out(x, kv.attend(0, q, k, v), ops)
        return self.logits(g, ops), g

    @torch.no_grad()
    def draft(self, h: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, k: int, kv) -> torch.Tensor:
        """Greedy chain of k draft tokens (target ids) [k]. h / tokens / pos: the n newly committed
        rows (true target features, kept in ``kv``); the last one's argmax is the first draft, each
        later step feeds back its own h_out and token. ``kv`` grows by n + k - 1 rows: truncate it to
        its length before the call + n after verification (drafted rows carry the head's own states)."""
        out = []
        for j in range(k):
            logits, g = self.step(h, tokens, pos, kv)
            tokens = self.to_target(logits[-1:].argmax(-1))
            h, pos = g[-1:], pos[-1:] + 1
            out.append(tokens)
        return torch.cat(out)

    # ---- training ----------------------------------------------------------------------------------

    def unroll(self, h: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Training-time test over one sequence: h [T, feature_dim] the target's states of tokens [T] ->
        for s = 1..k, logits [T - s, draft_vocab]; row i of step s predicts the token after position
        i + s, having been fed tokens[i + s] and the step s - 1 output of its chain (step 1: h[i])."""
        T, ks, vs, out = tokens.shape[0], [], [], []
        for s in range(1, k + 1):
            n = T - s
            x = self._input(h[:n], tokens[s:], REFERENCE)
            q, kk, vv = self._qkv(x, torch.arange(s, T, device=tokens.device), REFERENCE)
            ks.append(kk)
            vs.append(vv)
            h = self._block_out(x, ttt_attention(q, [t[:n] for t in ks], [t[:n] for t in vs]), REFERENCE)
            out.append(self.logits(h, REFERENCE))
        return out
