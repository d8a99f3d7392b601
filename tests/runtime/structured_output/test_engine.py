"""Structured outputs through the engine on a random-weight tiny model, whose free text is noise:
whatever it writes under a grammar must match the grammar, and a request without one must not
notice its neighbours' grammars."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

from schemas import SCHEMAS

PROMPT = "The morning train to the coast"
CHOICES = ["yes", "no", 'it said "maybe"', "back\\slash"]
REGEX = r"[a-z]{2,5}-[0-9]{3}( [A-Z]{1,4})?"


def constrained(temperature: float = 0.0, seed: int | None = None, max_tokens: int = 256, **constraint):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=512)


@pytest.fixture
def bitmasks(llm):
    """The grammar bitmask of every step the engine runs while the test does."""
    seen = []
    execute = llm.engine.executor.execute_model

    def spy(scheduler_output):
        seen.append(scheduler_output.grammar_bitmask)
        return execute(scheduler_output)

    llm.engine.executor.execute_model = spy
    yield seen
    llm.engine.executor.execute_model = execute


def test_twenty_schemas_all_validate(llm):
    # Sampled (seeded), so the noise wanders through more of each grammar than argmax would.
    params = [constrained(1.0, seed=i, json=schema, disable_any_whitespace=True)
              for i, (schema, _) in enumerate(SCHEMAS)]
    outputs = llm.generate([PROMPT] * len(params), params)
    for (schema, _), output in zip(SCHEMAS, outputs):
        completion = output.outputs[0]
        jsonschema.validate(json.loads(completion.text), schema)
        # The grammar's end ended the request, not max_tokens.
        assert completion.finish_reason == "stop", completion.text


def test_regex_choice_and_ebnf_grammar(llm):
    grammar = 'root ::= "(" digit digit? ")" ("+" | "-")\ndigit ::= [0-9]'
    outputs = llm.generate([PROMPT] * 6, [
        constrained(regex=REGEX), constrained(1.0, seed=3, regex=REGEX),
        constrained(choice=CHOICES), constrained(1.0, seed=4, choice=CHOICES),
        constrained(grammar=grammar), constrained(1.0, seed=5, grammar=grammar),
    ])
    texts = [o.outputs[0].text for o in outputs]
    assert all(re.fullmatch(REGEX, t) for t in texts[:2]), texts
    assert all(t in CHOICES for t in texts[2:4]), texts
    assert all(re.fullmatch(r"\([0-9]{1,2}\)[+-]", t) for t in texts[4:]), texts
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_a_complete_grammar_ends_the_request_without_an_eos(llm):
    # ignore_eos: only the grammar can end it before max_tokens.
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["abcdefgh"]))
    completion = llm.generate([PROMPT], params)[0].outputs[0]
    assert completion.text == "abcdefgh" and completion.finish_reason == "stop"
    assert llm.eos_token_id not in completion.token_ids and len(completion.token_ids) <= len("abcdefgh")


def test_mixed_batch_leaves_unconstrained_requests_alone(llm, bitmasks):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    alone = llm.generate([PROMPT, "A cache keeps"], [free, seeded])
    assert bitmasks and all(b is None for b in bitmasks), "a step without grammars carries no bitmask"

    schema = SCHEMAS[6][0]
    grammars = [constrained(json=schema, disable_any_whitespace=True), constrained(choice=CHOICES),
                constrained(1.0, seed=2, regex=REGEX)]
    mixed = llm.generate([PROMPT, "In 1969", "A cache keeps", "To bake", "Hello"],
                         [free, grammars[0], seeded, grammars[1], grammars[2]])
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), schema)
    assert mixed[3].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, mixed[4].outputs[0].text)
    # Only the grammar requests were ever in a bitmask.
    masked = {req_id for b in bitmasks if b is not None for req_id in b.req_ids}
    assert len(masked) == 3
    # A grammar request's output is the same whatever the batch.
    again = llm.generate(["In 1969"], [grammars[0]])[0].outputs[0]
    assert again.token_ids == mixed[1].outputs[0].token_ids


def test_a_preempted_grammar_request_resumes_and_validates(tiny_llama_dir):
    schema = SCHEMAS[8][0]

    def run(blocks: int, with_hog: bool):
        llm = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks_override=blocks, max_model_len=256,
                  enable_prefix_caching=False)
        hog = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        grammar = constrained(1.0, seed=7, max_tokens=60, json=schema, disable_any_whitespace=True)
        prompts = [list(range(10, 30)), list(range(40, 50))]
        outputs = llm.generate(prompts if with_hog else prompts[1:], [hog, grammar] if with_hog else [grammar])
        return outputs[-1].outputs[0], llm.get_stats().num_preemptions

    alone, _ = run(blocks=128, with_hog=False)
    squeezed, preemptions = run(blocks=22, with_hog=True)
    assert preemptions > 0
    jsonschema.validate(json.loads(squeezed.text), schema)
    assert squeezed.token_ids == alone.token_ids


def test_an_unsupported_schema_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.generate([PROMPT], constrained(json={"type": "array", "uniqueItems": True}))
    assert not llm.engine.has_unfinished_requests()


def test_tensor_parallel_ranks_get_the_engine_cores_mask(llm, tiny_llama_dir):
    # The mask is computed once in the engine core and crosses to both workers in the
    # SchedulerOutput; rank 0's tokens are the answer, and they equal one process's.
    params = [constrained(1.0, seed=5, json=SCHEMAS[16][0], disable_any_whitespace=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), constrained(choice=CHOICES)]
    prompts = [PROMPT, "In 1969", "A cache keeps"]
    tp = LLM(str(tiny_llama_dir), tensor_parallel_size=2, max_model_len=512)
    try:
        sharded = tp.generate(prompts, params)
    finally:
        tp.engine.shutdown()
    single = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in single]
    jsonschema.validate(json.loads(sharded[0].outputs[0].text), SCHEMAS[16][0])
    assert sharded[2].outputs[0].text in CHOICES


def test_grammars_are_compiled_once_per_constraint(llm):
    manager = llm.engine.structured_output
    schema = SCHEMAS[1][0]
    first = manager.request_for(StructuredOutputsParams(json=schema))
    reordered = manager.request_for(StructuredOutputsParams(json=dict(reversed(list(schema.items())))))
    other = manager.request_for(StructuredOutputsParams(json=SCHEMAS[2][0]))
    assert first.compiled is reordered.compiled is not other.compiled
    # Each request still gets its own matcher.
    first.accept(llm.tokenizer.token_to_id("{"))
    assert reordered.start() is not first.start() and reordered.num_accepted == 0


def spy_outputs(llm, monkeypatch) -> list:
    """Every EngineCoreOutput the engine's steps return while the test runs."""
    seen = []
    step = llm.engine.step

    def spy():
        outputs = step()
        seen.extend(outputs)
        return outputs

    monkeypatch.setattr(llm.engine, "step", spy)
    return seen


def test_a_grammar_that_fails_to_compile_in_the_engine_aborts_its_request_only(llm, monkeypatch):
    # The frontend's check passed, but the engine's compile (against the tokenizer) fails.
    def failing(params):
        raise ValueError("tokenizer-specific failure")

    monkeypatch.setattr(llm.engine.structured_output, "_compile", failing)
    params = constrained(regex="[0-9]{4}-unique-to-this-test")
    # What the engine tells its frontend: the abort, and why (for the server's 400).
    refused = spy_outputs(llm, monkeypatch)
    outputs = llm.generate([PROMPT, PROMPT], [params, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    assert outputs[0].outputs[0].finish_reason == "abort" and outputs[0].outputs[0].token_ids == []
    [reason] = [output.error for output in refused if output.error is not None]
    assert reason == "the structured output's grammar did not compile: tokenizer-specific failure"
    assert len(outputs[1].outputs[0].token_ids) == 4
    monkeypatch.undo()
    # A failed compile is not cached: the same constraint compiles on the next request.
    assert re.fullmatch("[0-9]{4}-unique-to-this-test", llm.generate([PROMPT], params)[0].outputs[0].text)


def test_a_matcher_that_ran_ahead_of_its_request_is_rebuilt(llm):
    grammar = llm.engine.structured_output.request_for(StructuredOutputsParams(choice=["ab", "ac"]))
    grammar.compiled.result(timeout=60)
    a, b, c = (llm.tokenizer.token_to_id(ch) for ch in "abc")
    grammar.accept(a)
    grammar.accept(b)
    assert grammar.is_finished
    # The request kept only "a" (its "b" was dropped): the matcher follows, and "c" is allowed again.
    matcher = grammar.sync([a])
    assert grammar.num_accepted == 1 and not grammar.is_finished
    assert matcher.consume_token(c) and matcher.is_stopped()


def test_async_scheduling_gives_the_same_grammar_outputs(llm, tiny_llama_dir):
    # Under --async-scheduling a grammar request waits out its token in flight (its next mask
    # depends on it) while the others run ahead; every output equals the synchronous engine's.
    params = [constrained(1.0, seed=9, json=SCHEMAS[8][0], disable_any_whitespace=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              constrained(regex=REGEX), SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True)]
    prompts = [PROMPT, "In 1969", "A cache keeps", "To bake"]
    overlapped = LLM(str(tiny_llama_dir), max_model_len=512, async_scheduling=True).generate(prompts, params)
    assert ([o.outputs[0].token_ids for o in overlapped]
            == [o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    jsonschema.validate(json.loads(overlapped[0].outputs[0].text), SCHEMAS[8][0])
