"""Where the ranks of one engine run, and how their calls reach them when they span hosts.

Ranks are numbered across hosts: host k of --nnodes N runs the ranks [k * W/N, (k + 1) * W/N) of
the W = tensor_parallel_size * pipeline_parallel_size ranks, so that a host holds consecutive
ranks (whole pipeline stages where it can: runtime/distributed). They join one
torch.distributed group: through a file on one host, through host 0's --master-addr and
--master-port (torch's TCP store) across hosts.

On one host the executor has a pipe to every rank. Across hosts it has a pipe to rank 0 alone,
which relays: it broadcasts each call to the other ranks over a gloo group of its own (the
control group: gloo on CPUs and GPUs alike, next to NCCL's data group on GPUs), runs it, and
gathers their replies on a thread, handing the executor all of them while it runs the next call
(pipeline stages on other hosts may still be running this one). Calls and replies travel as msgpack bytes in
uint8 tensors, as over the pipes: nothing is pickled.

A host that goes away (its process killed, its network cut) fails the next collective that
needs it, on every other rank: rank 0 says which call failed, the executor fails the engine, and
the ranks left exit. A rank waits for the others at most --distributed-timeout: to join at start,
within a step, and for their replies; only the wait for the next call lasts as long as the
engine stays idle.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from kvpilot.runtime.config import ParallelConfig

# The control group's wait between calls: an idle engine sends none for as long as it is idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def host_ranks(parallel: ParallelConfig) -> range:
    """The global ranks this host runs."""
    per_host = parallel.world_size // parallel.nnodes
    return range(parallel.node_rank * per_host, (parallel.node_rank + 1) * per_host)


def output_rank(parallel: ParallelConfig) -> int:
    """The rank whose reply is the step's result: the last pipeline stage's first, which samples."""
    return parallel.world_size - parallel.tensor_parallel_size


def init_method(parallel: ParallelConfig, rendezvous_dir: str) -> str:
    if parallel.nnodes == 1:
        return f"file://{rendezvous_dir}/init"
    host = f"[{parallel.master_addr}]" if ":" in parallel.master_addr else parallel.master_addr
    return f"tcp://{host}:{parallel.master_port}"


class ControlGroup:
    """Rank 0's calls to every rank, and their replies to it."""

    def __init__(self, timeout_s: float) -> None:
        # Every rank makes both groups, in the same order (torch.distributed's rule for new_group).
        # Calls and replies each have their own: rank 0 gathers a call's replies on a thread while
        # it broadcasts the next call.
        self._calls = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self._replies = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()

    def broadcast(self, data: bytes = b"") -> bytes:
        """Rank 0's `data`, on every rank (the others' `data` is ignored)."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self._calls)
        buffer = _tensor(data) if self._rank == 0 else torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self._calls)
        return data if self._rank == 0 else buffer.numpy().tobytes()

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's `data` in rank order, on rank 0; an empty list elsewhere."""
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=self._replies)
        longest = max(int(length) for length in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = _tensor(data)
        buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._world_size)] if self._rank == 0 else None
        dist.gather(padded, buffers, dst=0, group=self._replies)
        if buffers is None:
            return []
        return [buffer[:int(length)].numpy().tobytes() for buffer, length in zip(buffers, lengths, strict=True)]


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
