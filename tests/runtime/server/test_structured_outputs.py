"""Structured outputs over HTTP: every way a client can ask (OpenAI's response_format, vLLM's
structured_outputs and guided_* fields) on both routes, streamed and not, through httpx and the
official openai client on the tiny random-weight model; LangChain's with_structured_output on the
real model; and a 400 naming the field and the feature for what cannot be enforced."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server_harness import HTTP_TIMEOUT_S, assert_openai_error, sse_events

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "age", "role"]}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "<" [a-c] [a-c]? ">"'
MESSAGES = [{"role": "user", "content": "Who are you?"}]
# The random model wanders through the whitespace JSON allows between tokens (20 at most per gap).
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=HTTP_TIMEOUT_S) as client:
        yield client


def _body(route: str, **fields) -> dict:
    prompt = {"messages": MESSAGES} if route == "chat" else {"prompt": "Who are you?"}
    return {"model": "tiny", "temperature": 0, "max_tokens": MAX_TOKENS, **prompt, **fields}


def _text(http: httpx.Client, route: str, **fields) -> str:
    response = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=_body(route, **fields))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if route == "chat" else choice["text"]


ROUTES = ["chat", "completions"]


@pytest.mark.parametrize("route", ROUTES)
def test_response_format_json_schema(http, route):
    format_ = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    jsonschema.validate(json.loads(_text(http, route, response_format=format_)), PERSON)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields, check", [
    ({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
     lambda text: jsonschema.validate(json.loads(text), PERSON) or text.startswith('{"')),
    ({"guided_json": json.dumps(PERSON)}, lambda text: jsonschema.validate(json.loads(text), PERSON) or True),
    ({"structured_outputs": {"regex": REGEX}}, lambda text: re.fullmatch(REGEX, text)),
    ({"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"grammar": GRAMMAR}}, lambda text: re.fullmatch(r"<[a-c]{1,2}>", text)),
    ({"guided_grammar": GRAMMAR}, lambda text: re.fullmatch(r"<[a-c]{1,2}>", text)),
], ids=["so-json", "guided-json", "so-regex", "guided-regex", "so-choice", "guided-choice", "so-grammar",
        "guided-grammar"])
def test_vllm_fields(http, route, fields, check):
    text = _text(http, route, **fields)
    assert check(text), text


def test_json_object_and_text(http):
    # Random weights write strings without end, so only the start is the model's to choose: a
    # JSON object it must be.
    response = http.post("/v1/completions", json=_body("completions", max_tokens=8, response_format={"type": "json_object"}))
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"].lstrip().startswith("{")
    plain = _body("completions", max_tokens=8, ignore_eos=True)
    texts = [http.post("/v1/completions", json=body).json()["choices"][0]["text"]
             for body in (plain, {**plain, "response_format": {"type": "text"}})]
    assert texts[0] == texts[1]


def test_a_streamed_grammar_adds_up_to_a_valid_document(http):
    body = _body("chat", stream=True, structured_outputs={"json": PERSON, "disable_any_whitespace": True})
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events.pop() == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("fields, param, named", [
    ({"response_format": {"type": "bogus"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "bogus"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
    ({"structured_outputs": {"json": {"type": "object", "propertyNames": {"maxLength": 2}}}}, "structured_outputs",
     "propertyNames"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs", "look-around"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "structured_outputs",
     "response_format, guided_regex"),
    ({"guided_choice": []}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, None, "guided_whitespace_pattern"),
])
@pytest.mark.parametrize("route", ROUTES)
def test_what_cannot_be_enforced_is_a_400_naming_it(http, route, fields, param, named):
    response = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=_body(route, **fields))
    error = assert_openai_error(response, 400, param=param)
    assert named in error["message"], error


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)
    role: Literal["admin", "user"]


def test_the_openai_clients_parse_helper(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=HTTP_TIMEOUT_S, max_retries=0)
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                               temperature=0, max_tokens=MAX_TOKENS)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person), completion.choices[0].message.content


class Capital(BaseModel):
    """The capital city of a country."""

    country: str = Field(max_length=24)
    city: str = Field(max_length=24)
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]


def test_langchain_with_structured_output_on_the_real_model(default_server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", model="SmolLM2-135M-Instruct",
                      temperature=0, max_tokens=96, timeout=HTTP_TIMEOUT_S, max_retries=0)
    answer = chat.with_structured_output(Capital, method="json_schema").invoke("What is the capital of France?")
    assert isinstance(answer, Capital)
    # A trained model, held to the schema, answers the question.
    assert answer.city == "Paris" and answer.continent == "Europe", answer
