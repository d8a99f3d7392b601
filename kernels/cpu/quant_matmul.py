"""Weights kept quantized (GGUF block types and per-row int8), and the matmul that reads them packed.

A `PackedWeight` is a [rows, cols] linear weight (rows = output features) whose bytes stay as
the file has them. `quant_matmul(x, w)` computes `x @ dequantize(w).T` with float32 activations
and accumulation, the weights dequantized on the fly: equal to float32 matmul on the
dequantized weights up to summation order. `reference_matmul` is that definition in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.kernels.cpu.quant_formats import GGML_FORMATS, INT8, PACKED_TYPES, block_size, dequantize_rows

__all__ = ["PACKED_TYPES", "PackedWeight", "from_gguf", "pack_int8", "dequantize", "embedding",
           "reference_matmul", "quant_matmul"]


@dataclass(frozen=True)
class PackedWeight:
    """A [rows, cols] weight (rows = output features, cols = input features) kept quantized.

    data: for a GGML type uint8 [rows, row_bytes], each row its cols / block_size blocks in file
    order; for int8, int8 [rows, cols] with `scales` float32 [rows]. The rows of data may be a
    view (a shard) with a row stride wider than row_bytes; the bytes within a row are contiguous.
    """

    qtype: str
    rows: int
    cols: int
    data: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_layout(self)

    def narrow_rows(self, start: int, length: int) -> PackedWeight:
        """Output rows [start, start + length): a column-parallel shard, or one of fused q/k/v."""
        if not (0 <= start and 0 <= length and start + length <= self.rows):
            raise ValueError(f"rows [{start}, {start + length}) are outside the weight's {self.rows} rows")
        scales = None if self.scales is None else self.scales.narrow(0, start, length)
        return PackedWeight(self.qtype, length, self.cols, self.data.narrow(0, start, length), scales)

    def narrow_cols(self, start: int, length: int) -> PackedWeight:
        """Input columns [start, start + length): a row-parallel shard, whole blocks only."""
        if not (0 <= start and 0 <= length and start + length <= self.cols):
            raise ValueError(f"columns [{start}, {start + length}) are outside the weight's {self.cols} columns")
        size = block_size(self.qtype)
        if start % size or length % size:
            raise ValueError(f"columns [{start}, {start + length}) of a {self.qtype} weight split its blocks of "
                             f"{size} columns: a shard must start and end on a block boundary")
        if self.qtype == INT8:
            return PackedWeight(INT8, self.rows, length, self.data.narrow(1, start, length), self.scales)
        block_bytes = GGML_FORMATS[self.qtype].block_bytes
        data = self.data.narrow(1, start // size * block_bytes, length // size * block_bytes)
        return PackedWeight(self.qtype, self.rows, length, data)

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads (its blocks, plus int8's scales)."""
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.rows * _row_bytes(self.qtype, self.cols) + scales


def _row_bytes(qtype: str, cols: int) -> int:
    if qtype == INT8:
        return cols
    fmt = GGML_FORMATS[qtype]
    return cols // fmt.block_size * fmt.block_bytes


def _check_layout(weight: PackedWeight) -> None:
    qtype, rows, cols, data = weight.qtype, weight.rows, weight.cols, weight.data
    if qtype not in PACKED_TYPES:
        raise ValueError(f"unknown packed type {qtype!r} (kept packed: {', '.join(sorted(PACKED_TYPES))})")
    if rows < 0 or cols < 0 or cols % block_size(qtype):
        raise ValueError(f"a {qtype} weight needs columns in whole blocks of {block_size(qtype)}, got "
                         f"[{rows}, {cols}]")
    dtype = torch.int8 if qtype == INT8 else torch.uint8
    shape = (rows, _row_bytes(qtype, cols))
    if data.dtype != dtype or tuple(data.shape) != shape or not data.is_cpu or (cols and data.stride(1) != 1):
        raise ValueError(f"a [{rows}, {cols}] {qtype} weight needs {dtype} data {list(shape)} on the CPU with "
                         f"contiguous rows, got {data.dtype} {list(data.shape)} strides {data.stride()} "
                         f"on {data.device}")
    if (qtype == INT8) != (weight.scales is not None):
        raise ValueError("int8 weights need per-row scales and GGML types none (their scales are in the blocks)")
    if weight.scales is not None and (weight.scales.dtype != torch.float32 or tuple(weight.scales.shape) != (rows,)
                                      or weight.scales.stride(0) != 1 or not weight.scales.is_cpu):
        raise ValueError(f"int8 scales must be a contiguous float32 CPU vector of {rows} entries, got "
                         f"{weight.scales.dtype} {list(weight.scales.shape)}")


def from_gguf(qtype: str, rows: int, cols: int, raw: np.ndarray) -> PackedWeight:
    """A GGUF tensor's bytes (numpy uint8, any shape: gguf's reader gives [rows, row_bytes]) as a
    PackedWeight; a byte count that does not match the shape is a ValueError."""
    if qtype not in GGML_FORMATS:
        raise ValueError(f"GGUF type {qtype!r} is not kept packed (packed: {', '.join(sorted(GGML_FORMATS))})")
    size = GGML_FORMATS[qtype].block_size
    if cols % size:
        raise ValueError(f"a {qtype} tensor of {cols} columns does not hold whole blocks of {size}")
    expected = rows * _row_bytes(qtype, cols)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.size != expected:
        raise ValueError(f"a [{rows}, {cols}] {qtype} tensor has {expected} bytes, got {raw.size} "
                         f"{raw.dtype} elements")
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, expected // rows if rows else 0))
    return PackedWeight(qtype, rows, cols, data)


def pack_int8(weight: torch.Tensor) -> PackedWeight:
    """A float [rows, cols] weight quantized per output row, symmetric: w ~= q * scale, |q| <= 127."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"pack_int8 takes a float [rows, cols] weight, got {weight.dtype} {list(weight.shape)}")
    weight = weight.detach().float().cpu()
    amax = weight.abs().amax(dim=1) if weight.shape[1] else torch.zeros(weight.shape[0])
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    data = torch.round(weight / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return PackedWeight(INT8, weight.shape[0], weight.shape[1], data, scales.contiguous())


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """float32 [rows, cols]: bitwise what gguf's numpy dequantizer gives for the same blocks."""
    return dequantize_rows(weight.qtype, weight.data, weight.scales)


def embedding(ids: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """float32 [len(ids), cols]: the rows of the weight that ids name, only those dequantized."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embedding ids must be a vector of int32/int64, got {ids.dtype} {list(ids.shape)}")
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < weight.rows):
        raise ValueError(f"embedding ids must lie in [0, {weight.rows})")
    ids = ids.cpu()
    scales = None if weight.scales is None else weight.scales[ids]
    return dequantize_rows(weight.qtype, weight.data[ids], scales)


def reference_matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x @ dequantize(weight).T in float32: the definition quant_matmul is tested against."""
    return x.float() @ dequantize(weight).T


def quant_matmul(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, cols] with contiguous rows -> float32 [M, rows] (into `out` when given)."""
    _check_operands(x, weight, out)
    result = reference_matmul(x, weight)
    if out is None:
        return result
    return out.copy_(result)


def _check_operands(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None) -> None:
    if not (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] == weight.cols
            and (x.stride(1) == 1 or x.shape[1] <= 1)):
        raise ValueError(f"quant_matmul takes x float32 [M, {weight.cols}] on the CPU with contiguous rows, got "
                         f"{x.dtype} {list(x.shape)} strides {x.stride()} on {x.device}")
    if out is not None and not (out.dtype == torch.float32 and out.is_cpu and tuple(out.shape) == (x.shape[0], weight.rows)
                                and (out.stride(1) == 1 or weight.rows <= 1)):
        raise ValueError(f"out must be float32 [{x.shape[0]}, {weight.rows}] on the CPU with contiguous rows, got "
                         f"{out.dtype} {list(out.shape)} strides {out.stride()}")
