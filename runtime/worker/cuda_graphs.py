"""CUDA graphs for pure-decode steps: one graph per padded decode size, captured at start-up.

A captured graph replays the kernels of one forward pass on the same memory, so a decode step
costs one launch instead of one per kernel. Its inputs are the StepBuffers (the runner writes each
step there) and the KV caches (allocated before capture); its output is the graph's own tensor,
read before the next replay. Only backends that do no host work inside the forward pass can be
captured: the Triton backend (the torch backend plans each step on the host).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from kvpilot.runtime.worker.step_inputs import StepBuffers, StepInputs

logger = logging.getLogger(__name__)


def can_capture(device: torch.device, backend_name: str, enforce_eager: bool, world_size: int) -> bool:
    # Collectives inside a graph (TP's all-reduces, PP's sends) need a graph-safe communicator; not done yet.
    return device.type == "cuda" and backend_name == "triton" and not enforce_eager and world_size == 1


class DecodeGraphs:
    @torch.inference_mode()
    def __init__(self, model: nn.Module, buffers: StepBuffers, sizes: list[int], max_model_len: int) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        device = buffers.device
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the largest one made.
        for size in reversed(sizes):
            input_ids, positions, metadata = buffers.load(StepInputs.padding_only(), padded_reqs=size,
                                                          full_block_tables=True)
            # The launch is sized for the longest context any replay may see.
            metadata = dataclasses.replace(metadata, max_seq_len=max_model_len)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                # Warm-up off the capture: Triton compiles, the allocator settles.
                model(input_ids, positions, metadata)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model(input_ids, positions, metadata)
            pool = graph.pool()
            self.graphs[size] = graph
        logger.info("captured CUDA graphs for decode batch sizes %s", sizes)

    def replay(self, size: int) -> torch.Tensor:
        """The hidden states of the step just written into the buffers, padded to `size` rows."""
        self.graphs[size].replay()
        return self.outputs[size]
