"""StructuredOutputsParams: exactly one kind, checked values, and the trip to the engine core intact."""

import msgspec
import pytest

from kvpilot.runtime.engine.messages import EngineCoreRequest
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs, kind", [
    ({"json": SCHEMA}, "json"),
    ({"json": '{"type": "string"}'}, "json"),
    ({"regex": "[a-z]+"}, "regex"),
    ({"choice": ["yes", "no"]}, "choice"),
    ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
    ({"json_object": True}, "json_object"),
])
def test_one_kind(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"json_object": False}, "got none"),
    ({"json": SCHEMA, "regex": "a"}, "got json, regex"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": "[1]"}, "must be a JSON Schema"),
    ({"regex": ""}, "regex must not be empty"),
    ({"grammar": "  "}, "grammar must not be empty"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
])
def test_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**kwargs)


def test_key_ignores_property_order_but_not_content():
    reordered = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    assert StructuredOutputsParams(json=SCHEMA).key == StructuredOutputsParams(json=reordered).key
    assert StructuredOutputsParams(json=SCHEMA).key == StructuredOutputsParams(json=msgspec.json.encode(SCHEMA).decode()).key
    other = {**SCHEMA, "required": []}
    assert StructuredOutputsParams(json=SCHEMA).key != StructuredOutputsParams(json=other).key
    assert (StructuredOutputsParams(json=SCHEMA).key
            != StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).key)


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=["x", "y"]),
    StructuredOutputsParams(regex=r"\d+", disable_any_whitespace=True), None,
])
def test_crosses_the_socket(constraint):
    request = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=constraint))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)
    assert decoded.sampling_params.structured_outputs == constraint
    assert decoded.sampling_params.for_choice(1).structured_outputs == constraint


def test_checked_when_decoded():
    request = EngineCoreRequest("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    raw = msgspec.to_builtins(request)
    raw[2]["structured_outputs"]["json"] = SCHEMA
    with pytest.raises(msgspec.ValidationError, match="exactly one"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=EngineCoreRequest)
