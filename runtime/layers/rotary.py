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
    if rope_type == "linear":
        # Positions divided by the factor, which is every frequency divided by it.
        return inv_freq / scaling["factor"]
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: linear, llama3)")
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
                 kernels: str = "torch") -> None:
        """`kernels`: the attention backend's name, as for RMSNorm."""
        super().__init__()
        freqs = torch.arange(max_position).float()[:, None] * inverse_frequencies(head_dim, theta, scaling)
        # Both halves of the head share each frequency.
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        # The torch path's tables for the last positions seen: every layer of one step passes the
        # same positions tensor, so they are gathered once per step (a new step is a new tensor).
        self._positions: torch.Tensor | None = None
        self._angles: tuple[torch.Tensor, torch.Tensor] | None = None
        self._triton = self._cpu = None
        # Imported here: a torch-only engine loads no Triton and builds no C.
        if kernels == "triton":
            from kvpilot.kernels.rotary import rotary_embedding

            self._triton = rotary_embedding
        elif kernels == "cpu":
            from kvpilot.kernels.cpu.fused_ops import build, rotary_embedding

            build()  # a missing compiler fails the model load, not its first step

            self._cpu = rotary_embedding

    def forward(self, positions: torch.Tensor, qk: torch.Tensor, num_heads: int) -> None:
        """Rotates qk [T, heads + kv_heads, head_dim] in place: each token's query heads, then its
        key heads (in the model, views of the fused QKV projection's output); positions: [T].

        Both paths read the first half of the tables, which holds each angle once; the torch path
        rotates every head with the same few ops (the rotation does not depend on the head).
        """
        half = qk.shape[-1] // 2
        if self._triton is not None:
            self._triton(positions, qk[:, :num_heads], qk[:, num_heads:], self.cos[:, :half], self.sin[:, :half])
            return
        if self._cpu is not None and qk.dtype == torch.float32:
            self._cpu(positions, qk, self.cos, self.sin)
            return
        if positions is not self._positions or self._angles[0].dtype != qk.dtype:
            # [T, 1 (heads), half]: the same angles rotate both halves of every head.
            self._angles = tuple(table[positions, None, :half].to(qk.dtype) for table in (self.cos, self.sin))
            self._positions = positions
        cos, sin = self._angles
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): each product rounded as the reference's
        # x * cos + rotate_half(x) * sin rounds it, so the result is bitwise the same.
        x1, x2 = qk[..., :half], qk[..., half:]
        x2_sin, x1_sin = x2 * sin, x1 * sin
        x1.mul_(cos).sub_(x2_sin)
        x2.mul_(cos).add_(x1_sin)
