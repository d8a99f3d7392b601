"""RMSNorm (alone and fused with the residual add) against its torch reference and the model's layer."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import assert_close, generator, randn
from kvpilot.kernels.rms_norm import rms_norm, rms_norm_reference
from kvpilot.runtime.layers.norm import RMSNorm


# The interpreter rounds fp32 -> bf16 toward zero (compiled Triton rounds to nearest), so a bf16
# result may sit one ulp off the reference: values are kept below 4, where that ulp is under the
# 2e-2 tolerance.
def norm_weight(hidden: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (0.5 + 0.05 * randn(hidden, gen=gen)).to(dtype)


def activations(hidden: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (0.5 * randn(7, hidden, gen=gen)).to(dtype)


@pytest.mark.parametrize("hidden", [64, 96, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_residual_add(hidden, dtype):
    gen = generator(hidden)
    x, residual = activations(hidden, gen, dtype), activations(hidden, gen, dtype)
    weight = norm_weight(hidden, gen, dtype)
    expected_sum = (x.float() + residual.float()).to(dtype)
    expected_residual = residual.clone()
    expected = rms_norm_reference(x, weight, 1e-5, expected_residual)
    out = rms_norm(x, weight, 1e-5, residual)
    assert_close(out, expected, dtype)
    # The residual is updated in place to the sum, rounded once from fp32.
    assert_close(residual, expected_sum, dtype)
    assert torch.equal(expected_residual, expected_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_residual(dtype):
    gen = generator(0)
    x = activations(64, gen, dtype)
    weight = norm_weight(64, gen, dtype)
    assert_close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), dtype)


def test_reference_matches_the_model_layer():
    gen = generator(1)
    x = activations(64, gen, torch.float32)
    layer = RMSNorm(64, 1e-6, torch.float32).to(x.device)
    layer.weight.data.copy_(norm_weight(64, gen, torch.float32))
    assert_close(rms_norm_reference(x, layer.weight, 1e-6), layer(x), torch.float32)
