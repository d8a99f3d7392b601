"""Pipeline parallelism on the CPU: the layers split into stages, each its own gloo worker process
(or tensor-parallel ranks), the residual stream handed from stage to stage and the last stage's
tokens handed back to every rank."""

from __future__ import annotations


import pytest

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.distributed import stage_layers
from kvpilot.runtime.tiny_model import make_tiny_model


@pytest.mark.parametrize("num_layers, num_stages, expected", [
    (4, 2, [range(0, 2), range(2, 4)]),
    (3, 2, [range(0, 2), range(2, 3)]),
    (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
    (2, 2, [range(0, 1), range(1, 2)]),
])
def test_stages_take_consecutive_layers_as_evenly_as_the_count_allows(num_layers, num_stages, expected):
    stages = [stage_layers(num_layers, stage, num_stages) for stage in range(num_stages)]
    assert stages == expected
    assert [layer for stage in stages for layer in stage] == list(range(num_layers))


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """Three layers, so that two stages hold different counts (the KV block size differs per stage)."""
    return str(make_tiny_model(tmp_path_factory.mktemp("pp-llama"), arch="llama", seed=3, num_layers=3))


@pytest.mark.parametrize("layout", [
    {"pipeline_parallel_size": 2},
    {"pipeline_parallel_size": 3},
    {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
], ids=["pp2", "pp3", "tp2xpp2"])
def test_stages_match_transformers(three_layers, layout):
    llm = LLM(three_layers, block_size=8, max_num_batched_tokens=64, **layout)
    oracle = HFOracle(three_layers)
    prompts = random_prompts([1, 9, 70, 150], llm.config.model.vocab_size, seed=11)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()
    for prompt, output in zip(prompts, outputs):
        oracle.assert_greedy_match(prompt, output.outputs[0])


def test_seeded_sampling_draws_what_one_process_draws(three_layers):
    """The last stage samples with the request's generator, as one process does; the earlier stages
    feed the tokens it hands back into the next step."""
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True)
    single = LLM(three_layers).generate([[4, 5, 6]], params)[0].outputs[0].token_ids
    llm = LLM(three_layers, pipeline_parallel_size=2)
    try:
        assert llm.generate([[4, 5, 6]], params)[0].outputs[0].token_ids == single
    finally:
        llm.engine.shutdown()


def test_the_core_keeps_a_step_in_each_stage(three_layers):
    """The core submits the next step while the last one is in the second stage, so that both run
    at once; and the tokens, handed to every stage with each request's next step, are right."""
    llm = LLM(three_layers, pipeline_parallel_size=2)
    executor = llm.engine.executor
    submit, collect = executor.submit_model, executor.collect_model
    in_flight = [0]  # after each submit and collect

    def submitting(scheduler_output):
        submit(scheduler_output)
        in_flight.append(in_flight[-1] + 1)

    def collecting():
        in_flight.append(in_flight[-1] - 1)
        return collect()

    executor.submit_model, executor.collect_model = submitting, collecting
    prompts = random_prompts([5] * 8, llm.config.model.vocab_size, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    try:
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()
    assert max(in_flight) == 2
    single = LLM(three_layers).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in single]
