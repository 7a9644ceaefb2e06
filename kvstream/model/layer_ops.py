"""The layer's elementwise operations: fused Triton kernels on CUDA (kernels/rms_norm.py,
rope.py, swiglu.py), their plain-torch references elsewhere, as kv_ops does for the pages."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import reference


@dataclass(frozen=True)
class Rope:
    """One forward pass's RoPE: the rows' positions [n] int64, the frequencies and YaRN's scale (what
    the kernels read; a paged cache fuses the rotation into its store with them), applied to
    [n, heads, D] rows by calling it."""

    pos: torch.Tensor
    inv_freq: torch.Tensor
    scale: float
    dtype: torch.dtype
    triton: bool

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The references' cos / sin [n, 1, D/2] (times ``scale``), computed once per pass."""
        return reference.rope_angles(self.pos, self.inv_freq, self.dtype, self.scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton:
            from kernels.rope import rope

            return rope(x, self.pos, self.inv_freq, self.scale)
        return reference.rope(x, *self.cos_sin)


class LayerOps:
    """add + RMSNorm, RoPE and SwiGLU for one device. ``pdl``: the norm and SwiGLU kernels launch as
    programmatic dependents of the kernel before (CUDA; with ``model.gemv``, whose matmuls do too)."""

    def __init__(self, device: torch.device, pdl: bool = False):
        self.triton = device.type == "cuda"
        self.pdl = pdl and self.triton  # (the kernels launch ordinarily below sm_90: kernels/pdl.py)
        if self.triton:
            from kernels import rms_norm, swiglu

            self._norm, self._silu_mul = rms_norm.add_rms_norm, swiglu.silu_mul

    def add_rms_norm(self, x, w, eps, delta=None, q8: bool = False):
        """(x + delta, RMSNorm(x + delta) * w, yq); x itself when delta is None. yq: with ``q8``, the
        normalised rows' q8_0 blocks (``reference.q8_rows``) that the next int8 matmuls take as ``xq``, else
        None."""
        if self.triton:
            return self._norm(x, w, eps, delta, pdl=self.pdl, q8=True) if q8 else (
                *self._norm(x, w, eps, delta, pdl=self.pdl), None)
        s, y = reference.add_rms_norm(x, w, eps, delta)
        return s, y, reference.q8_rows(y) if q8 else None

    def rope(self, pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float) -> Rope:
        """The RoPE of a pass whose rows sit at ``pos``: the kernel computes the angles itself, the
        reference's cos / sin (times ``scale``, YaRN's attention factor) are computed once."""
        return Rope(pos, inv_freq, scale, dtype, self.triton)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(gu, pdl=self.pdl) if self.triton else reference.silu_mul(gu)
