"""A chat request's tools, without a server: the checks on tools and tool_choice, the schema that
forces `required` and named calls, and the chat answer built from recorded outputs, streamed
(OpenAI's tool-call deltas) and whole."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.server.chat import ChatFormat
from kvpilot.runtime.server.errors import APIError
from kvpilot.runtime.server.protocol import ChatCompletionRequest, ChatMessage, Usage
from kvpilot.runtime.server.serving import Choice
from kvpilot.runtime.server.tool_use import AUTO_NEEDS_FLAGS, ToolSettings, required_calls_schema, tool_use

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
HERMES = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
USER = [{"role": "user", "content": "Weather?"}]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.mark.parametrize("fields, complaint", [
    ({"tools": []}, "`tools` must not be an empty array"),
    ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "does not match any of the specified `tools`"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
    ({"tools": [{"type": "retrieval"}]}, "type"),
])
def test_tools_and_tool_choice_are_checked_as_vllm_checks_them(fields, complaint):
    with pytest.raises(ValidationError, match=complaint):
        _request(**fields)


@pytest.mark.parametrize("message, complaint", [
    ({"role": "tool", "content": "18 C"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant messages"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                           "function": {"name": "f", "arguments": "{oops"}}]}, "JSON text"),
])
def test_history_messages_with_tool_fields_are_checked(message, complaint):
    with pytest.raises(ValidationError, match=complaint):
        ChatMessage.model_validate(message)


def test_tools_default_to_auto_which_needs_the_servers_flags():
    body = _request(tools=TOOLS)
    assert body.tool_choice == "auto"
    with pytest.raises(APIError) as refused:
        tool_use(body, ToolSettings())
    assert refused.value.status_code == 400 and str(refused.value.message) == AUTO_NEEDS_FLAGS
    with pytest.raises(APIError):
        tool_use(body, ToolSettings(enable_auto_tool_choice=True))
    assert tool_use(body, HERMES).structured_outputs is None


def test_none_shows_the_tools_to_the_template_and_reads_no_calls():
    tools = tool_use(_request(tools=TOOLS, tool_choice="none"), ToolSettings())
    assert tools.tools == TOOLS and tools.parser is None and tools.structured_outputs is None


def test_a_named_function_is_forced_by_its_parameters_schema():
    body = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_use(body, ToolSettings()).structured_outputs.json == WEATHER
    body = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tool_use(body, ToolSettings()).structured_outputs.json == {"type": "object", "properties": {}}


def test_required_is_an_array_of_named_calls_each_valid_for_its_function():
    schema = tool_use(_request(tools=TOOLS, tool_choice="required"), ToolSettings()).structured_outputs.json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {"days": 2}}], [{"name": "other", "parameters": {}}],
                  [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = tool_use(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                      ToolSettings()).structured_outputs.json
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)


def test_required_moves_defs_to_the_root_and_refuses_conflicting_ones():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    with_defs = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "$defs": {"Point": point}}
    body = _request(tools=[{"type": "function", "function": {"name": "go", "parameters": with_defs}}],
                    tool_choice="required")
    schema = required_calls_schema(body.tools)
    assert schema["$defs"] == {"Point": point}
    jsonschema.validate([{"name": "go", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": {"y": 1}}}], schema)
    assert "$defs" in body.tools[0].function.parameters  # the request's own schema is untouched
    other = {**with_defs, "$defs": {"Point": {"type": "string"}}}
    body = _request(tools=[{"type": "function", "function": {"name": "go", "parameters": with_defs}},
                           {"type": "function", "function": {"name": "stay", "parameters": other}}],
                    tool_choice="required")
    with pytest.raises(APIError, match="multiple schemas"):
        required_calls_schema(body.tools)


# -- the answer, from recorded outputs --------------------------------------------------------------

HERMES_TOKENS = ["Sure", ".", "\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",', ' "',
                 "arguments", '":', ' {"', "city", '":', ' "', "Paris", '"}}', "\n", "</tool_call>", "\n",
                 "<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"]


def _outputs(tokens: list[str], finish_reason: str = "stop", index: int = 0) -> list[StreamOutput]:
    return [StreamOutput(request_id="r", index=index, text=text, token_ids=[1], logprobs=None,
                         finish_reason=finish_reason if i == len(tokens) - 1 else None, stop_reason=None,
                         num_prompt_tokens=3, num_output_tokens=i + 1, num_cached_tokens=0)
            for i, text in enumerate(tokens)]


def _format(body: ChatCompletionRequest, settings: ToolSettings = HERMES) -> ChatFormat:
    return ChatFormat("chatcmpl-1", "tiny", body.n, None, tool_use(body, settings))


def _whole(body: ChatCompletionRequest, outputs: list[StreamOutput]) -> dict:
    choice = Choice(0)
    for output in outputs:
        choice.add(output)
    return _format(body).response([choice], Usage(prompt_tokens=3, completion_tokens=1, total_tokens=4)
                                  ).model_dump()["choices"][0]


def _streamed(body: ChatCompletionRequest, outputs: list[StreamOutput]) -> list[dict]:
    """The chunks sent (an output whose text the parser holds back sends none)."""
    response_format = _format(body)
    chunks = [response_format.chunk(output) for output in outputs]
    return [chunk.model_dump()["choices"][0] for chunk in chunks if chunk is not None]


def _accumulate(chunks: list[dict]) -> dict:
    """What an OpenAI client assembles from the deltas."""
    content, calls = "", {}
    for chunk in chunks:
        content += chunk["delta"].get("content") or ""
        for call in chunk["delta"].get("tool_calls") or []:
            if "id" in call:
                calls[call["index"]] = {"id": call["id"], "type": call["type"],
                                        "function": {"name": call["function"]["name"], "arguments": ""}}
            calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


def _without_ids(calls: list[dict]) -> list[dict]:
    return [{key: value for key, value in call.items() if key != "id"} for call in calls]


def test_auto_calls_stream_as_openais_deltas_and_match_the_whole_answer():
    body = _request(tools=TOOLS)
    outputs = _outputs(HERMES_TOKENS)
    whole = _whole(body, outputs)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Sure."
    assert _without_ids(whole["message"]["tool_calls"]) == [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert all(call["id"].startswith("chatcmpl-tool-") for call in whole["message"]["tool_calls"])

    chunks = _streamed(body, outputs)
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    # Tokens held back (a tag, whitespace, the JSON before the name) send no empty deltas.
    assert len(chunks) < len(outputs) and all(c["delta"] for c in chunks[:-1])
    deltas = [call for c in chunks for call in c["delta"].get("tool_calls") or []]
    # Each call opens with index, id, type and name (arguments empty), then argument fragments only.
    assert deltas[0] == {"index": 0, "id": deltas[0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}
    fragments = [d for d in deltas if d["index"] == 0][1:]
    assert len(fragments) > 3 and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                                      for d in fragments)
    assembled = _accumulate(chunks)
    assert assembled["content"] == whole["message"]["content"]
    assert _without_ids(assembled["tool_calls"]) == _without_ids(whole["message"]["tool_calls"])
    assert len({call["id"] for call in assembled["tool_calls"]}) == 2


def test_auto_without_calls_is_plain_content_streamed_and_whole():
    body = _request(tools=TOOLS)
    tokens = ["It", " is", " <", "b", ">", "sunny", "</", "b", ">", "\n"]
    whole = _whole(body, _outputs(tokens))
    assert whole["message"] == {"role": "assistant", "content": "".join(tokens)}
    assert whole["finish_reason"] == "stop"
    chunks = _streamed(body, _outputs(tokens))
    assert _accumulate(chunks) == {"content": "".join(tokens), "tool_calls": []}
    assert chunks[-1]["finish_reason"] == "stop"


def test_a_call_cut_off_by_max_tokens_keeps_finish_reason_length():
    body = _request(tools=TOOLS)
    whole = _whole(body, _outputs(HERMES_TOKENS[:17], finish_reason="length"))
    assert whole["finish_reason"] == "length"
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city'}


def test_parallel_tool_calls_false_keeps_the_first_call():
    body = _request(tools=TOOLS, parallel_tool_calls=False)
    assert [c["function"]["name"] for c in _whole(body, _outputs(HERMES_TOKENS))["message"]["tool_calls"]] == [
        "get_weather"]
    assert [c["function"]["name"] for c in _accumulate(_streamed(body, _outputs(HERMES_TOKENS)))["tool_calls"]] == [
        "get_weather"]


def test_required_and_named_answers_are_tool_calls_only():
    required = _request(tools=TOOLS, tool_choice="required")
    tokens = ['[{"name": "get_time", ', '"parameters": {}}', ", ", '{"name": "get_weather", "parameters": ',
              '{"city": "Oslo"}}]']
    whole = _whole(required, _outputs(tokens))
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]
            ] == [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert _without_ids(_accumulate(_streamed(required, _outputs(tokens)))["tool_calls"]) == _without_ids(
        whole["message"]["tool_calls"])

    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tokens = ['{"city"', ': "Oslo"', "}"]
    whole = _whole(named, _outputs(tokens))
    # A named call finishes with "stop", as OpenAI and vLLM answer a forced function.
    assert whole["finish_reason"] == "stop"
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    chunks = _streamed(named, _outputs(tokens))
    assert chunks[0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert _without_ids(_accumulate(chunks)["tool_calls"]) == _without_ids(whole["message"]["tool_calls"])


def test_without_tools_the_answer_is_unchanged():
    body = _request()
    whole = _whole(body, _outputs(["<tool_call>", "{}"]))
    assert whole["message"] == {"role": "assistant", "content": "<tool_call>{}"}
    assert _streamed(body, _outputs(["<tool_call>"]))[0]["delta"] == {"content": "<tool_call>"}


def test_each_of_n_streamed_choices_reads_its_own_calls():
    body = _request(tools=TOOLS, n=2)
    calls, plain = _outputs(HERMES_TOKENS, index=0), _outputs(["No", " call", " here"], index=1)
    interleaved = [output for pair in zip(calls, plain) for output in pair] + calls[len(plain):]
    response_format = _format(body)
    chunks = [chunk.model_dump()["choices"][0] for chunk in map(response_format.chunk, interleaved) if chunk]
    by_index = {i: [c for c in chunks if c["index"] == i] for i in (0, 1)}
    assert [c["function"]["name"] for c in _accumulate(by_index[0])["tool_calls"]] == ["get_weather", "get_time"]
    assert by_index[0][-1]["finish_reason"] == "tool_calls"
    assert _accumulate(by_index[1]) == {"content": "No call here", "tool_calls": []}
    assert by_index[1][-1]["finish_reason"] == "stop"


def test_history_calls_reach_the_template_with_their_arguments_as_objects():
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]
    rendered = ChatMessage.model_validate({"role": "assistant", "tool_calls": calls}).as_template_input()
    assert rendered == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]}
    assert ChatMessage.model_validate({"role": "tool", "tool_call_id": "c1", "content": "4 C"}).as_template_input() == {
        "role": "tool", "content": "4 C", "tool_call_id": "c1"}


def test_with_logprobs_every_output_is_sent_held_back_text_or_not():
    body = _request(tools=TOOLS, logprobs=True)
    response_format = ChatFormat("chatcmpl-1", "tiny", 1, body.num_logprobs, tool_use(body, HERMES))
    outputs = _outputs(HERMES_TOKENS)
    assert all(response_format.chunk(output) is not None for output in outputs)
