"""Weights kept quantized (GGUF block types and per-row int8), and the matmul that reads them packed.

A `PackedWeight` is a [rows, cols] linear weight (rows = output features) whose bytes stay as
the file has them. `quant_matmul(x, w)` computes `x @ dequantize(w).T` with float32 activations
and accumulation, the weights dequantized on the fly: equal to float32 matmul on the
dequantized weights up to summation order. `reference_matmul` is that definition in torch.

The C kernel (quant_matmul.c) is built per ISA level and picked at run time (isa.py): the best
level this CPU and OS run, or `$KVPILOT_CPU_ISA`; `quant_matmul(..., isa=level)` asks for one
level explicitly (tests run every level the machine can).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvpilot.kernels.cpu import isa as isa_levels
from kvpilot.kernels.cpu.build import KernelBuildError
from kvpilot.kernels.cpu.quant_formats import GGML_FORMATS, INT8, PACKED_TYPES, block_size, dequantize_rows

__all__ = ["PACKED_TYPES", "PackedWeight", "from_gguf", "pack_int8", "dequantize", "embedding",
           "reference_matmul", "quant_matmul", "runnable_isas", "chosen_isa"]

SOURCE = Path(__file__).resolve().parent / "quant_matmul.c"
SELF_CHECK = "quant_matmul_self_check"
# From this many rows of x on, the whole weight is dequantized into a float32 scratch and torch's
# GEMM runs it. Measured on SmolLM2's shapes (Q4_1, Q8_0, Q6_K; 2 threads, AVX-512), the two break
# even at 64 rows; at 128 the GEMM takes 0.8x the tiled kernel's time, at 2048 0.35x, its
# dequantizing included.
GEMM_MIN_ROWS = 96
# The C source's type codes (its enum).
QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7, INT8: 8}


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

    @functools.cached_property
    def kernel_args(self) -> tuple[int, int, int, int, int, int]:
        """The C kernel's weight arguments (type code, data pointer, row stride in bytes, scales
        pointer, rows, cols), computed once: a decode step calls the kernel hundreds of times."""
        scales = 0 if self.scales is None else self.scales.data_ptr()
        return (QTYPE_CODES[self.qtype], self.data.data_ptr(), self.data.stride(0) * self.data.element_size(), scales,
                self.rows, self.cols)

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


def runnable_isas() -> list[str]:
    """The ISA levels the kernel runs at on this machine, best first."""
    return isa_levels.runnable(SOURCE, SELF_CHECK)


@functools.cache
def chosen_isa() -> str:
    """The level quant_matmul uses by default: `$KVPILOT_CPU_ISA`, else the best that runs here."""
    return isa_levels.choose(SOURCE, SELF_CHECK)


@dataclass(frozen=True)
class _Kernels:
    matmul: ctypes._CFuncPtr
    dequantize: ctypes._CFuncPtr


@functools.cache
def _kernel(level: str) -> _Kernels:
    reason = isa_levels.why_not(SOURCE, level, SELF_CHECK)
    if reason:
        raise KernelBuildError(f"the quantized matmul cannot run at ISA level {level!r}: {reason}")
    library = ctypes.CDLL(str(isa_levels.library(SOURCE, level)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.quant_matmul_f32.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
    library.quant_dequantize_f32.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, ctypes.c_int]
    library.quant_matmul_f32.restype = library.quant_dequantize_f32.restype = ctypes.c_int
    return _Kernels(library.quant_matmul_f32, library.quant_dequantize_f32)


def build(level: str | None = None) -> None:
    """Compiles, probes and loads the kernel now (at `level`, else the chosen one); raises KernelBuildError."""
    _kernel(level or chosen_isa())


def quant_matmul(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None, *,
                 isa: str | None = None) -> torch.Tensor:
    """x float32 [M, cols] with contiguous rows -> float32 [M, rows] (into `out` when given).
    isa: an ISA level to run at instead of the chosen one."""
    # Plain comparisons first (this runs for every linear layer of every step); the message that
    # says what is wrong is built only on failure.
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == weight.cols and x.stride(1) == 1
            and x.is_cpu):
        _check_operands(x, weight, out)
    if out is None:
        out = torch.empty(x.shape[0], weight.rows, dtype=torch.float32)
    elif not (out.dtype == torch.float32 and out.shape == (x.shape[0], weight.rows) and out.stride(1) == 1
              and out.is_cpu):
        _check_operands(x, weight, out)
    if weight.cols == 0:
        return out.zero_()
    kernels = _kernel(isa) if isa else _default_kernel()
    threads = torch.get_num_threads()
    if x.shape[0] >= GEMM_MIN_ROWS:
        dequantized = _scratch(weight.rows, weight.cols)
        kernels.dequantize(*weight.kernel_args, dequantized.data_ptr(), weight.cols, threads)
        return torch.mm(x, dequantized.T, out=out)
    if kernels.matmul(*weight.kernel_args, x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(), out.stride(0),
                      threads):
        raise MemoryError(f"the quantized matmul could not allocate a transposed copy of x {list(x.shape)}")
    return out


_scratch_buffer = torch.empty(0)


def _scratch(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] view of one buffer kept for the process: a fresh one per call would
    fault its pages in anew (megabytes, every layer of every prefill step)."""
    global _scratch_buffer
    if _scratch_buffer.numel() < rows * cols:
        _scratch_buffer = torch.empty(rows * cols, dtype=torch.float32)
    return _scratch_buffer[: rows * cols].view(rows, cols)


@functools.cache
def _default_kernel():
    return _kernel(chosen_isa())


def matmul_entry_point():
    """The matmul's entry point at the chosen level, typed (the C layer stack calls it by address)."""
    return _default_kernel().matmul


def _check_operands(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None) -> None:
    if not (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.shape[1] == weight.cols
            and (x.stride(1) == 1 or x.shape[1] <= 1)):
        raise ValueError(f"quant_matmul takes x float32 [M, {weight.cols}] on the CPU with contiguous rows, got "
                         f"{x.dtype} {list(x.shape)} strides {x.stride()} on {x.device}")
    if out is not None and not (out.dtype == torch.float32 and out.is_cpu and tuple(out.shape) == (x.shape[0], weight.rows)
                                and (out.stride(1) == 1 or weight.rows <= 1)):
        raise ValueError(f"out must be float32 [{x.shape[0]}, {weight.rows}] on the CPU with contiguous rows, got "
                         f"{out.dtype} {list(out.shape)} strides {out.stride()}")
