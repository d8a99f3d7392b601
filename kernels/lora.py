"""LoRA for a batch that mixes adapters: each row adds its own adapter's low-rank product, or none.

For row t with adapter slot s = slots[t] (-1: the base model alone):

    y[t] += scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T

lora_a: [slots, rank, in], lora_b: [slots, out, rank], in the layout the adapter slots keep on the
device (an adapter of a lower rank is zero-padded to the slots' rank: the padding adds nothing).
One gathered product per layer for the whole batch, as punica's BGMV does, never a pass per
adapter: a `shrink` to the rank (x @ A.T, scaled) and an `expand` back to the output (@ B.T).

The Triton kernels here are checked under the interpreter (tests/kernels); their speed on a GPU
is not measured yet. The CPU runs the C kernel in kernels/cpu/lora.c.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_IN = 64
_BLOCK_OUT = 64


@triton.jit
def _shrink_kernel(v_ptr, x_ptr, a_ptr, slots_ptr, scales_ptr, stride_x, IN: tl.constexpr, RANK: tl.constexpr,
                   BLOCK_RANK: tl.constexpr, BLOCK_IN: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    active = slot >= 0
    slot = tl.maximum(slot, 0)
    ranks = tl.arange(0, BLOCK_RANK)[:, None]
    acc = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
    for start in range(0, IN, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)[None, :]
        x = tl.load(x_ptr + token * stride_x + cols, mask=active & (cols < IN), other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (slot * RANK + ranks) * IN + cols, mask=active & (ranks < RANK) & (cols < IN),
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x, axis=1)
    scale = tl.load(scales_ptr + slot).to(tl.float32)
    ranks_1d = tl.arange(0, BLOCK_RANK)
    tl.store(v_ptr + token * RANK + ranks_1d, acc * scale, mask=ranks_1d < RANK)


@triton.jit
def _expand_kernel(y_ptr, v_ptr, b_ptr, slots_ptr, stride_y, OUT: tl.constexpr, RANK: tl.constexpr,
                   BLOCK_RANK: tl.constexpr, BLOCK_OUT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slot = tl.load(slots_ptr + token)
    active = slot >= 0
    slot = tl.maximum(slot, 0)
    ranks = tl.arange(0, BLOCK_RANK)
    v = tl.load(v_ptr + token * RANK + ranks, mask=active & (ranks < RANK), other=0.0)
    b = tl.load(b_ptr + (slot * OUT + outs[:, None]) * RANK + ranks[None, :],
                mask=active & (outs[:, None] < OUT) & (ranks[None, :] < RANK), other=0.0).to(tl.float32)
    mask = active & (outs < OUT)
    y = tl.load(y_ptr + token * stride_y + outs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * stride_y + outs, (y + tl.sum(b * v[None, :], axis=1)).to(y_ptr.dtype.element_ty),
             mask=mask)


def check_lora_inputs(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      slots: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError naming what does not fit: shapes, dtypes, contiguity. The slots' values are not
    read here (that would wait on the device at every layer): the engine assigns them, and the C
    kernel checks them itself."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x [T, in] and y [T, out] must have as many rows: {tuple(x.shape)} and {tuple(y.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(f"lora_a must be [slots, rank, in] and lora_b [slots, out, rank]: "
                         f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    num_slots, rank, in_features = lora_a.shape
    if tuple(lora_b.shape) != (num_slots, y.shape[1], rank) or in_features != x.shape[1]:
        raise ValueError(f"adapter slots {tuple(lora_a.shape)} and {tuple(lora_b.shape)} do not fit "
                         f"x {tuple(x.shape)} and y {tuple(y.shape)}")
    if slots.shape != (x.shape[0],) or slots.dtype != torch.int64 or scales.shape != (num_slots,):
        raise ValueError(f"slots must be int64 [T] and scales [slots]: {slots.dtype} {tuple(slots.shape)}, "
                         f"{tuple(scales.shape)}")
    if not (lora_a.is_contiguous() and lora_b.is_contiguous() and x.stride(-1) == 1 and y.stride(-1) == 1):
        raise ValueError("lora_a and lora_b must be contiguous, and x and y contiguous along their rows")


def lora_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Adds each row's adapter product into y (in place) and returns y."""
    check_lora_inputs(y, x, lora_a, lora_b, slots, scales)
    tokens, (num_slots, rank, in_features), out_features = x.shape[0], lora_a.shape, y.shape[1]
    if tokens == 0 or num_slots == 0:
        return y
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    block_rank = triton.next_power_of_2(rank)
    _shrink_kernel[(tokens,)](shrunk, x, lora_a, slots, scales, x.stride(0), IN=in_features, RANK=rank,
                              BLOCK_RANK=block_rank, BLOCK_IN=_BLOCK_IN)
    _expand_kernel[(tokens, triton.cdiv(out_features, _BLOCK_OUT))](
        y, shrunk, lora_b, slots, y.stride(0), OUT=out_features, RANK=rank, BLOCK_RANK=block_rank,
        BLOCK_OUT=_BLOCK_OUT)
    return y


def lora_apply_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                         slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """lora_apply, one row at a time in torch."""
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            shrunk = (x[row].float() @ lora_a[slot].float().T) * scales[slot].float()
            y[row] = (y[row].float() + shrunk @ lora_b[slot].float().T).to(y.dtype)
    return y
