"""The packed weight formats the CPU matmul keeps in memory, and their torch dequantizer (the reference).

Each GGML type stores a row of `cols` weights as `cols / block_size` blocks of `block_bytes`
bytes, in file order (ggml's `block_q4_0` ... `block_q6_K`). Every type decodes to
`w = scale * q + offset` over sub-blocks of 16 or 32 weights, with small integers q and float32
scale and offset computed from fp16 fields exactly as gguf's numpy dequantizer computes them (one
rounding per product), so `dequantize` here is bitwise gguf's on the same bytes.

"int8" is kvpilot's own: int8 [rows, cols] with one float32 scale per output row (symmetric).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    block_size: int              # weights per block
    block_bytes: int             # bytes per block
    half_offsets: tuple[int, ...]  # byte offsets of the block's fp16 fields (d, then m or dmin)


GGML_FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat(32, 18, (0,)),
    "Q4_1": BlockFormat(32, 20, (0, 2)),
    "Q5_0": BlockFormat(32, 22, (0,)),
    "Q5_1": BlockFormat(32, 24, (0, 2)),
    "Q8_0": BlockFormat(32, 34, (0,)),
    "Q4_K": BlockFormat(256, 144, (0, 2)),
    "Q5_K": BlockFormat(256, 176, (0, 2)),
    "Q6_K": BlockFormat(256, 210, (208,)),
}
INT8 = "int8"
PACKED_TYPES: frozenset[str] = frozenset({*GGML_FORMATS, INT8})


def block_size(qtype: str) -> int:
    """The column granularity of a type: a shard's columns must start and end on it."""
    return 1 if qtype == INT8 else GGML_FORMATS[qtype].block_size


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at `offset` of every block, as float32 [..., blocks, 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> [..., 2n]: the n low nibbles, then the n high ones (ggml's order in a run)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> [..., 8n] little-endian bits (bit j of the run is bit j % 8 of byte j // 8)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs packed in Q4_K/Q5_K's 12 scale bytes, as float32 [..., 8]."""
    d, m, high = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (high & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (high >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mins.float()


def _q4_0(b):
    return _half(b, 0) * (_nibbles(b[..., 2:18]).float() - 8)


def _q4_1(b):
    return _half(b, 0) * _nibbles(b[..., 4:20]).float() + _half(b, 2)


def _q5_0(b):
    q = _nibbles(b[..., 6:22]) | (_bits(b[..., 2:6]) << 4)
    return _half(b, 0) * (q.float() - 16)


def _q5_1(b):
    q = _nibbles(b[..., 8:24]) | (_bits(b[..., 4:8]) << 4)
    return _half(b, 0) * q.float() + _half(b, 2)


def _q8_0(b):
    return _half(b, 0) * b[..., 2:34].contiguous().view(torch.int8).float()


def _q4_k(b):
    sc, mins = _k_scales(b[..., 4:16])
    # 4 runs of 32 bytes; each run's low nibbles are one sub-block of 32, its high nibbles the next.
    q = _nibbles(b[..., 16:144].unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)
    return _k_sub_blocks(b, sc, mins, q)


def _q5_k(b):
    sc, mins = _k_scales(b[..., 4:16])
    low = _nibbles(b[..., 48:176].unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)
    # Bit i of high byte l is the fifth bit of weight l of sub-block i.
    high = (b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).unsqueeze(-1)) & 1
    return _k_sub_blocks(b, sc, mins, low | (high << 4))


def _k_sub_blocks(b, sc, mins, q):
    """Q4_K/Q5_K's w = (d * scale) * q - dmin * min per sub-block; q: [..., 8, 32]."""
    scale = (_half(b, 0) * sc).unsqueeze(-1)
    offset = (_half(b, 2) * mins).unsqueeze(-1)
    return (scale * q.float() - offset).flatten(-2)


def _q6_k(b):
    # Two halves of 128 weights: 64 bytes of low nibbles (weights 0..63 low, 64..127 high) and 32
    # bytes whose bit pairs 0, 2, 4, 6 are the top two bits of weights l, l+32, l+64, l+96.
    low = _nibbles(b[..., 0:128].unflatten(-1, (2, 64)))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).unsqueeze(-1)
    high = ((b[..., 128:192].unflatten(-1, (2, 32)).unsqueeze(-2) >> shifts) & 3).flatten(-2)
    q = ((low | (high << 4)).flatten(-2).float() - 32).unflatten(-1, (16, 16))
    scale = _half(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()
    return (scale.unsqueeze(-1) * q).flatten(-2)


_DEQUANTIZERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
                 "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize_rows(qtype: str, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """float32 [rows, cols] from a packed type's data (and int8's per-row scales)."""
    if qtype == INT8:
        return data.float() * scales.unsqueeze(-1)
    fmt = GGML_FORMATS[qtype]
    blocks = data.unflatten(-1, (-1, fmt.block_bytes))
    return _DEQUANTIZERS[qtype](blocks).flatten(-2)


def random_blocks(qtype: str, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, row_bytes] of a GGML type: random quants and sub-block scales, with finite fp16
    fields of a weight-like size (random bytes there would be NaN or huge). gguf can quantize only
    the 32-weight types; random blocks cover every type's bit layout, gguf's dequantizer the oracle."""
    fmt = GGML_FORMATS[qtype]
    blocks = torch.randint(0, 256, (rows, cols // fmt.block_size, fmt.block_bytes), dtype=torch.uint8,
                           generator=generator)
    for offset in fmt.half_offsets:
        halves = (torch.rand(rows, cols // fmt.block_size, generator=generator) * 0.02 + 0.001).half()
        blocks[..., offset:offset + 2] = halves.unsqueeze(-1).view(torch.uint8)
    return blocks.flatten(1)
