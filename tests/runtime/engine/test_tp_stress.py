"""Tensor (and pipeline) parallelism under preemption, run again and again with ranks that hash
strings differently.

Every rank keeps its own persistent batch, and the all-reduces are only right if all ranks put
each request in the same row. A rank whose layout depends on anything but the SchedulerOutputs
(a set's iteration order, which follows the process's string-hash seed, was the bug here) gives
wrong tokens only now and then, so one run proves nothing: each workload runs in several fresh
engines, whose workers are started with different PYTHONHASHSEED values on purpose, and every
output is compared with transformers and with one process (TP 1). The executor also compares
the ranks' batch fingerprints after every step, so a diverging layout fails even a run whose
tokens happen to come out right.
"""

from __future__ import annotations

import itertools
import multiprocessing.context
import random

import msgspec
import pytest

from hf_oracle import HFOracle
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.core.sched.output import NewRequestData, SchedulerOutput
from kvpilot.runtime.tiny_model import make_tiny_model

# On the code before the fix, each parametrization below failed within its first two runs (the
# issue's reproduction alone failed 2 runs in 6 with each process's random hash seed); the
# fingerprint check fails a diverging layout even in a run whose tokens come out right.
RUNS_PER_WORKLOAD = 3
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture
def distinct_rank_hash_seeds(monkeypatch):
    """Each spawned worker process gets its own PYTHONHASHSEED, so string hashing differs per rank."""
    seeds = itertools.count(1)
    start = multiprocessing.context.SpawnProcess.start

    def start_with_own_seed(process):
        monkeypatch.setenv("PYTHONHASHSEED", str(next(seeds)))
        try:
            start(process)
        finally:
            monkeypatch.delenv("PYTHONHASHSEED")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start_with_own_seed)


def _random_prompts(lengths: list[int], vocab_size: int, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


class Workload(msgspec.Struct):
    engine_args: dict
    prompts: list[list[int]]
    priorities: list[int] | None = None


@pytest.fixture(scope="module")
def preemption_workload(tmp_path_factory) -> tuple[str, Workload, list[list[int]]]:
    """The issue's reproduction: a qwen2 under a 30-block pool, priority policy, many preemptions;
    with its expected tokens."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("stress-qwen2"), arch="qwen2", seed=11, num_layers=3,
                                hidden_size=96, num_heads=4, num_kv_heads=2)
    workload = Workload(
        engine_args=dict(block_size=8, max_num_batched_tokens=24, max_num_seqs=4, num_gpu_blocks_override=30,
                         scheduling_policy="priority"),
        prompts=_random_prompts([1, 3, 8, 9, 17, 31, 64, 100, 150], 512, seed=0),
        priorities=[2, 2, 2, 2, 0, 0, 1, 1, 0],
    )
    return str(model_dir), workload, _expected(str(model_dir), workload)


@pytest.fixture(scope="module")
def shared_prefix_workload(tmp_path_factory) -> tuple[str, Workload, list[list[int]]]:
    """A llama with 4 query heads per KV head (24 / 6, so TP 2 and TP 3 both divide it), chunked
    prefill, prefix caching over a shared prefix, and a pool small enough to preempt; with its
    expected tokens."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("stress-llama-gqa4"), arch="llama", seed=5, num_layers=2,
                                hidden_size=192, num_heads=24, num_kv_heads=6)
    prefix = _random_prompts([40], 512, seed=7)[0]
    workload = Workload(
        engine_args=dict(block_size=8, max_num_batched_tokens=32, max_num_seqs=5, num_gpu_blocks_override=40,
                         long_prefill_token_threshold=16, enable_prefix_caching=True),
        prompts=_random_prompts([2, 9, 30, 57, 90, 5, 120, 16], 512, seed=8, prefix=prefix),
    )
    return str(model_dir), workload, _expected(str(model_dir), workload)


def _generate(model_dir: str, workload: Workload, tensor_parallel_size: int = 1, **engine_args):
    llm = LLM(model_dir, tensor_parallel_size=tensor_parallel_size, **workload.engine_args, **engine_args)
    try:
        outputs = llm.generate(workload.prompts, GREEDY, priority=workload.priorities)
        return [o.outputs[0].token_ids for o in outputs], llm.get_stats()
    finally:
        llm.engine.shutdown()


def _expected(model_dir: str, workload: Workload) -> list[list[int]]:
    """transformers' greedy tokens, which one process (TP 1) must give too: worked out once per
    workload, and shared by the module's tests of it."""
    oracle = HFOracle(model_dir)
    expected = [oracle.greedy(prompt)[0][:MAX_TOKENS] for prompt in workload.prompts]
    single, _ = _generate(model_dir, workload, tensor_parallel_size=1)
    assert single == expected, "TP 1 itself diverges from transformers"
    return expected


@pytest.mark.parametrize("workload_name, tensor_parallel_size", [
    ("preemption_workload", 2),
    ("shared_prefix_workload", 2),
    ("shared_prefix_workload", 3),
])
def test_tensor_parallel_is_exact_run_after_run(request, distinct_rank_hash_seeds, workload_name,
                                                tensor_parallel_size):
    model_dir, workload, expected = request.getfixturevalue(workload_name)
    for run in range(RUNS_PER_WORKLOAD):
        tokens, stats = _generate(model_dir, workload, tensor_parallel_size)
        assert stats.num_preemptions > 0, "the workload must preempt to test recompute under TP"
        wrong = [i for i, (got, want) in enumerate(zip(tokens, expected)) if got != want]
        assert not wrong, f"run {run}: requests {wrong} diverged at TP {tensor_parallel_size}"


def test_tensor_parallel_with_async_scheduling_is_exact(preemption_workload, distinct_rank_hash_seeds):
    """Async scheduling changes when the ranks get each step, never what they get: the layout
    check runs on every step, and the tokens are transformers' under preemption."""
    model_dir, workload, expected = preemption_workload
    for run in range(2):
        tokens, stats = _generate(model_dir, workload, 2, async_scheduling=True)
        assert stats.num_preemptions > 0
        wrong = [i for i, (got, want) in enumerate(zip(tokens, expected)) if got != want]
        assert not wrong, f"run {run}: requests {wrong} diverged at TP 2 with async scheduling"


@pytest.mark.parametrize("layout, stages", [
    ({"pipeline_parallel_size": 2, "async_scheduling": False}, "PP 2"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "async_scheduling": True},
     "TP 2 x PP 2 with async scheduling"),
])
def test_pipeline_parallel_under_preemption_is_exact(preemption_workload, distinct_rank_hash_seeds, layout, stages):
    """Every stage applies the same SchedulerOutputs, preemptions and recomputes included; the last
    stage's tokens reach the first stage's batch before the next step (async: scheduled before)."""
    model_dir, workload, expected = preemption_workload
    tokens, stats = _generate(model_dir, workload, **layout)
    assert stats.num_preemptions > 0
    wrong = [i for i, (got, want) in enumerate(zip(tokens, expected)) if got != want]
    assert not wrong, f"requests {wrong} diverged at {stages}"


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_ranks_that_disagree_on_the_batch_fail_loudly(tiny_llama_dir, layout):
    llm = LLM(str(tiny_llama_dir), **layout)
    executor = llm.engine.executor
    try:
        # Slip a request into rank 1's batch alone, as a rank that applied a message differently would.
        stray = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(req_id="stray", token_ids=[1, 2], num_prompt_tokens=2,
                                               sampling_params=GREEDY, block_ids=[1], num_computed_tokens=0)],
            scheduled_cached_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
        )
        executor._pipes[1].send_bytes(b"execute_model")
        executor._pipes[1].send_bytes(msgspec.msgpack.encode(stray))
        assert executor._pipes[1].recv_bytes()
        with pytest.raises(RuntimeError, match="ranks disagree on the batch layout"):
            llm.generate([[3, 4, 5]], GREEDY)
        assert not any(worker.is_alive() for worker in executor._workers)
    finally:
        llm.engine.shutdown()
