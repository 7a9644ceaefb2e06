"""Weight matrices as the forward pass reads them: a dense tensor in the compute dtype, or q8_0
blocks (``model.weights=q8_0``) read by ``kernels/q8_linear.py`` (and with ``model.gemv`` a decode row
by ``kernels/q8_gemv.py``) at 1.06 bytes a value against bf16's 2. A decode step at batch 1 is one pass
over its weights, so their bytes are its floor. ``q8_0_int8``: the same blocks, and a decode row's
activations quantized to q8_0 too and multiplied in int8 (``q8_gemv(int8=True)``; on the CPU its
reference), as llama.cpp multiplies q8_0 weights: fewer instructions per weight byte, a second rounding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference

WEIGHT_FORMATS = ("dense", "q8_0", "q8_0_int8")
MATRICES = ("embed", "lm_head", "wqkv", "wo", "w_gate_up", "w_down")  # what q8_0 quantizes; norms and biases stay dense


@dataclass(frozen=True, eq=False)  # tensors have no truth value: compare by identity
class Q8:
    """W [N, K] in q8_0 blocks, block-major: quants ``q`` int8 [K/32, N, 32], scales ``d`` fp16
    [K/32, N] (``kernels/q8_linear.py``). Has the few tensor attributes the model asks of a
    weight (shape, device, data_ptr, nbytes, index_select of rows)."""

    q: torch.Tensor
    d: torch.Tensor
    int8: bool = False  # a decode row's activations through q8_0 blocks and an int8 dot (``q8_0_int8``)

    @classmethod
    def of(cls, w: torch.Tensor, int8: bool = False) -> "Q8":
        """W's q8_0 blocks, as gguf quantizes them from W's values in fp32."""
        return cls(*reference.q8_weight(w.float()), int8)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.q.shape[1], self.q.shape[0] * self.q.shape[2]))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes

    def data_ptr(self) -> int:
        return self.q.data_ptr()

    def index_select(self, dim: int, rows: torch.Tensor) -> "Q8":
        """The rows ``rows`` of W (dim 0), gathered (a copy, as ``Tensor.index_select``)."""
        if dim != 0:
            raise ValueError("a q8_0 weight selects rows (dim 0) only")
        return Q8(self.q.index_select(1, rows), self.d.index_select(1, rows), self.int8)

    def embedding(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``tokens`` of W dequantized to ``dtype`` (exact in fp32, then one rounding): on CUDA in
        one launch (``kernels/q8_rows.py``), else by torch (that kernel's reference)."""
        if self.q.is_cuda:
            from kernels.q8_rows import q8_rows

            return q8_rows(tokens.long().contiguous(), self.q, self.d, dtype)  # (no copies when they are already)
        return (self.q[:, tokens].float() * self.d[:, tokens].float()[..., None]).transpose(0, 1).reshape(
            tokens.shape[0], -1).to(dtype)


# a verify batch's matmuls with a longer K (down's 8960) stay with cuBLAS: 15.9 against 11.9 us; K split 8 ways was
# 10.3 us alone but made the five-row chain 1182 -> 1319 us (results/kernels/gemv_mma/split)
MMA_MAX_K = 4096


def _q8_gemv(x: torch.Tensor, w: Q8, bias: torch.Tensor | None = None, **kw) -> torch.Tensor:
    from kernels.q8_gemv import q8_gemv

    return q8_gemv(x, w.q, w.d, bias, int8=w.int8, **kw)


def decode_matmul(x: torch.Tensor, w, gemv: bool):
    """With ``gemv``, the Triton matmul a pass of few rows takes on CUDA, launched as a programmatic
    dependent of the kernel before (its weight read while that kernel ends). A dense weight: one row on
    the CUDA cores (``kernels/gemv.py``), 2-16 rows (a verify batch, a short prefill chunk) on the
    tensor cores (``kernels/gemv_mma.py``) where K < ``MMA_MAX_K`` (the 1.5B's Q/K/V, output, gate/up at
    five rows: 4.7 / 4.4 / 16.9 against cuBLAS's 5.6 / 6.1 / 18.0 us, results/kernels/gemv_mma). A q8_0
    weight: one row by ``kernels/q8_gemv.py``. None otherwise: cuBLAS (more rows, down's verify rows) or
    q8_0's ``kernels/q8_linear.py`` (2+ rows), the reference on the CPU."""
    if not gemv or not x.is_cuda:  # (before the import: every eager and CPU matmul asks)
        return None
    n = x.shape[0]
    if isinstance(w, Q8):
        return _q8_gemv if n == 1 else None
    from kernels import gemv_mma

    if not 1 <= n <= gemv_mma.MAX_ROWS or (n > 1 and x.shape[1] >= MMA_MAX_K):
        return None
    if n == 1:
        from kernels.gemv import gemv as kernel

        return kernel
    return gemv_mma.gemv_mma


def int8_row(x: torch.Tensor, w, gemv: bool) -> bool:
    """Whether ``linear`` multiplies x's row in int8 (a ``q8_0_int8`` weight's decode row with ``gemv``):
    then x's q8_0 blocks, made once by the kernel that writes x, may come as ``xq``."""
    return gemv and isinstance(w, Q8) and w.int8 and x.shape[0] == 1


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, gemv: bool = False, xq=None) -> torch.Tensor:
    """x @ w^T (+ bias) for a dense or q8_0 weight: the Triton kernel on CUDA, its reference elsewhere;
    with ``gemv`` a decode pass's rows through ``decode_matmul``'s kernel (on the CPU, a ``q8_0_int8``
    weight's decode row through the int8 kernel's arithmetic: x rounded through q8_0 blocks first).
    ``xq``: x's q8_0 blocks (``reference.q8_rows``), used where ``int8_row``."""
    xq = xq if int8_row(x, w, gemv) else None
    kernel = decode_matmul(x, w, gemv)
    if kernel is not None:
        return kernel(x, w, bias, pdl=True, **({"xq": xq} if xq is not None else {}))
    if not isinstance(w, Q8):
        return F.linear(x, w, bias)
    if x.is_cuda:
        from kernels.q8_linear import q8_linear

        return q8_linear(x, w.q, w.d, bias)
    if int8_row(x, w, gemv):
        xr = reference.q8_round(x) if xq is None else reference.q8_rows_dense(xq)
        return reference.q8_linear(xr, w.q, w.d, bias).to(x.dtype)
    return reference.q8_linear(x, w.q, w.d, bias)


def swiglu(x: torch.Tensor, w, silu_mul, gemv: bool = False, xq=None):
    """silu(x W_gate^T) * (x W_up^T) for the fused gate/up weight w = [W_gate; W_up]: ``silu_mul``
    applied to ``linear``'s product, or where ``decode_matmul`` gives a kernel, that kernel with
    SwiGLU in its epilogue, rounded as the pair rounds (``glu``) -> (h, hq): hq where ``int8_row``, h's q8_0
    blocks (written by that epilogue) for down's ``xq``, else None; ``xq`` as ``linear`` takes it."""
    int8 = int8_row(x, w, gemv)
    kernel = decode_matmul(x, w, gemv)
    if kernel is None:
        h = silu_mul(linear(x, w, None, gemv, xq))
        return h, reference.q8_rows(h) if int8 else None
    if int8:
        return kernel(x, w, glu=True, pdl=True, q8_out=True, **({"xq": xq} if xq is not None else {}))
    return kernel(x, w, glu=True, pdl=True), None


def embedding(tokens: torch.Tensor, w, dtype: torch.dtype) -> torch.Tensor:
    return w.embedding(tokens, dtype) if isinstance(w, Q8) else F.embedding(tokens, w)


def flat(name: str, w) -> dict[str, torch.Tensor]:
    """A weight as named tensors: itself, or a q8_0 weight's quants and scales."""
    return {f"{name}.q": w.q, f"{name}.d": w.d} if isinstance(w, Q8) else {name: w}


def unflat(name: str, like, tensors: dict[str, torch.Tensor]):
    """The weight ``flat(name, like)`` gave, rebuilt from (new) ``tensors``."""
    return Q8(tensors[f"{name}.q"], tensors[f"{name}.d"], like.int8) if isinstance(like, Q8) else tensors[name]
