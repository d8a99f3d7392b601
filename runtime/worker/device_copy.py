"""Host values onto the model's device without waiting for the work queued there.

A copy from pageable memory (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`) first waits
for every kernel already queued on the stream: mid-step, for the whole forward pass the host
could otherwise run ahead of. Staged in pinned memory, the copy is queued behind that work
instead, and the caching host allocator keeps the pinned block until the copy is done.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a numpy array, a list of numbers or a host tensor) as a tensor on `device`."""
    host = torch.as_tensor(np.ascontiguousarray(values) if isinstance(values, np.ndarray) else values, dtype=dtype)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
