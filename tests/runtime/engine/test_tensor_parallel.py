"""Tensor parallelism on the CPU: two gloo worker processes, each holding half of every layer."""

from __future__ import annotations

import os
import signal

import pytest

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.worker.executor import WorkerDiedError


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tp_engine(request, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = str(tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir)
    llm = LLM(model_dir, tensor_parallel_size=2, block_size=8, max_num_batched_tokens=64)
    yield llm, HFOracle(model_dir)
    llm.engine.shutdown()


def test_two_ranks_match_transformers(tp_engine):
    llm, oracle = tp_engine
    prompts = random_prompts([1, 9, 70, 150], llm.config.model.vocab_size, seed=11)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    for prompt, output in zip(prompts, llm.generate(prompts, params)):
        oracle.assert_greedy_match(prompt, output.outputs[0])


def test_seeded_sampling_agrees_across_ranks(tp_engine):
    llm, _ = tp_engine
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    single = LLM(llm.config.model.path).generate([[4, 5, 6]], params)[0].outputs[0].token_ids
    # Every rank samples from the same gathered logits with the same generator, so rank 0's
    # answer is also what one process would have drawn.
    assert llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids == single


# A dead TP rank, or a dead first pipeline stage (the last one waits to receive from it).
@pytest.mark.parametrize("layout, dead", [({"tensor_parallel_size": 2}, 1), ({"pipeline_parallel_size": 2}, 0)])
def test_a_dead_worker_fails_the_engine_fast(tiny_llama_dir, layout, dead):
    llm = LLM(str(tiny_llama_dir), **layout)
    workers = list(llm.engine.executor._workers)
    os.kill(workers[dead].pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=f"TP worker {dead} exited with code -9"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    # The surviving rank may be blocked in a collective with the dead one: it is stopped too.
    assert not any(worker.is_alive() for worker in workers)


def test_a_size_that_does_not_divide_the_heads_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(str(tiny_llama_dir), tensor_parallel_size=3)
