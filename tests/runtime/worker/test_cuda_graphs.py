"""Decode-graph capture discipline, checked against a stand-in for torch.cuda (no GPU here).

What a capture needs and a CPU run cannot show: a warm-up of the same step off the capture (the
kernels compile, lazily made tensors are made), one memory pool shared by every graph, the
longest context sizing the launch, and inputs that are the persistent step buffers, so that a
later step's `load` writes where the graph reads.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from kvpilot.runtime.worker import cuda_graphs
from kvpilot.runtime.worker.cuda_graphs import DecodeGraphs, can_capture
from kvpilot.runtime.worker.step_inputs import StepBuffers, StepInputs, decode_sizes

MAX_MODEL_LEN = 64


class _FakeCuda:
    """The torch.cuda calls DecodeGraphs makes: streams, stream switches and graph capture."""

    def __init__(self) -> None:
        self.default = SimpleNamespace(name="default", wait_stream=lambda other: None)
        self.current = self.default
        self.capturing = None
        self.captures: list[tuple[_FakeGraph, object]] = []

    def Stream(self, device):  # noqa: N802 - torch's name
        return SimpleNamespace(name="side", wait_stream=lambda other: None)

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        yield
        self.current = previous

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        self.captures.append((graph, pool))
        self.capturing = graph
        yield
        self.capturing = None


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0
        self.pool_handle = object()

    def pool(self):
        return self.pool_handle

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCuda()
    for name in ("Stream", "current_stream", "stream", "graph"):
        monkeypatch.setattr(cuda_graphs.torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(cuda_graphs.torch.cuda, "CUDAGraph", _FakeGraph)
    return fake


def test_every_decode_size_is_warmed_up_then_captured_into_one_pool(fake_cuda):
    sizes = decode_sizes(max_num_seqs=20)
    buffers = StepBuffers(max_num_tokens=32, max_num_reqs=20, max_blocks_per_req=MAX_MODEL_LEN // 4,
                          device=torch.device("cpu"))
    calls = []

    def model(input_ids, positions, metadata):
        calls.append(SimpleNamespace(size=input_ids.shape[0], graph=fake_cuda.capturing, stream=fake_cuda.current.name,
                                     input_ids=input_ids.data_ptr(), block_tables=metadata.block_tables.shape,
                                     max_seq_len=metadata.max_seq_len))
        return torch.zeros(input_ids.shape[0], 2)

    graphs = DecodeGraphs(model, buffers, sizes, MAX_MODEL_LEN)

    captured = [call for call in calls if call.graph is not None]
    warm_ups = [call for call in calls if call.graph is None]
    # Largest first, so that the smaller graphs fit in the pool the largest one left.
    assert [call.size for call in captured] == sorted(sizes, reverse=True)
    assert [call.size for call in warm_ups] == [call.size for call in captured]
    assert calls[::2] == warm_ups  # each size's warm-up comes right before its capture
    assert {call.stream for call in warm_ups} == {"side"}
    pools = [pool for _, pool in fake_cuda.captures]
    assert pools[0] is None and pools[1:] == [graph.pool_handle for graph, _ in fake_cuda.captures[:-1]]
    for call in captured:
        assert call.input_ids == buffers.device_tensors["input_ids"].data_ptr()
        assert call.block_tables == (call.size, MAX_MODEL_LEN // 4)  # every column: no step's width is baked in
        assert call.max_seq_len == MAX_MODEL_LEN

    graph_of = {call.size: graph for call, (graph, _) in zip(captured, fake_cuda.captures)}
    out = graphs.replay(8)
    assert graph_of[8].replays == 1 and out is graphs.outputs[8] and out.shape[0] == 8


def test_every_decode_batch_pads_to_a_captured_size():
    sizes = decode_sizes(max_num_seqs=20)
    for num_reqs in range(1, 21):
        step = SimpleNamespace(max_query_len=1, req_ids=[str(i) for i in range(num_reqs)])
        padded = StepInputs.decode_size(step, sizes)
        assert padded in sizes and padded >= num_reqs


def test_only_the_triton_backend_on_cuda_is_captured():
    cuda = torch.device("cuda")
    assert can_capture(cuda, "triton", enforce_eager=False, world_size=1)
    assert not can_capture(cuda, "triton", enforce_eager=True, world_size=1)
    assert not can_capture(cuda, "torch", enforce_eager=False, world_size=1)
    assert not can_capture(cuda, "triton", enforce_eager=False, world_size=2)
    assert not can_capture(torch.device("cpu"), "triton", enforce_eager=False, world_size=1)
