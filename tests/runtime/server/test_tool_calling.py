"""Tool calling end to end: a real `kvpilot serve` on the tiny model, over HTTP and the openai client.

The model is served with a Hermes-style chat template, so the tools and the tool history reach
its prompt. Its weights are random, so its free text never holds a call: calls come from
structured outputs (tool_choice "required" or a named function force them; a regex forces a
hermes block for "auto"), and their arguments must validate against the function's schema.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from kvpilot.runtime.server.tool_use import AUTO_NEEDS_FLAGS

from server_harness import HTTP_TIMEOUT_S, assert_openai_error, sse_events, start_server
from tool_conversations import CONVERSATION, HERMES_STYLE_TEMPLATE, HF_CONVERSATION, TOOLS, WEATHER_PARAMETERS

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _greedy(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 16, "temperature": 0, "messages": MESSAGES, **fields}


@pytest.fixture(scope="module")
def hermes_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a template that shows tools and renders tool calls and results."""
    model_dir = tmp_path_factory.mktemp("tiny-hermes") / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": HERMES_STYLE_TEMPLATE}))
    return model_dir


@pytest.fixture(scope="module")
def hermes_server(hermes_model_dir, tmp_path_factory):
    process = start_server(hermes_model_dir, tmp_path_factory.mktemp("tool-server"), "--served-model-name", "tiny",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(hermes_server):
    with httpx.Client(base_url=hermes_server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


def _stream(http: httpx.Client, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_auto_without_the_flags_is_vllms_400(server):
    for body in (_greedy(tools=TOOLS), _greedy(tools=TOOLS, tool_choice="auto")):
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
        assert assert_openai_error(response, 400, param="tool_choice")["message"] == AUTO_NEEDS_FLAGS
    # "none" needs no parser: the tools reach the template, and no call is read.
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=_greedy(tools=TOOLS, tool_choice="none"),
                          timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200 and "tool_calls" not in response.json()["choices"][0]["message"]


@pytest.mark.parametrize("fields", [
    {"tools": []},
    {"tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"messages": [*MESSAGES, {"role": "tool", "content": "no id"}]},
    {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}]},
])
def test_bad_tool_fields_are_400s(http, fields):
    assert_openai_error(http.post("/v1/chat/completions", json=_greedy(**fields)), 400)


def test_auto_with_no_call_in_the_text_answers_the_text(http):
    # "none" shows the template the same tools, so the prompt and the greedy text are the same.
    plain = http.post("/v1/chat/completions", json=_greedy(tools=TOOLS, tool_choice="none")).json()["choices"][0]
    auto = http.post("/v1/chat/completions", json=_greedy(tools=TOOLS)).json()["choices"][0]
    assert "<tool_call>" not in plain["message"]["content"]
    assert auto["message"] == plain["message"] and auto["finish_reason"] == plain["finish_reason"]
    chunks = _stream(http, _greedy(tools=TOOLS))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == plain["message"]["content"]
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)


def test_tools_and_a_tool_history_reach_the_prompt_as_transformers_renders_them(http, hermes_model_dir):
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(hermes_model_dir).apply_chat_template(
        HF_CONVERSATION, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    tokenized = http.post("/tokenize", json={"model": "tiny", "messages": CONVERSATION, "tools": TOOLS}).json()
    assert tokenized["tokens"] == expected
    answer = http.post("/v1/chat/completions", json=_greedy(messages=CONVERSATION, tools=TOOLS, tool_choice="none"))
    assert answer.json()["usage"]["prompt_tokens"] == len(expected)
    prompt = http.post("/detokenize", json={"model": "tiny", "tokens": expected}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert '<tool_response id="call_1">\n18 C, sunny\n</tool_response>' in prompt


# -- forced calls: required and named, guaranteed by structured outputs ------------------------------

SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "properties": {}})
           for tool in TOOLS}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def _assert_valid_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def _assembled(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) as a client assembles them from the deltas."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        [choice] = chunk["choices"]
        content += choice["delta"].get("content") or ""
        finish_reason = choice["finish_reason"] or finish_reason
        for delta in choice["delta"].get("tool_calls", []):
            if "id" in delta:
                assert delta["function"]["arguments"] == "" and delta["type"] == "function"
                calls[delta["index"]] = {"id": delta["id"], "type": "function",
                                         "function": {"name": delta["function"]["name"], "arguments": ""}}
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["function"]["arguments"] += delta["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], finish_reason


def _functions(calls: list[dict]) -> list[dict]:
    return [call["function"] for call in calls]


@pytest.mark.parametrize("prompt", ["What is the weather in Paris?", "Tell me the time."])
def test_required_returns_calls_that_validate_streamed_and_whole(http, prompt):
    body = _greedy(messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
                   max_tokens=120)
    [choice] = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    _assert_valid_calls(choice["message"]["tool_calls"])
    content, calls, finish_reason = _assembled(_stream(http, body))
    assert content == "" and finish_reason == "tool_calls"
    assert _functions(calls) == _functions(choice["message"]["tool_calls"])


def test_a_named_function_is_called_with_valid_arguments(http):
    body = _greedy(tools=TOOLS, tool_choice=NAMED_WEATHER, max_tokens=60)
    [choice] = http.post("/v1/chat/completions", json=body).json()["choices"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "stop"
    _assert_valid_calls([call])
    _, calls, _ = _assembled(_stream(http, body))
    assert _functions(calls) == [call["function"]]
    no_parameters = _greedy(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    [call] = http.post("/v1/chat/completions", json=no_parameters).json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}


def test_the_openai_client_gets_tool_calls_whole_and_streamed(hermes_server):
    client = openai.OpenAI(base_url=f"{hermes_server.base_url}/v1", api_key="unused", timeout=HTTP_TIMEOUT_S)
    request = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
                   max_completion_tokens=120, parallel_tool_calls=False)
    reply = client.chat.completions.create(**request)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert streamed == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    # The history the client builds from the reply is accepted and answered.
    follow_up = client.chat.completions.create(
        model="tiny", tools=TOOLS, tool_choice="none", max_completion_tokens=4,
        messages=[*MESSAGES, reply.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C"}])
    assert follow_up.choices[0].message.content


# A hermes block the regex forces the random model to write, with a free city.
HERMES_BLOCK = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                r'\{"city": "[a-z]{1,8}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


def test_auto_reads_the_hermes_calls_the_model_writes_streamed_and_whole(http):
    body = _greedy(tools=TOOLS, structured_outputs={"regex": HERMES_BLOCK}, max_tokens=200)
    [choice] = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    _assert_valid_calls([call])
    content, calls, finish_reason = _assembled(_stream(http, body))
    assert (content, _functions(calls), finish_reason) == ("Checking.", [call["function"]], "tool_calls")


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": NAMED_WEATHER, "structured_outputs": {"regex": "a+"}}, "tool_choice"),
    # A schema feature the grammar engine cannot enforce, in a function the choice forces.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_forced_calls_and_other_constraints_are_400s(http, fields, param):
    assert_openai_error(http.post("/v1/chat/completions", json=_greedy(**{"tools": TOOLS, **fields})), 400,
                        param=param)


def test_langchain_binds_tools_and_gets_structured_output_through_a_call(hermes_server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather asked about."""

        city: str = Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    chat = ChatOpenAI(base_url=f"{hermes_server.base_url}/v1", api_key="unused", model="tiny", temperature=0,
                      max_completion_tokens=120, max_retries=0, timeout=HTTP_TIMEOUT_S)
    message = chat.bind_tools(TOOLS, tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    # with_structured_output's function-calling method forces one named call and parses its arguments.
    weather = chat.with_structured_output(Weather, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(weather, Weather) and len(weather.city) <= 12


def test_litellm_gets_tool_calls(hermes_server):
    # Without it, importing litellm fetches a price list from the network.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    response = litellm.completion(
        model="hosted_vllm/tiny", api_base=f"{hermes_server.base_url}/v1", api_key="unused", messages=MESSAGES,
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        max_tokens=120, timeout=HTTP_TIMEOUT_S,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
