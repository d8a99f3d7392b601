"""RMSNorm, computed in float32 as the reference implementations do, optionally fused with the
residual add before it.

`norm(x)` returns the normed x. `norm(x, residual)` first adds x into the residual stream, in
place (the stream is the model's own tensor, read by nothing else), and returns
`(normed sum, sum)`, so that the decoder layers carry the residual separately (one pass over
memory for the add and the norm where a kernel runs). It may overwrite x: the C kernel writes
the normed sum there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, kernels: str = "torch") -> None:
        """`kernels` is the attention backend's name: its family of kernels runs this layer too
        ("triton"; "cpu" in float32, the C kernel), "torch" the reference path."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self._kernel = None
        # Imported here: a torch-only engine loads no Triton and builds no C.
        if kernels == "triton":
            from kvpilot.kernels.rms_norm import rms_norm

            self._kernel = rms_norm
        elif kernels == "cpu" and dtype == torch.float32:
            from kvpilot.kernels.cpu.fused_ops import build, rms_norm

            build()  # a missing compiler fails the model load, not its first step

            self._kernel = rms_norm

    def load(self, param_name: str, full: torch.Tensor, index: int = 0) -> None:
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._kernel is not None:
            if residual is None:
                return self._kernel(x, self.weight, self.eps)
            residual = residual.contiguous()
            return self._kernel(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One op; bitwise the reference's weight * (x * rsqrt(mean(x^2) + eps)).
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        # The reference order: normalise in float32, round to the input dtype, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
