"""A StructuredOutputsParams as an llguidance grammar, and the check that the grammar is one
llguidance can enforce.

llguidance (no torch, no tokenizer needed for this part) runs in both processes: the API server
checks each constraint here before the request is queued, so an unsupported schema feature is a
400 naming it; the engine core compiles the same grammar text against the tokenizer.
"""

from __future__ import annotations

import json

import llguidance

from kvpilot.runtime.structured_output.params import StructuredOutputsParams

# Subschema-holding keywords: a dict of schemas, one schema, or a list of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "items")

# JSON's whitespace between two tokens, bounded (xgrammar's max_whitespace_cnt does the same): a
# model can indent nine levels deep, two spaces a level, but cannot fill max_tokens with blanks,
# a known failure of small models under an unbounded whitespace rule.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


class UnsupportedGrammar(ValueError):
    """The constraint is malformed or uses a feature the grammar engine cannot enforce."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked: see `check`)."""
    kind = params.kind
    if params.disable_any_whitespace:
        options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    else:
        options = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(params.json_schema), defaults=options)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    try:
        # An EBNF (GBNF) grammar is translated to Lark; Lark itself passes through.
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as err:
        raise UnsupportedGrammar(f"structured outputs grammar: {err}") from None


def check(params: StructuredOutputsParams) -> str:
    """The grammar text; UnsupportedGrammar naming the feature or error when llguidance refuses it."""
    text = grammar_text(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise UnsupportedGrammar(f"structured outputs {params.kind} is not supported: {messages[0].strip()}")
    return text


def closed_objects(schema):
    """`schema` with `additionalProperties: false` wherever an object schema leaves it unsaid.

    Strict structured outputs (OpenAI's strict mode, xgrammar's default in vLLM) admit only the
    properties a schema names; an explicit `additionalProperties` is kept. The branches of an
    `allOf` are left open, since closing each would forbid the others' properties.
    """
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    if ("properties" in closed or closed.get("type") == "object") and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(closed.get(key), dict):
            closed[key] = closed_objects(closed[key])
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    return closed
