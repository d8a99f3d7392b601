"""Request bodies: what pydantic accepts, refuses and derives (no server needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpilot.runtime.server.protocol import (
    MAX_NESTING,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    CompletionRequest,
    SchedulingPolicyRequest,
    TokenizeRequest,
)

USER = [{"role": "user", "content": "hi"}]


def test_completion_defaults_follow_openai_and_vllm():
    request = CompletionRequest(prompt="x")
    assert request.max_tokens == 16 and request.n == 1 and request.temperature == 1.0
    assert request.priority is None and request.cache_salt is None
    assert request.stop_strings == [] and not request.include_usage


@pytest.mark.parametrize("prompt, batch", [
    ("x", ["x"]), ([1, 2], [[1, 2]]), (["x"], ["x"]), ([[1, 2]], [[1, 2]]), (["x", "y"], ["x", "y"]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_a_prompt_or_a_batch_of_them(prompt, batch):
    assert CompletionRequest(prompt=prompt).prompts == batch


@pytest.mark.parametrize("fields", [
    {"prompt": []},
    {"prompt": [1, -2]},
    {"prompt": [[1], [2, -3]]},
    {"prompt": "x", "stream_options": {"include_usage": True}},
    {"prompt": "x", "stop": ["a", ""]},
    # Strict types: neither strings nor booleans pass for numbers, and no number is infinite.
    {"prompt": "x", "max_tokens": "5"},
    {"prompt": "x", "max_tokens": True},
    {"prompt": [1, True]},
    {"prompt": "x", "stop_token_ids": [False]},
    {"prompt": "x", "stream": "yes"},
    {"prompt": "x", "temperature": float("inf")},
    {"prompt": "x", "top_p": float("nan")},
    # Known fields this server does not honour are refused, not ignored.
    {"prompt": "x", "suffix": "y"},
    {"prompt": "x", "best_of": 2},
    {"prompt": "x", "n": 2, "best_of": 3},
    {"prompt": "x", "presence_penalty": 2.5},
    {"prompt": "x", "frequency_penalty": -2.01},
    {"prompt": "x", "repetition_penalty": 0},
    {"prompt": "x", "repetition_penalty": -1.0},
    {"prompt": "x", "allowed_token_ids": []},
    {"prompt": "x", "allowed_token_ids": [3, -1]},
    {"prompt": "x", "bad_words": [" "]},
    {"prompt": "x", "bad_words": ["x" * 257]},
    {"prompt": "x", "bad_words": ["w"] * 129},
    {"prompt": "x", "logit_bias": {"5": 101.0}},
    {"prompt": "x", "logit_bias": {"five": 1.0}},
    # Digits to str.isdigit, but no token id: "²" is no number int() reads, and "٣" is not how
    # a client writes 3.
    {"prompt": "x", "logit_bias": {"\u00b2": 1.0}},
    {"prompt": "x", "logit_bias": {"\u0663": 1.0}},
    {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(301)}},
    {"prompt": "x", "prompt_logprobs": 21},
])
def test_refused_completion_bodies(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**fields)


def test_integers_pass_for_floats():
    assert CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_p": 1}).temperature == 0.0


def test_stop_and_stream_options():
    request = CompletionRequest(prompt="x", stop="END", stream=True, stream_options={"include_usage": True})
    assert request.stop_strings == ["END"] and request.include_usage


def test_chat_token_limits_and_logprobs():
    assert ChatCompletionRequest(messages=USER).max_new_tokens is None
    assert ChatCompletionRequest(messages=USER, max_tokens=5).max_new_tokens == 5
    assert ChatCompletionRequest(messages=USER, max_tokens=5, max_completion_tokens=7).max_new_tokens == 7
    assert ChatCompletionRequest(messages=USER).num_logprobs is None
    assert ChatCompletionRequest(messages=USER, logprobs=True).num_logprobs == 0
    assert ChatCompletionRequest(messages=USER, logprobs=True, top_logprobs=4).num_logprobs == 4


@pytest.mark.parametrize("fields", [
    {"messages": []},
    {"messages": USER, "top_logprobs": 2},
    {"messages": USER, "continue_final_message": True},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": USER, "max_completion_tokens": "5"},
    {"messages": USER, "prompt_logprobs": 1},
])
def test_refused_chat_bodies(fields):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**fields)


def test_message_content_parts_are_joined_for_the_template():
    message = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert message.as_template_input() == {"role": "user", "content": "ab"}
    assert ChatMessage(role="assistant", name="bot").as_template_input() == {"role": "assistant", "content": "",
                                                                             "name": "bot"}


def test_tokenize_takes_exactly_one_of_prompt_and_messages():
    assert TokenizeRequest(prompt="x").messages is None
    for fields in [{}, {"prompt": "x", "messages": USER}]:
        with pytest.raises(ValidationError):
            TokenizeRequest(**fields)


def test_scheduling_policy_must_be_known():
    assert SchedulingPolicyRequest(policy="priority").policy == "priority"
    with pytest.raises(ValidationError, match="fcfs, priority"):
        SchedulingPolicyRequest(policy="lifo")


def test_chat_deltas_carry_only_what_changed():
    assert ChatDelta().model_dump() == {}
    assert ChatDelta(content="x").model_dump() == {"content": "x"}
    assert ChatDelta(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("body", [
    {"prompt": "\ud800"},
    {"prompt": "ok", "stop": ["fine", "\udfff"]},
    # Past the token ids of a batch, in a prompt of text.
    {"prompt": [[5, 6, 7], "\ud800"]},
    # In a key, where a JSON schema's property names are.
    {"prompt": "ok", "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"\ud800": {"type": "string"}}}}}},
])
def test_lone_surrogates_are_refused(body):
    with pytest.raises(ValidationError, match="lone surrogate"):
        CompletionRequest.model_validate(body)


def _nested(arrays: int) -> dict:
    """A body of 1 + `arrays` levels (built in a loop: json.loads would recurse)."""
    inner: list = []
    for _ in range(arrays - 1):
        inner = [inner]
    return {"prompt": "x", "ignored": inner}


@pytest.mark.parametrize("arrays", [MAX_NESTING, 960])
def test_nesting_is_bounded_without_recursing(arrays):
    # 960 levels parse (json's own limit is near 1000) and overflowed the recursive check: a 500.
    with pytest.raises(ValidationError, match=f"nests deeper than {MAX_NESTING} levels"):
        CompletionRequest.model_validate(_nested(arrays))
    assert CompletionRequest.model_validate(_nested(MAX_NESTING - 1)).prompt == "x"


def test_lone_surrogates_in_chat_messages_are_refused():
    with pytest.raises(ValidationError, match="lone surrogate"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "\ud800"}]})
