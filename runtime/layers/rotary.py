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
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)
