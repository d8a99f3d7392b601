"""x @ W^T with W packed in GGML's 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or per-row int8,
dequantized block by block inside the kernel: the GPU counterpart of kernels/cpu/quant_matmul.c.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output, one 32-column block of weights at a
time: the block's bytes are decoded into float32 and multiplied in float32 (`ieee` precision, no
TF32), so the reference is `reference_matmul` in kernels/cpu/quant_matmul.py, as for the C kernel.
The K-quants (256-weight blocks with packed sub-block scales) are not implemented here yet.
Tested under the Triton interpreter only; no speed is claimed until a GPU run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.cpu.quant_formats import GGML_FORMATS, INT8
from kvpilot.kernels.cpu.quant_matmul import PackedWeight

# How each type's 32-weight block decodes: (layout, has a min, has fifth bits).
_NIBBLES, _BYTES, _ROW_SCALED = 0, 1, 2
TYPES = {"Q4_0": (_NIBBLES, False, False), "Q4_1": (_NIBBLES, True, False), "Q5_0": (_NIBBLES, False, True),
         "Q5_1": (_NIBBLES, True, True), "Q8_0": (_BYTES, False, False), INT8: (_ROW_SCALED, False, False)}
_BLOCK_M, _BLOCK_N = 16, 32


@triton.jit
def _half(pointers):
    """The little-endian fp16 at each pointer, as float32."""
    low = tl.load(pointers).to(tl.uint16)
    high = tl.load(pointers + 1).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_matmul_kernel(
    out_ptr, x_ptr, w_ptr, scales_ptr, M, N, K, stride_xm, stride_om, stride_wn,
    LAYOUT: tl.constexpr, HAS_MIN: tl.constexpr, FIVE_BITS: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    # Rows past N read row N - 1 (a valid address) and are never stored.
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 32)):
        k = kb * 32 + j
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        if LAYOUT == 2:  # int8, one scale per row
            q = tl.load(w_ptr + rows + k[None, :], mask=k[None, :] < K, other=0).to(tl.int8, bitcast=True)
            scale = tl.load(scales_ptr + tl.minimum(rn, N - 1))[:, None]
            w = scale * q.to(tl.float32)
        else:
            block = w_ptr + rows + kb * BLOCK_BYTES
            d = _half(block)
            if LAYOUT == 1:  # Q8_0: d, then 32 int8
                w = d * tl.load(block + 2 + j[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
            else:
                # Weight j is a nibble of byte j % 16 (low for j < 16); Q5 adds bit j of 4 bytes qh.
                quants = 2 + 2 * HAS_MIN + 4 * FIVE_BITS
                q = (tl.load(block + quants + (j % 16)[None, :]) >> ((j // 16) * 4)[None, :]) & 15
                if FIVE_BITS:
                    bits = tl.load(block + 2 + 2 * HAS_MIN + (j // 8)[None, :])
                    q = q | (((bits >> (j % 8)[None, :]) & 1) << 4)
                if HAS_MIN:
                    w = d * q.to(tl.float32) + _half(block + 2)
                else:
                    w = d * (q.to(tl.int32) - (8 + 8 * FIVE_BITS)).to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def dequant_matmul(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x float32 [M, cols] (contiguous rows) -> float32 [M, rows] on x's device."""
    if weight.qtype not in TYPES:
        raise ValueError(f"the Triton dequantize-matmul takes {', '.join(TYPES)}, not {weight.qtype}")
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == weight.cols and x.stride(1) == 1):
        raise ValueError(f"dequant_matmul takes x float32 [M, {weight.cols}] with contiguous rows, got "
                         f"{x.dtype} {list(x.shape)}")
    m, n = x.shape[0], weight.rows
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    if weight.cols == 0:
        return out.zero_()
    data = weight.data.to(x.device)
    scales = data if weight.scales is None else weight.scales.to(x.device)
    block_bytes = 32 if weight.qtype == INT8 else GGML_FORMATS[weight.qtype].block_bytes
    grid = (triton.cdiv(m, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    _dequant_matmul_kernel[grid](out, x, data, scales, m, n, weight.cols, x.stride(0), out.stride(0), data.stride(0),
                                 *TYPES[weight.qtype], BLOCK_BYTES=block_bytes, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N)
    return out
