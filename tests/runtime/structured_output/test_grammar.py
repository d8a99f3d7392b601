"""What the frontend checks before a grammar reaches the engine: every supported constraint passes,
every unsupported feature is refused by name; objects are closed unless the schema opens them."""

import pytest

from kvpilot.runtime.structured_output.grammar import UnsupportedGrammar, check, closed_objects
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

from schemas import SCHEMAS


@pytest.mark.parametrize("schema", [s for s, _ in SCHEMAS])
def test_the_test_schemas_are_supported(schema):
    assert check(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"[a-z]{3}-\d{2}"),
    StructuredOutputsParams(choice=['say "hi"', "back\\slash", "plain"]),
    StructuredOutputsParams(grammar='root ::= "(" digit+ ")"\ndigit ::= [0-9]'),
    StructuredOutputsParams(json='{"type": "array", "items": {"type": "string"}}', disable_any_whitespace=True),
])
def test_other_kinds_are_supported(params):
    assert check(params)


@pytest.mark.parametrize("params, named", [
    (StructuredOutputsParams(json={"type": "bogus"}), "bogus"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputsParams(json={"type": "array", "contains": {"const": 1}}), "contains"),
    (StructuredOutputsParams(json={"type": "object", "propertyNames": {"maxLength": 3}}), "propertyNames"),
    (StructuredOutputsParams(json={"if": {"type": "string"}, "then": {"maxLength": 3}}), "if"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "(?=a)a"}), "look-around"),
    (StructuredOutputsParams(regex="(unclosed"), "unclosed group"),
    (StructuredOutputsParams(grammar="root ::= missing"), "missing"),
])
def test_unsupported_features_are_named(params, named):
    with pytest.raises(UnsupportedGrammar, match=named) as raised:
        check(params)
    assert str(raised.value).startswith(f"structured outputs {params.kind}")


def test_objects_are_closed_unless_the_schema_opens_them():
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "additionalProperties": True},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "either": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            "data": {"const": {"type": "object"}},
        },
        "$defs": {"d": {"type": "object"}},
        "allOf": [{"properties": {"z": {}}}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["inner"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    # Data, not a schema; and allOf branches stay open so they can combine.
    assert props["data"] == {"const": {"type": "object"}}
    assert closed["allOf"] == [{"properties": {"z": {}}}]
    # The caller's schema is left as it was.
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["inner"]
