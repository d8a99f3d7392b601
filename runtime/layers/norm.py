"""RMSNorm, computed in float32 as the reference implementations do, optionally fused with the
residual add before it.

`norm(x)` returns the normed x. `norm(x, residual)` first adds x into the residual stream and
returns `(normed sum, sum)`, so that the decoder layers carry the residual separately (one pass
over memory for the add and the norm where the Triton kernel runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, use_triton: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self._triton = None
        if use_triton:
            # Imported here: torch-only engines load no Triton.
            from kvpilot.kernels.rms_norm import rms_norm

            self._triton = rms_norm

    def load(self, param_name: str, full: torch.Tensor, index: int = 0) -> None:
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self._triton is not None:
            if residual is None:
                return self._triton(x, self.weight, self.eps)
            residual = residual.contiguous()
            return self._triton(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # The reference order: normalise in float32, round to the input dtype, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
