"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

With a residual: `residual = x + residual` (stored back, in the residual's dtype), and the norm
of that sum is returned. The sum, the mean square and the scaling are fp32 throughout; only the
stores round to the tensors' dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Elements one program normalises: one row of a real model, many rows of a tiny one.
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, eps, num_rows, stride_o, stride_x, stride_r,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (offs < HIDDEN)
    x = tl.load(x_ptr + rows * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + rows * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_ptr + rows * stride_r + offs, x.to(residual_ptr.dtype.element_ty), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HIDDEN + eps)[:, None]
    weight = tl.load(weight_ptr + offs, mask=offs < HIDDEN, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_o + offs, (x * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x, residual: [T, hidden]; residual is updated in place. Returns the normed [T, hidden]."""
    hidden = x.shape[-1]
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs the hidden dimension contiguous")
    out = torch.empty_like(x)
    num_rows, block = x.shape[0], triton.next_power_of_2(hidden)
    rows = min(triton.next_power_of_2(max(1, num_rows)), max(1, _ELEMENTS_PER_PROGRAM // block))
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        out, x, x if residual is None else residual, weight, eps, num_rows,
        out.stride(0), x.stride(0), 0 if residual is None else residual.stride(0),
        HIDDEN=hidden, BLOCK=block, ROWS=rows, HAS_RESIDUAL=residual is not None,
    )
    return out


def rms_norm_reference(x, weight, eps, residual=None):
    total = x.float()
    if residual is not None:
        total = total + residual.float()
        residual.copy_(total)
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
