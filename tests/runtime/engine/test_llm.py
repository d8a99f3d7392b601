"""The offline API's contract: input forms, output order, seeds, stops and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.request import ParamError, Request


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=128)


def test_string_prompts_tokenize_like_transformers(llm, tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompts = ["The quick brown fox", "Hello, world!"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert [o.prompt for o in outputs] == prompts
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == tokenizer(prompt)["input_ids"]
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_outputs_come_back_in_input_order(llm):
    prompts = [[7] * n for n in (30, 2, 15, 1)]
    lengths = [5, 1, 9, 3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert len({o.request_id for o in outputs}) == 4


def test_same_seed_same_output_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True) for _ in range(3)]
    batched = llm.generate([[9, 9], [1, 2, 3, 4, 5, 6], [3, 4, 5], [8]], [others[0], others[1], params, others[2]])
    assert batched[2].outputs[0].token_ids == alone
    unseeded = llm.generate([[3, 4, 5]] * 3, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_stop_token_ids_and_min_tokens(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    tokens = greedy.outputs[0].token_ids
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    stopped = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    completion = stopped.outputs[0]
    assert completion.token_ids == tokens[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    # min_tokens holds the stop token back until enough tokens exist.
    held = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                     min_tokens=first + 2, ignore_eos=True))[0]
    assert len(held.outputs[0].token_ids) > first + 1


def test_max_model_len_caps_output(llm):
    output = llm.generate([[4] * 120], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 8
    assert output.outputs[0].finish_reason == "length"


def test_every_eos_token_of_the_checkpoint_ends_a_request(llm, tiny_llama_dir, edited_checkpoint):
    # Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>; a chat turn ends with the
    # last. Here the checkpoint's second EOS is a token greedy decoding reaches.
    free = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    second_eos = tokens[3]
    eos = json.loads((tiny_llama_dir / "config.json").read_text())["eos_token_id"]
    folder = edited_checkpoint(tiny_llama_dir, eos_token_id=[eos, second_eos])
    two_eos = LLM(str(folder), max_model_len=128)
    stopped = two_eos.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(second_eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == second_eos
    # ignore_eos ignores it too, and before min_tokens it may not be sampled at all.
    ignored = two_eos.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert ignored.outputs[0].token_ids == tokens
    held = two_eos.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, min_tokens=10))[0]
    assert second_eos not in held.outputs[0].token_ids and len(held.outputs[0].token_ids) == 10
    # An EOS that only generation_config.json names ends a request as well.
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [second_eos]}))
    stopped = LLM(str(folder), max_model_len=128).generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0))
    assert stopped[0].outputs[0].token_ids == tokens[: tokens.index(second_eos) + 1]


@pytest.mark.parametrize(
    "make_params, message",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        # NaN compares false with everything: it would have passed a `< 0` check, then sampled garbage.
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(top_k=-2), "top_k"),
        (lambda: SamplingParams(min_p=2.0), "min_p"),
        (lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
        (lambda: SamplingParams(seed=-1), "seed"),
        # Choice 2 would sample with seed + 2 = 2**63: refused up front, naming what was given.
        (lambda: SamplingParams(seed=2**63 - 2, n=3), r"got 9223372036854775806 with n=3"),
    ],
)
def test_bad_sampling_params_name_the_field(make_params, message):
    with pytest.raises(ValueError, match=message):
        make_params()


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "prompt is empty"),
        ("", SamplingParams(), "prompt is empty"),
        ([1] * 200, SamplingParams(), "max_model_len=128"),
        ([10**6], SamplingParams(), "vocabulary"),
        ([1, 2], SamplingParams(logprobs=50), "logprobs"),
    ],
)
def test_bad_prompts_are_refused_and_the_engine_stays_usable(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[1, 2, 3], prompt], params)
    stats = llm.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    output = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 3


def test_unknown_engine_argument_is_named(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_seq\\b"):
        LLM(str(tiny_llama_dir), max_num_seq=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"block_size": 3}, "block_size"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 10**6}, "max_position_embeddings"),
    ],
)
def test_bad_engine_arguments_name_the_field(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), **kwargs)


def test_request_too_big_for_the_kv_pool_is_refused(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_gpu_blocks_override=3, block_size=4)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        llm.generate([[1] * 6], SamplingParams(max_tokens=8))
    assert llm.generate([[1] * 6], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids


def test_generate_with_priority_list_must_match(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[1], [2]], SamplingParams(max_tokens=1), priority=[0])


def test_n_choices_are_seeded_one_after_another(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=40, ignore_eos=True)
    output = llm.generate([[11, 12, 13]], params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for index, completion in enumerate(output.outputs):
        alone = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=8, temperature=1.0, seed=40 + index,
                                                            ignore_eos=True))[0]
        assert completion.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


@pytest.mark.parametrize("seed", [0, 2**63 - 2])
def test_the_largest_seed_n_allows_seeds_every_choice(llm, seed):
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=seed, ignore_eos=True)
    first, again = (llm.generate([[11, 12, 13]], params)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.token_ids) == 4 for c in first.outputs)


def test_kv_pool_is_sized_from_the_memory_budget(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=2**20, max_model_len=64)
    per_block = llm.engine.executor.kv_cache_bytes_per_block()
    assert llm.engine.num_kv_blocks == 2**20 // per_block
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(tiny_llama_dir), gpu_memory_utilization=1.5)


def test_a_priority_victim_resumes_on_correct_kv(tiny_llama_dir):
    # B and C outrank A; admitting them in a tiny pool preempts A in the step that had just
    # scheduled (and published to the prefix cache) its next prompt chunk. A must not come back
    # on those never-computed blocks: with caching on, its output equals its output alone.
    def run(blocks: int, with_others: bool, caching: bool = True):
        llm = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks_override=blocks, max_model_len=64,
                  long_prefill_token_threshold=8, scheduling_policy="priority", enable_prefix_caching=caching)
        greedy = dict(temperature=0.0, ignore_eos=True)
        engine, outputs = llm.engine, {}
        engine.add_request(Request("A", [10 + i for i in range(24)], SamplingParams(max_tokens=4, **greedy),
                                   priority=5, arrival_time=0.0, max_model_len=64))
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        if with_others:
            engine.add_request(Request("B", [50, 51, 52, 53], SamplingParams(max_tokens=8, **greedy),
                                       priority=0, arrival_time=1.0, max_model_len=64))
            engine.add_request(Request("C", [60, 61, 62], SamplingParams(max_tokens=2, **greedy),
                                       priority=0, arrival_time=1.5, max_model_len=64))
        while engine.has_unfinished_requests():
            for output in engine.step():
                outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        return outputs["A"], engine.scheduler.num_preemptions

    alone, _ = run(blocks=64, with_others=False)
    squeezed, preemptions = run(blocks=9, with_others=True)
    assert preemptions > 0
    assert squeezed == alone == run(blocks=9, with_others=True, caching=False)[0]


def test_a_seeded_request_draws_the_same_tokens_across_a_preemption(tiny_llama_dir):
    def run(blocks: int, with_hog: bool):
        llm = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks_override=blocks, max_model_len=64,
                  enable_prefix_caching=False)
        prompts = [list(range(10, 30)), list(range(40, 50))] if with_hog else [list(range(40, 50))]
        # The hog is admitted first, so FCFS preempts the seeded request when blocks run out.
        params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)][-len(prompts):]
        return llm.generate(prompts, params)[-1].outputs[0].token_ids, llm.get_stats().num_preemptions

    alone, _ = run(blocks=64, with_hog=False)
    squeezed, preemptions = run(blocks=13, with_hog=True)
    assert preemptions > 0
    assert squeezed == alone


def test_the_engine_checks_the_output_a_request_resumes(llm):
    with pytest.raises(ParamError, match="resume_token_ids"):
        llm.engine.add_request(Request("over", [1, 2, 3], SamplingParams(max_tokens=2), resume_token_ids=[4, 5, 6]))
    with pytest.raises(ParamError, match="vocabulary"):
        llm.engine.add_request(Request("unknown", [1, 2, 3], SamplingParams(), resume_token_ids=[10**6]))
    # Output that used the whole budget ends the request on arrival, before any step.
    finished = llm.engine.add_request(Request("spent", [1, 2, 3], SamplingParams(max_tokens=2),
                                              resume_token_ids=[4, 5]))
    assert finished.finish_reason == "length" and finished.new_token_ids == []
    assert not llm.engine.has_unfinished_requests()


def test_stop_strings_cut_the_text_and_end_the_request(llm):
    prompt = "To bake a simple loaf of bread"
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0]
    stop = full.text[8:11]
    cut = full.text[: full.text.index(stop)]
    stopped = llm.generate(prompt, SamplingParams(stop=[stop, "never-generated"], **greedy))[0].outputs[0]
    assert stopped.text == cut
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    # The engine was told to stop: fewer tokens than asked, and nothing left running.
    assert len(stopped.token_ids) < 24 and stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    stats = llm.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    kept = llm.generate(prompt, SamplingParams(stop=stop, include_stop_str_in_output=True, **greedy))[0].outputs[0]
    assert kept.text == cut + stop and kept.stop_reason == stop


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop=["x", ""])


def test_cache_salt_separates_prefix_cache_hits(llm):
    prompt = [100 + i for i in range(40)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def cached(**kwargs) -> int:
        return llm.generate([prompt], params, **kwargs)[0].num_cached_tokens

    assert cached(cache_salt="alice") == 0
    # Two full blocks of 16; the last prompt token is always computed.
    assert cached(cache_salt="alice") == 32
    assert cached(cache_salt="bob") == 0
    assert cached() == 0
    assert cached() == 32
    assert [o.num_cached_tokens for o in llm.generate([prompt, prompt], params, cache_salt=["bob", "carol"])] \
        == [32, 0]
    with pytest.raises(ValueError, match="cache_salt has 1 entries for 2 prompts"):
        llm.generate([prompt, prompt], params, cache_salt=["alice"])
