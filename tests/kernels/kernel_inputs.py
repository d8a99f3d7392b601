"""Random inputs for the kernel tests, on the device the kernels run on in this session."""

from __future__ import annotations

import os

import torch

# Compiled kernels on CUDA when the interpreter is off; otherwise the interpreter on host tensors.
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
