"""A Llama-family model's decoder layers in one C call (layer_stack.c): the CPU's decode path.

The stack is built once from the layers' weights and KV caches (`StackLayer`) and the model's
shape (`StackModel`); each step then passes its activations and attention metadata in one call.
It runs the same kernels, in the same order, on the same arguments as the per-layer Python path
(RMSNorm and the rest from fused_ops.c, the packed matmul, paged attention), so its output is
that path's bit for bit: the layer-by-layer forward is its reference.

It takes what the C matmul takes: packed weights (no float ones), float32 activations and
caches, and fewer than `GEMM_MIN_ROWS` tokens (past that a step dequantizes into torch's GEMM).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvpilot.kernels.cpu import fused_ops, paged_attention, quant_matmul
from kvpilot.kernels.cpu.build import load
from kvpilot.kernels.cpu.quant_matmul import GEMM_MIN_ROWS, QTYPE_CODES, PackedWeight

# The most tokens a step may have here.
MAX_TOKENS = GEMM_MIN_ROWS - 1
_MAX_PARTS = 3
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("matmul", "rms_norm", "rotary", "kv_write", "attention", "silu_and_mul")]


class _Packed(ctypes.Structure):
    _fields_ = [("qtype", _i64), ("data", _ptr), ("row_stride", _i64), ("row_scales", _ptr), ("rows", _i64),
                ("cols", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [("num_parts", _i64), ("parts", _Packed * _MAX_PARTS), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_attention_norm", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("key_cache", _ptr), ("value_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [*((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "block_size",
                                            "num_slots")),
                ("eps", _f32), ("scale", _f32), ("cos", _ptr), ("sin", _ptr), ("table_stride", _i64),
                ("num_positions", _i64)]


class _Step(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("num_reqs", _i64),
                *((name, _ptr) for name in ("positions", "slot_mapping", "block_tables", "query_start_loc",
                                            "seq_lens")),
                ("block_tables_stride", _i64), ("hidden", _ptr), ("residual", _ptr), ("has_residual", ctypes.c_int),
                *((name, _ptr) for name in ("qkv", "attn", "gate_up", "act"))]


_OPS = {1: "the packed matmul (status 2: out of memory)", 2: "the rotary embedding (a position outside its tables)",
        3: "the KV cache write (a slot outside the cache)", 4: "paged attention"}


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer's tensors: each linear layer as its packed parts (side by side in its
    output) and its bias or None; the KV caches [num_blocks, block_size, kv_heads, head_dim]."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: list[PackedWeight]
    qkv_bias: torch.Tensor | None
    o: list[PackedWeight]
    o_bias: torch.Tensor | None
    gate_up: list[PackedWeight]
    down: list[PackedWeight]
    key_cache: torch.Tensor
    value_cache: torch.Tensor


@dataclass(frozen=True)
class StackModel:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    # The rotary tables [num_positions, >= head_dim / 2], of which each row's first half is read.
    cos: torch.Tensor
    sin: torch.Tensor


def why_not_stackable(layer: StackLayer) -> str | None:
    """Why the C stack cannot run this layer, or None."""
    for name in ("qkv", "o", "gate_up", "down"):
        parts = getattr(layer, name)
        if not 1 <= len(parts) <= _MAX_PARTS or not all(isinstance(part, PackedWeight) for part in parts):
            return f"its {name} weights are not all packed (a float or unquantized checkpoint)"
    if layer.key_cache.dtype != torch.float32:
        return f"its KV cache is {layer.key_cache.dtype}, not float32"
    return None


def _entry(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _linear(parts: list[PackedWeight], bias: torch.Tensor | None) -> _Linear:
    packed = (_Packed * _MAX_PARTS)(*(_Packed(QTYPE_CODES[part.qtype], *part.kernel_args[1:]) for part in parts))
    return _Linear(len(parts), packed, None if bias is None else bias.data_ptr())


class LayerStack:
    def __init__(self, model: StackModel, layers: list[StackLayer]) -> None:
        for i, layer in enumerate(layers):
            reason = why_not_stackable(layer)
            if reason:
                raise ValueError(f"layer {i} cannot run in the C layer stack: {reason}")
        # The tensors the structs point into, kept alive with them.
        self._tensors = (model, layers)
        cache = self._first_key_cache = layers[0].key_cache
        self._model = _Model(
            model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size,
            cache.shape[1], cache.shape[0] * cache.shape[1], model.rms_norm_eps, model.head_dim**-0.5,
            model.cos.data_ptr(), model.sin.data_ptr(), model.cos.stride(0), model.cos.shape[0])
        self._structs = (_Layer * len(layers))(*(_Layer(
            layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(), _linear(layer.qkv, layer.qkv_bias),
            _linear(layer.o, layer.o_bias), _linear(layer.gate_up, None), _linear(layer.down, None),
            layer.key_cache.data_ptr(), layer.value_cache.data_ptr()) for layer in layers))
        library = fused_ops.library()
        self._kernels = _Kernels(
            _entry(quant_matmul.matmul_entry_point()), _entry(library.rms_norm_f32), _entry(library.rotary_f32),
            _entry(library.kv_cache_write), _entry(paged_attention.entry_point(torch.float32)),
            _entry(library.silu_and_mul_f32))
        self._run = load("layer_stack").layer_stack_run
        self._run.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _i64,
                              ctypes.POINTER(_Step), ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._run.restype = ctypes.c_int
        width = max(model.num_heads + 2 * model.num_kv_heads, 1) * model.head_dim
        # Scratch rows for every step: a step's activations never outlive it.
        self._qkv = torch.empty(MAX_TOKENS, width)
        self._attn = torch.empty(MAX_TOKENS, model.num_heads * model.head_dim)
        self._gate_up = torch.empty(MAX_TOKENS, 2 * model.intermediate_size)
        self._act = torch.empty(MAX_TOKENS, model.intermediate_size)
        self._status = ctypes.c_int()

    def serves(self, kv_cache: torch.Tensor) -> bool:
        """Whether the stack was built over this first-layer KV cache [2, ...] (keys first; the
        engine binds the caches after the model is built)."""
        return kv_cache.data_ptr() == self._first_key_cache.data_ptr()

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
            seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the step, as the layers' forwards run it: hidden [T, hidden_size] float32
        (the embedding, or a pipeline stage's input with its residual), overwritten; returns the last
        layer's output and the residual stream before it."""
        tokens = hidden.shape[0]
        has_residual = residual is not None
        if residual is None:
            residual = torch.empty_like(hidden)
        num_reqs = seq_lens.shape[0]
        if not (hidden.dtype == residual.dtype == torch.float32 and hidden.is_contiguous()
                and residual.is_contiguous() and hidden.dim() == 2 and hidden.shape == residual.shape
                and hidden.shape[1] == self._model.hidden and 0 < tokens <= MAX_TOKENS
                and positions.shape == slot_mapping.shape == (tokens,)
                and positions.dtype == slot_mapping.dtype == block_tables.dtype == query_start_loc.dtype
                == seq_lens.dtype == torch.int64 and positions.is_contiguous() and slot_mapping.is_contiguous()
                and query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_tables.dim() == 2
                and block_tables.stride(1) == 1 and block_tables.shape[0] >= num_reqs
                and query_start_loc.shape == (num_reqs + 1,)):
            raise ValueError(
                f"the C layer stack takes float32 contiguous hidden and residual [T <= {MAX_TOKENS}, "
                f"{self._model.hidden}] and contiguous int64 step metadata; got hidden {hidden.dtype} "
                f"{tuple(hidden.shape)}, positions {tuple(positions.shape)}, slot_mapping {tuple(slot_mapping.shape)}, "
                f"block_tables {tuple(block_tables.shape)}, query_start_loc {tuple(query_start_loc.shape)}, "
                f"seq_lens {tuple(seq_lens.shape)}")
        step = _Step(tokens, num_reqs, positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
                     query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.stride(0), hidden.data_ptr(),
                     residual.data_ptr(), has_residual, self._qkv.data_ptr(), self._attn.data_ptr(),
                     self._gate_up.data_ptr(), self._act.data_ptr())
        failed = self._run(self._kernels, self._model, self._structs, len(self._structs), step,
                           torch.get_num_threads(), self._status)
        if failed:
            raise ValueError(f"layer {failed >> 8}: {_OPS.get(failed & 0xFF, 'a kernel')} failed "
                             f"(status {self._status.value})")
        return hidden, residual
