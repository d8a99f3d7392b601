"""--async-scheduling: the same outputs as synchronous scheduling, token for token.

The engine schedules step N+1 while step N runs on its model thread. What that changes is when
the scheduler learns each token, never which token comes: transformers' greedy tokens are the
oracle, and every other field of an output (text, stop strings, stop reasons, logprobs, seeded
sampling) must equal what the synchronous engine returns.
"""

from __future__ import annotations

import pytest

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.engine.core import EngineCore
from kvpilot.runtime.request import Request

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
PROMPT_LENGTHS = [1, 3, 17, 40, 64, 99, 150, 200]


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir):
    return HFOracle(str(tiny_llama_dir))


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16},
    # 8 sequences of up to 232 tokens want ~75 blocks of 16: 24 force preemptions.
    {"num_gpu_blocks_override": 24},
    {"num_gpu_blocks_override": 40, "scheduling_policy": "priority", "block_size": 8,
     "long_prefill_token_threshold": 24},
], ids=["default", "chunked_prefill_16", "preemption", "priority_preemption_small_blocks"])
def test_greedy_matches_transformers_with_async_scheduling(tiny_llama_dir, oracle, engine_args):
    llm = LLM(str(tiny_llama_dir), async_scheduling=True, **engine_args)
    try:
        prompts = random_prompts(PROMPT_LENGTHS, llm.config.model.vocab_size, seed=2)
        priorities = [i % 3 for i in range(len(prompts))]
        outputs = llm.generate(prompts, GREEDY, priority=priorities)
        if "num_gpu_blocks_override" in engine_args:
            assert llm.get_stats().num_preemptions > 0
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == oracle.greedy(prompt)[0], f"prompt of {len(prompt)} diverged"
        assert llm.get_stats().kv_cache_usage == 0.0
    finally:
        llm.engine.shutdown()


def _mixed_batch(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Stop strings (found by the frontend), stop ids, min_tokens, EOS, seeds and logprobs together."""
    greedy = dict(temperature=0, max_tokens=24)
    reference = llm.generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True))[0].outputs[0]
    prompts = random_prompts([3, 12, 30, 7, 50, 20], llm.config.model.vocab_size, seed=5) + [[5, 6, 7]] * 3
    params = [
        SamplingParams(**greedy, logprobs=3),
        SamplingParams(**greedy, stop_token_ids=[reference.token_ids[2]], ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(**greedy, min_tokens=5, ignore_eos=True, stop_token_ids=[reference.token_ids[1]]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, logprobs=2),
        SamplingParams(**greedy, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(**greedy, ignore_eos=True, stop=[reference.text[6:9]]),
        SamplingParams(**greedy, ignore_eos=True, stop=[reference.text[6:9]], include_stop_str_in_output=True),
        SamplingParams(**greedy, stop_token_ids=[reference.token_ids[5]]),
    ]
    return prompts, params


def _fields(output) -> tuple:
    completion = output.outputs[0]
    return completion.token_ids, completion.text, completion.finish_reason, completion.stop_reason


def _assert_logprobs_close(got, want) -> None:
    assert (got is None) == (want is None)
    for got_step, want_step in zip(got or [], want or []):
        if want_step is None:
            assert got_step is None
            continue
        assert got_step.keys() == want_step.keys()
        for token, entry in want_step.items():
            assert abs(got_step[token].logprob - entry.logprob) < 1e-4


def test_every_output_field_equals_synchronous_scheduling(tiny_llama_dir):
    results = {}
    for async_scheduling in (False, True):
        # A small pool, so that the batch also goes through preemptions.
        llm = LLM(str(tiny_llama_dir), async_scheduling=async_scheduling, max_model_len=128,
                  num_gpu_blocks_override=12)
        try:
            prompts, params = _mixed_batch(llm)
            results[async_scheduling] = llm.generate(prompts, params)
            assert llm.get_stats().num_preemptions > 0
        finally:
            llm.engine.shutdown()
    sync, pipelined = results[False], results[True]
    assert [_fields(o) for o in pipelined] == [_fields(o) for o in sync]
    # Every way of stopping is in the batch.
    reasons = {(o.outputs[0].finish_reason, type(o.outputs[0].stop_reason)) for o in sync}
    assert reasons >= {("length", type(None)), ("stop", int), ("stop", str)}
    for got, want in zip(pipelined, sync):
        _assert_logprobs_close(got.outputs[0].logprobs, want.outputs[0].logprobs)
        _assert_logprobs_close(got.prompt_logprobs, want.prompt_logprobs)


def _engine(model_dir: str, **engine_args) -> EngineCore:
    return EngineCore(EngineArgs(model=model_dir, **engine_args).create_engine_config())


def test_an_abort_while_its_step_is_in_flight(tiny_llama_dir):
    def run(abort: bool) -> dict[str, list]:
        engine = _engine(str(tiny_llama_dir), async_scheduling=True, max_model_len=128)
        try:
            for req_id, prompt in (("a", [5, 6, 7]), ("b", list(range(10, 40)))):
                engine.add_request(Request(req_id, prompt, SamplingParams(max_tokens=20, temperature=0,
                                                                          ignore_eos=True), max_model_len=128))
            outputs: dict[str, list] = {"a": [], "b": []}
            steps = 0
            while engine.has_unfinished_requests():
                for output in engine.step():
                    outputs[output.request_id].append(output)
                steps += 1
                if abort and steps == 5:
                    # Two steps that include `a` have been scheduled since its last output came back.
                    assert engine._in_flight and "a" in engine._in_flight[0][0].num_scheduled_tokens
                    engine.abort_requests(["a"])
                    outputs["a"].append("aborted")
            assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks - 1
            # The next step hands the runner the finished ids: only the newcomer keeps a row.
            engine.add_request(Request("c", [1], SamplingParams(max_tokens=1), max_model_len=128))
            while engine.has_unfinished_requests():
                engine.step()
            assert list(engine.executor.batch.row_of) == ["c"]
            return outputs
        finally:
            engine.shutdown()

    full, aborted = run(abort=False), run(abort=True)
    tokens = lambda outputs: [t for o in outputs if o != "aborted" for t in o.new_token_ids]  # noqa: E731
    # Nothing reaches `a` after the abort, and `b` runs on as if nothing happened.
    assert aborted["a"][-1] == "aborted" and not any(o.finished for o in aborted["a"][:-1])
    assert tokens(aborted["a"]) == tokens(full["a"])[: len(tokens(aborted["a"]))]
    assert 0 < len(tokens(aborted["a"])) < 20
    assert tokens(aborted["b"]) == tokens(full["b"]) and aborted["b"][-1].finish_reason == "length"


def test_an_id_taken_again_while_its_old_request_has_a_step_in_flight(tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def tokens_of(engine: EngineCore, req_id: str) -> list[int]:
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [t for output in engine.step() if output.request_id == req_id for t in output.new_token_ids]
        return tokens

    engine = _engine(str(tiny_llama_dir), async_scheduling=True, max_model_len=128)
    try:
        engine.add_request(Request("a", [5, 6, 7], params, max_model_len=128))
        for _ in range(3):
            engine.step()
        assert engine._in_flight and "a" in engine._in_flight[0][0].num_scheduled_tokens
        engine.abort_requests(["a"])
        engine.add_request(Request("a", [50, 51, 52, 53], params, max_model_len=128))
        reused = tokens_of(engine, "a")
        engine.add_request(Request("fresh", [50, 51, 52, 53], params, max_model_len=128))
        assert reused == tokens_of(engine, "fresh") and len(reused) == 6
    finally:
        engine.shutdown()


def test_async_scheduling_is_a_serve_flag(tiny_llama_dir):
    from kvpilot.runtime.cli import build_parser

    # A MODEL that exists: serve checks it while parsing (main 6e909cc).
    args = build_parser().parse_args(["serve", str(tiny_llama_dir), "--async-scheduling"])
    assert args.async_scheduling is True
