"""The C paged-attention kernel (paged_attention.c) behind the signature of kernels/paged_attention.py.

One call attends a whole packed step (decodes and prefill chunks) straight out of the paged
cache. The tensors are passed as pointers with their strides, so q and out may be views (q is
a slice of the fused QKV projection); only head_dim must be contiguous. q, the caches and out share
one dtype: float32, or bfloat16 (widened to float32 as it is loaded, accumulated in float32).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvpilot.kernels.cpu.build import load

# Each dtype's entry point in paged_attention.c.
ENTRY_POINTS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
DTYPES = tuple(ENTRY_POINTS)
_ERRORS = {1: "the query heads do not group onto the KV heads (or over 64 share one)",
           2: "head_dim is too large for the kernel's row buffer", 3: "out of memory"}


def bind(library: ctypes.CDLL, dtype: torch.dtype = torch.float32):
    """The kernel's entry point for dtype in a library built from paged_attention.c, typed for ctypes."""
    function = getattr(library, ENTRY_POINTS[dtype])
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64,
                         i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


@functools.cache
def entry_point(dtype: torch.dtype):
    """This source's entry point for dtype, typed (the C layer stack calls it by address too)."""
    return bind(load("paged_attention"), dtype)


def build() -> None:
    """Compiles (or finds in the cache) and loads the kernel now; raises KernelBuildError."""
    entry_point(torch.float32)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    kernel=None,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; key/value_cache: [num_blocks, block_size, kv_heads, head_dim];
    block_tables, query_start_loc, seq_lens: int64 CPU tensors, as in kernels/paged_attention.py.
    kernel: a `bind()`-ed entry point (for q's dtype) to call instead of this source's (a
    benchmark's baseline)."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_reqs = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    # Plain comparisons (this runs once per layer per step; each check costs as much as the
    # Python side of a small op): the message that says what is wrong is built only on failure.
    if not (q.is_cpu and key_cache.is_cpu and value_cache.is_cpu and block_tables.is_cpu
            and query_start_loc.is_cpu and seq_lens.is_cpu and q.dtype in DTYPES
            and key_cache.dtype == value_cache.dtype == out.dtype == q.dtype
            and block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int64
            and key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1 and q.stride(-1) == 1
            and out.stride(-1) == 1 and out.shape == q.shape and block_tables.stride(-1) == 1
            and query_start_loc.stride(0) == 1 and seq_lens.stride(0) == 1
            and query_start_loc.shape == (num_reqs + 1,) and block_tables.dim() == 2
            and block_tables.shape[0] >= num_reqs):
        _refuse(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out)
    status = (kernel or entry_point(q.dtype))(
        out.data_ptr(), out.stride(0), out.stride(1), q.data_ptr(), q.stride(0), q.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3],
        block_tables.data_ptr(), block_tables.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        num_reqs, num_heads, num_kv_heads, head_dim, block_size, scale, torch.get_num_threads(),
    )
    if status:
        raise ValueError(f"CPU paged attention: {_ERRORS.get(status, f'error {status}')} "
                         f"(heads {num_heads}, kv_heads {num_kv_heads}, head_dim {head_dim})")
    return out


def _refuse(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out) -> None:
    """Raises the ValueError that says which of paged_attention's requirements the inputs miss."""
    tensors = (q, key_cache, value_cache, block_tables, query_start_loc, seq_lens)
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("the CPU paged-attention kernel takes CPU tensors only")
    if q.dtype not in DTYPES or key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(f"the CPU paged-attention kernel supports {[str(d) for d in DTYPES]}, "
                         f"got q {q.dtype} and caches {key_cache.dtype}/{value_cache.dtype}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the key and value caches need one layout with contiguous head_dim, and q too")
    if any(t.dtype != torch.int64 for t in tensors[3:]) or block_tables.stride(-1) != 1 \
            or query_start_loc.stride(0) != 1 or seq_lens.stride(0) != 1:
        raise ValueError("block_tables, query_start_loc and seq_lens must be contiguous int64 rows")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_reqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] < num_reqs:
        raise ValueError(f"query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries and block_tables "
                         f"a row per request, got {tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}")
    raise ValueError("out must be shaped like q, with its dtype and a contiguous head_dim")
