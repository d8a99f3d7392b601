"""Tensor and pipeline parallelism over two hosts: host 0's engine with the first half of the
ranks, and `kvpilot serve --headless` with the second, joined through host 0's --master-addr and
--master-port, and the calls relayed by rank 0 (runtime/worker/hosts.py). Here the second host is
a second process on this one, or in a network namespace of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.benchmarks import netns
from kvpilot.runtime.config import ParallelConfig
from kvpilot.runtime.worker import hosts

pytestmark = pytest.mark.timeout(300)
KVPILOT = Path(sys.executable).with_name("kvpilot")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def headless(model_dir: Path, port: int, tensor: int = 2, pipeline: int = 1) -> subprocess.Popen:
    return subprocess.Popen([str(KVPILOT), "serve", str(model_dir), "--headless", "--nnodes", "2", "--node-rank", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--tensor-parallel-size", str(tensor), "--pipeline-parallel-size", str(pipeline)],
                            stderr=subprocess.PIPE, text=True)


def test_each_host_runs_its_consecutive_ranks() -> None:
    layout = {"tensor_parallel_size": 4, "nnodes": 2}
    assert hosts.host_ranks(ParallelConfig(**layout)) == range(0, 2)
    assert hosts.host_ranks(ParallelConfig(**layout, node_rank=1, headless=True)) == range(2, 4)
    # A stage per host: the tensor-parallel all-reduces stay on it, the stream crosses between them.
    stages = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "nnodes": 2}
    assert hosts.host_ranks(ParallelConfig(**stages, node_rank=1, headless=True)) == range(2, 4)
    assert hosts.output_rank(ParallelConfig(**stages)) == 2
    assert hosts.init_method(ParallelConfig(**layout, master_addr="10.0.0.7", master_port=29600), "") \
        == "tcp://10.0.0.7:29600"
    assert hosts.init_method(ParallelConfig(**layout, master_addr="fd00::7"), "") == "tcp://[fd00::7]:29500"


@pytest.mark.parametrize("tensor, pipeline", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_two_hosts_match_transformers_and_the_second_stops_with_the_first(tiny_llama_dir: Path, tensor: int,
                                                                          pipeline: int) -> None:
    port = free_port()
    second = headless(tiny_llama_dir, port, tensor, pipeline)
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, nnodes=2,
                  master_port=port, block_size=8, max_num_batched_tokens=64)
        oracle = HFOracle(str(tiny_llama_dir))
        prompts = random_prompts([1, 9, 70], llm.config.model.vocab_size, seed=5)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        for prompt, output in zip(prompts, llm.generate(prompts, params)):
            assert output.outputs[0].token_ids == oracle.greedy(prompt)[0]
        llm.engine.shutdown()
        assert second.wait(timeout=30) == 0, second.stderr.read()
    finally:
        second.kill()


@pytest.mark.parametrize("tensor, pipeline", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_host_that_dies_fails_the_engine_naming_it(tiny_llama_dir: Path, tensor: int, pipeline: int) -> None:
    port = free_port()
    second = headless(tiny_llama_dir, port, tensor, pipeline)
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, nnodes=2,
                  master_port=port, distributed_timeout=20)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        second.kill()  # its worker dies with it
        second.wait()
        with pytest.raises(RuntimeError, match="TP worker 1 failed|lost a rank on another host"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    finally:
        second.kill()


def test_a_headless_host_told_to_stop_serves_until_host_0_stops(tiny_llama_dir: Path) -> None:
    """Kubernetes sends SIGTERM to every pod of a group at once; the leader drains its requests
    meanwhile, which needs the other hosts' ranks."""
    port = free_port()
    second = headless(tiny_llama_dir, port)
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, master_port=port, distributed_timeout=20)
        second.send_signal(signal.SIGTERM)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert len(llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids) == 8
        llm.engine.shutdown()
        assert second.wait(timeout=30) == 0, second.stderr.read()
    finally:
        second.kill()


def test_a_host_that_never_joins_fails_the_start_within_the_timeout(tiny_llama_dir: Path) -> None:
    with pytest.raises(RuntimeError, match=r"TP worker 0 failed: RuntimeError: rank 0 could not join the 2 ranks at tcp://127.0.0.1:\d+ "
                                           r"within 3 s \(--distributed-timeout\)"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=2, nnodes=2, master_port=free_port(), distributed_timeout=3)


@pytest.fixture
def second_host():
    """Another host, with its own address, as far as the ranks can tell."""
    if (reason := netns.unavailable()) is not None:
        pytest.skip(reason)
    with netns.two_hosts() as hosts:
        yield hosts


@pytest.mark.parametrize("tensor, pipeline", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_hosts_on_their_own_addresses(tiny_llama_dir: Path, second_host, monkeypatch, tensor: int,
                                          pipeline: int) -> None:
    address, ours, namespace, theirs = second_host.address, second_host.interface, second_host.namespace, \
        second_host.their_interface
    port = free_port()
    # Gloo listens on the address the host name resolves to, unless told which interface: in a
    # pod that is the pod's own address; here each side names its end of the veth pair.
    second = subprocess.Popen(
        ["ip", "netns", "exec", namespace, str(KVPILOT), "serve", str(tiny_llama_dir), "--headless", "--nnodes", "2",
         "--node-rank", "1", "--master-addr", address, "--master-port", str(port),
         "--tensor-parallel-size", str(tensor), "--pipeline-parallel-size", str(pipeline)],
        env={**os.environ, "GLOO_SOCKET_IFNAME": theirs}, stderr=subprocess.PIPE, text=True)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ours)
    try:
        llm = LLM(str(tiny_llama_dir), tensor_parallel_size=tensor, pipeline_parallel_size=pipeline, nnodes=2,
                  master_addr=address, master_port=port, distributed_timeout=30)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompt = [[4, 5, 6, 7]]
        across = llm.generate(prompt, params)[0].outputs[0].token_ids
        llm.engine.shutdown()
        assert second.wait(timeout=30) == 0, second.stderr.read()
        assert across == LLM(str(tiny_llama_dir)).generate(prompt, params)[0].outputs[0].token_ids
    finally:
        second.kill()
