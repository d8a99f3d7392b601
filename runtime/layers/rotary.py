"""Rotary position embedding (the half-split "rotate_half" form Llama checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: llama3)")
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = ~(wavelen < original_len / high) & ~(wavelen > original_len / low)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 use_triton: bool = False) -> None:
        super().__init__()
        freqs = torch.arange(max_position).float()[:, None] * inverse_frequencies(head_dim, theta, scaling)
        # Both halves of the head share each frequency.
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self._triton = None
        # The torch path's tables for the last positions seen: every layer of one step passes the
        # same positions tensor, so they are gathered once per step (a new step is a new tensor).
        self._positions: torch.Tensor | None = None
        self._angles: tuple[torch.Tensor, torch.Tensor] | None = None
        if use_triton:
            # Imported here: torch-only engines load no Triton.
            from kvpilot.kernels.rotary import rotary_embedding

            self._triton = rotary_embedding

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T].

        The Triton kernel rotates q and k in place (they may be views of one projection output)
        from the first half of the tables, which holds each angle once.
        """
        if self._triton is not None:
            half = q.shape[-1] // 2
            self._triton(positions, q, k, self.cos[:, :half], self.sin[:, :half])
            return q, k
        if positions is not self._positions or self._angles[0].dtype != q.dtype:
            half = q.shape[-1] // 2
            # [T, 1 (heads), 1 (halves), half]: the same angles rotate both halves of every head.
            self._angles = tuple(table[positions, None, None, :half].to(q.dtype) for table in (self.cos, self.sin))
            self._positions = positions
        cos, sin = self._angles
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the halves of each head as one axis."""
    halves = x.unflatten(-1, (2, -1))
    rotated = torch.stack((-halves[..., 1, :], halves[..., 0, :]), dim=-2)
    return (halves * cos + rotated * sin).flatten(-2)
