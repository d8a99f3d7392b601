"""The C LoRA kernel (lora.c) behind the signature of kernels/lora.py's `lora_apply`."""

from __future__ import annotations

import ctypes
import functools

import torch

from kvpilot.kernels.cpu.build import load
from kvpilot.kernels.lora import check_lora_inputs

_ERRORS = {1: "a row names an adapter slot out of range", 2: "out of memory"}


@functools.cache
def _kernel():
    function = load("lora").lora_apply_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def build() -> None:
    """Compiles (or finds in the cache) and loads the kernel now; raises KernelBuildError."""
    _kernel()


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Adds each row's adapter product into y (in place) and returns y: float32 CPU tensors."""
    check_lora_inputs(y, x, lora_a, lora_b, slots, scales)
    tensors = (y, x, lora_a, lora_b, scales)
    if any(t.dtype != torch.float32 or not t.is_cpu for t in tensors) or not slots.is_cpu:
        raise ValueError("the CPU LoRA kernel takes float32 CPU tensors: "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    # Held in names: a temporary's memory would be freed before the call reads it.
    slots, scales = slots.contiguous(), scales.contiguous()
    num_slots, rank, in_features = lora_a.shape
    status = _kernel()(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
                       slots.data_ptr(), scales.data_ptr(), x.shape[0], in_features, y.shape[1], rank, num_slots,
                       torch.get_num_threads())
    if status:
        raise RuntimeError(f"LoRA kernel: {_ERRORS.get(status, f'error {status}')}")
    return y
