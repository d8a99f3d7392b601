"""The decode step's small ops in C (fused_ops.c), float32: RMSNorm (fused with the residual add),
the rotary embedding, the gated MLP's activation, the KV cache write and the greedy argmax.

The model runs them when the attention backend is `cpu`: one call each instead of the torch
path's several ops (each a dispatch and a pass over memory, which at decode sizes costs more
than the arithmetic). Their torch references are the layers' own torch paths, `F.silu(gate) * up`,
`index_copy_` and `torch.argmax` (which on a CPU tracks its index in scalar code: ~20x slower than `amax`).
The checks here run on every call, so they are kept to plain comparisons.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvpilot.kernels.cpu.build import load

# The dtypes a KV cache is written in (the attention kernel reads both).
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> ctypes.CDLL:
    """The built library, its entry points typed (the C layer stack calls them by address too)."""
    built = load("fused_ops")
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    built.rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, f32, i32]
    built.rotary_f32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, i64, i32]
    built.kv_cache_write.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    built.argmax_f32.argtypes = [ptr, i64, i64, i64, ptr, i32]
    built.silu_and_mul_f32.argtypes = [ptr, i64, ptr, i64, i64, i64, i32]
    built.rms_norm_f32.restype = built.argmax_f32.restype = built.silu_and_mul_f32.restype = None
    built.rotary_f32.restype = built.kv_cache_write.restype = ctypes.c_int
    return built


def build() -> None:
    """Compiles (or finds in the cache) and loads the library now; raises KernelBuildError."""
    library()


def _rows_ok(tensor: torch.Tensor, dims: int) -> bool:
    return tensor.dtype == torch.float32 and tensor.is_cpu and tensor.dim() == dims and tensor.stride(-1) == 1


def _check_rows(name: str, tensor: torch.Tensor, dims: int) -> None:
    if not _rows_ok(tensor, dims):
        raise ValueError(f"{name} must be a float32 CPU tensor of {dims} dimensions with a contiguous last "
                         f"dimension, got {tensor.dtype} {tuple(tensor.shape)} strides {tensor.stride()} "
                         f"on {tensor.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, hidden]. Returns weight * normalised x in a new tensor; or, given a residual
    [T, hidden], adds x into it in place, then normalises the sum into x itself and returns x (the
    decoder layers drop their x once it is in the residual stream: no new tensor per call)."""
    if residual is None:
        if not (_rows_ok(x, 2) and _rows_ok(weight, 1) and weight.shape[0] == x.shape[1]):
            _refuse_rms_norm(x, weight, residual)
        out = torch.empty(x.shape, dtype=x.dtype)
        library().rms_norm_f32(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), None, 0,
                                weight.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out
    # The decoder layers' call, twice per layer: contiguous tensors (as every projection's output
    # and the residual stream are) need only a few comparisons; strided rows the full checks.
    if x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous() \
            and x.dtype == residual.dtype == weight.dtype == torch.float32 and x.is_cpu and residual.is_cpu \
            and weight.is_cpu and x.dim() == 2 and weight.dim() == 1 and residual.shape == x.shape \
            and weight.shape[0] == x.shape[1]:
        x_stride = residual_stride = x.shape[1]
    elif _rows_ok(x, 2) and _rows_ok(weight, 1) and _rows_ok(residual, 2) and weight.shape[0] == x.shape[1] \
            and residual.shape == x.shape:
        x_stride, residual_stride = x.stride(0), residual.stride(0)
    else:
        _refuse_rms_norm(x, weight, residual)
    ptr = x.data_ptr()
    library().rms_norm_f32(ptr, x_stride, ptr, x_stride, residual.data_ptr(), residual_stride, weight.data_ptr(),
                            x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return x


def _refuse_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    _check_rows("x", x, 2)
    _check_rows("weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} entries for a hidden size of {x.shape[1]}")
    _check_rows("residual", residual, 2)
    raise ValueError(f"residual {tuple(residual.shape)} must be shaped like x {tuple(x.shape)}")


def rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, heads, head_dim] in place (it may be a strided view); positions: [T] int64;
    cos, sin: [max_position, >= head_dim / 2], of which the first half of each row is read."""
    half = x.shape[-1] // 2
    if not (_rows_ok(x, 3) and _rows_ok(cos, 2) and sin.stride() == cos.stride() and sin.shape == cos.shape
            and sin.dtype == cos.dtype and cos.shape[1] >= half):
        _check_rows("x", x, 3)
        _check_rows("cos", cos, 2)
        raise ValueError("cos and sin must share one shape and layout, with at least head_dim / 2 columns")
    if positions.dtype != torch.int64 or positions.dim() != 1 or positions.stride(0) != 1 \
            or positions.shape[0] != x.shape[0]:
        raise ValueError("positions must be a contiguous int64 vector, one entry per token of x")
    if library().rotary_f32(
        x.data_ptr(), x.stride(0), x.stride(1), x.shape[0], x.shape[1], half, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), cos.shape[0], torch.get_num_threads(),
    ):
        raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the rotary tables' length)")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * width] (gate, then up) -> silu(gate) * up [T, width], in a new tensor."""
    if not (_rows_ok(x, 2) and x.shape[1] % 2 == 0):
        _check_rows("x", x, 2)
        raise ValueError(f"x must hold the gate and up halves side by side (an even width), got {x.shape[1]}")
    width = x.shape[1] // 2
    out = torch.empty(x.shape[0], width, dtype=x.dtype)
    library().silu_and_mul_f32(out.data_ptr(), width, x.data_ptr(), x.stride(0), x.shape[0], width,
                                torch.get_num_threads())
    return out


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Writes row t of k and v [T, kv_heads, head_dim] (views with contiguous rows, e.g. of the
    fused QKV output) into slot slot_mapping[t] of the caches [num_blocks, block_size, kv_heads,
    head_dim]: `index_copy_` into the caches seen flat, in one call for both. All four share one
    dtype of KV_CACHE_DTYPES."""
    row_size = k.shape[1] * k.shape[2]
    if not (k.is_cpu and v.is_cpu and key_cache.is_cpu and value_cache.is_cpu and slot_mapping.is_cpu):
        raise ValueError("the C KV cache write takes CPU tensors only")
    if not (k.dtype == v.dtype == key_cache.dtype == value_cache.dtype and k.dtype in KV_CACHE_DTYPES
            and k.shape == v.shape and k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and key_cache.shape == value_cache.shape and key_cache.shape[2:] == k.shape[1:]):
        raise ValueError(f"k and v must be [T, kv_heads, head_dim] views with contiguous rows, and the caches "
                         f"contiguous [blocks, block_size, kv_heads, head_dim] tensors, all float32 or all "
                         f"bfloat16; got k {tuple(k.shape)} {k.stride()} {k.dtype}, v {tuple(v.shape)} "
                         f"{v.stride()} {v.dtype}, caches {tuple(key_cache.shape)} {key_cache.dtype} and "
                         f"{tuple(value_cache.shape)} {value_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.shape != k.shape[:1]:
        raise ValueError("slot_mapping must be a contiguous int64 vector, one entry per row of k")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if library().kv_cache_write(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), key_cache.data_ptr(),
                                 value_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], row_size,
                                 k.element_size(), num_slots):
        raise ValueError(f"slot_mapping must lie in [0, {num_slots}) (the caches' slots)")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of x [B, V] float32 (its last dimension contiguous): the first
    index of each row's maximum, a NaN counting as the maximum."""
    _check_rows("x", x, 2)
    if x.shape[1] == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().argmax_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out
