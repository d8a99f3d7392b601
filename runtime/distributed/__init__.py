"""The groups of ranks as the layers see them: the tensor-parallel group of this rank's pipeline stage,
and the stages before and after it.

Global rank r is tensor-parallel rank r % T of stage r // T (T = tensor_parallel_size): a stage's
ranks are consecutive, so a host holds whole stages where it can, and the all-reduces stay on it.
Until `torch.distributed` is initialised the groups are this process alone: rank 0 of 1, and the
collectives are identities. The worker processes initialise them (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# This rank's tensor-parallel group; None is the default group (every rank: one stage).
_tp_group: dist.ProcessGroup | None = None
_tp_size = 1


def init_model_parallel(tensor_parallel_size: int) -> None:
    """Splits the initialised default group into stages of `tensor_parallel_size` ranks."""
    global _tp_group, _tp_size
    _tp_size = tensor_parallel_size
    world_size = dist.get_world_size()
    if world_size == tensor_parallel_size:
        _tp_group = None
        return
    # Every rank creates every stage's group, in the same order (torch.distributed's rule).
    for first in range(0, world_size, tensor_parallel_size):
        group = dist.new_group(list(range(first, first + tensor_parallel_size)))
        if first <= dist.get_rank() < first + tensor_parallel_size:
            _tp_group = group


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The decoder layers of pipeline stage `stage`: consecutive, and as even as the count allows
    (the first num_layers % num_stages stages take one more)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def tp_rank() -> int:
    return dist.get_rank() % _tp_size if dist.is_initialized() else 0


def tp_size() -> int:
    return _tp_size if dist.is_initialized() else 1


def pp_rank() -> int:
    return dist.get_rank() // _tp_size if dist.is_initialized() else 0


def pp_size() -> int:
    return dist.get_world_size() // _tp_size if dist.is_initialized() else 1


def is_first_stage() -> bool:
    return pp_rank() == 0


def is_last_stage() -> bool:
    return pp_rank() == pp_size() - 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension, in rank order."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor) -> None:
    """To the rank of the same tensor-parallel index in the next stage."""
    dist.send(x.contiguous(), dist.get_rank() + _tp_size)


def receive_from_previous_stage(x: torch.Tensor) -> torch.Tensor:
    """Fills `x` (its shape and dtype agreed beforehand) from the previous stage's rank."""
    dist.recv(x, dist.get_rank() - _tp_size)
    return x

