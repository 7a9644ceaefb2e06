"""The layer's elementwise operations: fused Triton kernels on CUDA (kernels/rms_norm.py,
rope.py, swiglu.py), their plain-torch references elsewhere, as kv_ops does for the pages."""

from __future__ import annotations

import torch

from kernels import reference


class LayerOps:
    """add + RMSNorm, RoPE and SwiGLU for one device."""

    def __init__(self, device: torch.device):
        self.triton = device.type == "cuda"
        if self.triton:
            from kernels import rms_norm, rope, swiglu

            self._norm, self._rope, self._silu_mul = rms_norm.add_rms_norm, rope.rope, swiglu.silu_mul

    def add_rms_norm(self, x, w, eps, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta) * w); x itself when delta is None."""
        return (self._norm if self.triton else reference.add_rms_norm)(x, w, eps, delta)

    def angles(self, pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float):
        """What ``rope`` needs per step: the positions themselves for the kernel (it computes
        the angles), cos/sin (times ``scale``, YaRN's attention factor) for the reference."""
        return pos if self.triton else reference.rope_angles(pos, inv_freq, dtype, scale)

    def rope(self, x: torch.Tensor, angles, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
        return self._rope(x, angles, inv_freq, scale) if self.triton else reference.rope(x, *angles)

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        return (self._silu_mul if self.triton else reference.silu_mul)(gu)
