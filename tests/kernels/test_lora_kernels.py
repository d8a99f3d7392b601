"""The LoRA kernels (Triton in kernels/lora.py, C in kernels/cpu/lora.c) against the torch reference:
rows that mix adapters with rows of the base model alone, any rank, odd sizes, and an output that
is a view into a fused projection's columns."""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import DEVICE, assert_close, generator, randn
from kvpilot.kernels import lora as triton_lora
from kvpilot.kernels.cpu import lora as cpu_lora
from kvpilot.kernels.cpu.build import KernelBuildError

SHAPES = [  # tokens, in, out, rank, slots
    (1, 64, 64, 8, 1),
    (7, 40, 72, 12, 3),
    (16, 96, 33, 1, 4),
    (5, 130, 200, 16, 2),
    # A rank that is no multiple of the C kernel's rank block, over an input of 1,000 columns.
    (9, 1000, 70, 6, 3),
]


def cpu_kernel():
    try:
        cpu_lora.build()
    except KernelBuildError as error:
        pytest.skip(f"the C kernels do not build here: {error}")
    return cpu_lora.lora_apply


@pytest.fixture(params=["triton", "cpu"])
def kernel(request):
    return triton_lora.lora_apply if request.param == "triton" else cpu_kernel()


def inputs(tokens, in_features, out_features, rank, num_slots, seed, device):
    gen = generator(seed)
    x = randn(tokens, in_features, gen=gen).to(device)
    lora_a = (0.2 * randn(num_slots, rank, in_features, gen=gen)).to(device)
    lora_b = (0.2 * randn(num_slots, out_features, rank, gen=gen)).to(device)
    # Every slot in turn, then a row of the base model alone (-1).
    cycle = [*range(num_slots), -1]
    slots = torch.tensor([cycle[row % len(cycle)] for row in range(tokens)], dtype=torch.int64, device=device)
    scales = torch.linspace(0.5, 2.0, num_slots, device=device)
    # y is the middle columns of a wider (fused) output, so its rows are strided.
    fused = randn(tokens, out_features + 24, gen=gen).to(device)
    return fused[:, 10:10 + out_features], x, lora_a, lora_b, slots, scales


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_row_adds_its_own_adapter(kernel, shape):
    device = DEVICE if kernel is triton_lora.lora_apply else torch.device("cpu")
    y, *rest = inputs(*shape, seed=sum(shape), device=device)
    expected = triton_lora.lora_apply_reference(y.clone(), *rest)
    before = y.clone()
    assert kernel(y, *rest) is y
    assert_close(y, expected, torch.float32)
    base_rows = rest[-2] < 0
    # The base model's rows are left as they were; the adapters' rows changed.
    assert torch.equal(y[base_rows], before[base_rows])
    assert not torch.allclose(y[~base_rows], before[~base_rows])


def test_bad_inputs_are_errors_that_name_them(kernel):
    device = DEVICE if kernel is triton_lora.lora_apply else torch.device("cpu")
    y, x, lora_a, lora_b, slots, scales = inputs(3, 32, 48, 4, 2, seed=1, device=device)
    with pytest.raises(ValueError, match="as many rows"):
        kernel(y[:2], x, lora_a, lora_b, slots, scales)
    with pytest.raises(ValueError, match="do not fit"):
        kernel(y, x, lora_a, lora_b.transpose(1, 2).contiguous(), slots, scales)
    with pytest.raises(ValueError, match="int64"):
        kernel(y, x, lora_a, lora_b, slots.int(), scales)


def test_the_c_kernel_refuses_a_slot_out_of_range():
    y, x, lora_a, lora_b, slots, scales = inputs(3, 32, 48, 4, 2, seed=2, device=torch.device("cpu"))
    before = y.clone()
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernel()(y, x, lora_a, lora_b, torch.tensor([0, 2, -1]), scales)
    assert torch.equal(y, before)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernel()(y.double(), x.double(), lora_a, lora_b, slots, scales)
