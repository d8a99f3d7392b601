"""Tool-call parsers over recorded outputs: the calls a whole text holds, and the same calls however
the text is streamed (token by token as recorded, and split at every character boundary)."""

from __future__ import annotations

import json

import pytest

from kvpilot.runtime.server.tool_parsers import TOOL_PARSERS
from kvpilot.runtime.server.tool_parsers.events import (
    ArgumentsDelta,
    Content,
    ParsedCall,
    ParsedOutput,
    ToolCallStart,
    collect,
    parse_all,
)
from kvpilot.runtime.server.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from kvpilot.runtime.server.tool_parsers.hermes import HermesToolParser
from kvpilot.runtime.server.tool_parsers.llama3_json import Llama3JsonToolParser

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TRICKY_ARGS = '{"q": "a \\"quoted\\" } ] </tool_call> \\\\", "n": [1, {"deep": [true, null, -2.5e3]}]}'

# Qwen2.5-Instruct's outputs as its tokenizer split them (text per token).
RECORDED_STREAMS = {
    "one call": (
        ["<tool_call>", "\n", '{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":',
         ' {"', "city", '":', ' "', "Paris", '",', ' "', "unit", '":', ' "', "c", "elsius", '"}}', "\n",
         "</tool_call>"],
        ParsedOutput(None, [ParsedCall("get_weather", WEATHER_ARGS)]),
    ),
    "content then two calls": (
        ["I", "'ll", " check", " both", ".", "\n", "<tool_call>", "\n", '{"', "name", '":', ' "', "get",
         "_weather", '",', ' "', "arguments", '":', ' {"', "city", '":', ' "', "Paris", '",', ' "', "unit",
         '":', ' "', "c", "elsius", '"}}', "\n", "</tool_call>", "\n", "<tool_call>", "\n", '{"', "name", '":',
         ' "', "get", "_time", '",', ' "', "arguments", '":', " {}}", "\n", "</tool_call>"],
        ParsedOutput("I'll check both.", [ParsedCall("get_weather", WEATHER_ARGS), ParsedCall("get_time", "{}")]),
    ),
    "no call": (
        ["The", " weather", " in", " Paris", " is", " <", "b", ">", "mild", "</", "b", ">.", "\n"],
        ParsedOutput("The weather in Paris is <b>mild</b>.\n", []),
    ),
}

# Texts that exercise the scanner's corners, with what each must parse to.
EDGE_CASES = {
    "arguments before name": (
        f'<tool_call>{{"arguments": {WEATHER_ARGS}, "name": "get_weather"}}</tool_call>',
        ParsedOutput(None, [ParsedCall("get_weather", WEATHER_ARGS)]),
    ),
    "strings with braces, escapes and the end tag": (
        f'<tool_call>{{"name": "search", "arguments": {TRICKY_ARGS}}}</tool_call>',
        ParsedOutput(None, [ParsedCall("search", TRICKY_ARGS)]),
    ),
    "an escaped name": (
        '<tool_call>{"name": "say\\u005fhi", "arguments": {}}</tool_call>',
        ParsedOutput(None, [ParsedCall("say_hi", "{}")]),
    ),
    "no arguments key": (
        '<tool_call>{"name": "now"}</tool_call>',
        ParsedOutput(None, [ParsedCall("now", "{}")]),
    ),
    "other keys are skipped": (
        '<tool_call>{"id": 7, "name": "now", "extra": {"a": "}"}, "arguments": {"x": 1}}</tool_call>',
        ParsedOutput(None, [ParsedCall("now", '{"x": 1}')]),
    ),
    "content after a call": (
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>\n\nDone.',
        ParsedOutput("Done.", [ParsedCall("now", "{}")]),
    ),
    "a name that is no string is content": (
        'Hi <tool_call>{"name": 3}</tool_call> <tool',
        ParsedOutput('Hi <tool_call>{"name": 3}</tool_call> <tool', []),
    ),
    "a malformed block before a good one": (
        '<tool_call>not json</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>',
        ParsedOutput("<tool_call>not json</tool_call>", [ParsedCall("now", "{}")]),
    ),
    "junk after an announced call is skipped": (
        '<tool_call>{"name": "now", "arguments": {"a": 1} oops}</tool_call>ok',
        ParsedOutput("ok", [ParsedCall("now", '{"a": 1}')]),
    ),
    "arguments never closed before the end tag": (
        '<tool_call>{"name": "f", "arguments": {"a": [1, "<b>"</tool_call>\nafter',
        ParsedOutput("after", [ParsedCall("f", '{"a": [1, "<b>"')]),
    ),
    "cut off before the call is announced": (
        'So <tool_call>{"name": "get_wea',
        ParsedOutput('So <tool_call>{"name": "get_wea', []),
    ),
    "cut off inside the arguments": (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        ParsedOutput(None, [ParsedCall("get_weather", '{"city": "Par')]),
    ),
    "a tag-like text that is no tag": (
        "a <tool_calls> b <tool_cal",
        ParsedOutput("a <tool_calls> b <tool_cal", []),
    ),
}

ALL_HERMES = {name: ("".join(tokens), expected) for name, (tokens, expected) in RECORDED_STREAMS.items()}
ALL_HERMES.update(EDGE_CASES)


def _assert_same_however_split(new_parser, text: str, expected: ParsedOutput) -> None:
    """Whole, split in two at every character boundary, and a character at a time."""
    assert parse_all(new_parser(), text) == expected
    for cut in range(len(text) + 1):
        assert _streamed(new_parser(), [text[:cut], text[cut:]]) == expected, cut
    assert _streamed(new_parser(), list(text)) == expected


def _streamed(parser, pieces: list[str]) -> ParsedOutput:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return collect(events + parser.finish())


def test_parsers_are_registered_under_vllms_names():
    assert isinstance(TOOL_PARSERS["hermes"](), HermesToolParser)
    assert isinstance(TOOL_PARSERS["llama3_json"](), Llama3JsonToolParser)


@pytest.mark.parametrize("name", ALL_HERMES)
def test_hermes_whole_text(name):
    text, expected = ALL_HERMES[name]
    assert parse_all(HermesToolParser(), text) == expected


@pytest.mark.parametrize("name", RECORDED_STREAMS)
def test_hermes_recorded_stream_gives_the_same_calls(name):
    tokens, expected = RECORDED_STREAMS[name]
    assert _streamed(HermesToolParser(), tokens) == expected


@pytest.mark.parametrize("name", ALL_HERMES)
def test_hermes_split_at_every_character_boundary(name):
    _assert_same_however_split(HermesToolParser, *ALL_HERMES[name])


def test_hermes_events_come_in_openais_order():
    tokens, _ = RECORDED_STREAMS["content then two calls"]
    parser = HermesToolParser()
    events = [event for token in tokens for event in parser.feed(token)] + parser.finish()
    kinds = [(type(e).__name__, e.index if not isinstance(e, Content) else None) for e in events]
    # Content first; each call opens with its name, then only argument fragments of that call.
    first_start = kinds.index(("ToolCallStart", 0))
    assert all(kind == "Content" for kind, _ in kinds[:first_start])
    second_start = kinds.index(("ToolCallStart", 1))
    assert {k for k in kinds[first_start + 1:second_start]} == {("ArgumentsDelta", 0)}
    assert {k for k in kinds[second_start + 1:]} == {("ArgumentsDelta", 1)}
    # Arguments stream as they are generated: the first call's arrive in many pieces.
    assert sum(1 for k in kinds if k == ("ArgumentsDelta", 0)) > 5


def test_hermes_holds_back_only_what_may_be_a_tag():
    parser = HermesToolParser()
    assert parser.feed("Hello <tool") == [Content("Hello")]
    assert parser.feed("box>") == [Content(" <toolbox>")]
    assert parser.feed(" and\n") == [Content(" and")]
    assert parser.feed("<tool_call>") == []
    assert parser.feed('{"name": "f", "arguments": {"a"') == [ToolCallStart(0, "f"), ArgumentsDelta(0, '{"a"')]


REQUIRED = '[{"name": "get_weather", "parameters": ' + WEATHER_ARGS + '}, {"parameters": {}, "name": "get_time"}]'


@pytest.mark.parametrize("text, expected", [
    (REQUIRED, [ParsedCall("get_weather", WEATHER_ARGS), ParsedCall("get_time", "{}")]),
    (' [ {"name": "search", "parameters": ' + TRICKY_ARGS + "} ]", [ParsedCall("search", TRICKY_ARGS)]),
    ('[{"name": "get_weather", "parameters": {"city": "Pa', [ParsedCall("get_weather", '{"city": "Pa')]),
])
def test_required_calls_array_streamed_like_whole(text, expected):
    _assert_same_however_split(RequiredCallsParser, text, ParsedOutput(None, expected))


def test_named_function_output_is_its_arguments():
    assert parse_all(NamedFunctionParser("get_weather"), WEATHER_ARGS) == ParsedOutput(
        None, [ParsedCall("get_weather", WEATHER_ARGS)])
    assert _streamed(NamedFunctionParser("f"), ["", '{"a"', ": 1}"]) == ParsedOutput(None, [ParsedCall("f", '{"a": 1}')])
    assert json.loads(parse_all(NamedFunctionParser("f"), "{}").tool_calls[0].arguments) == {}


# Llama 3.1-Instruct's JSON calls, as its tokenizer split them (<|python_tag|> is one token).
LLAMA3_RECORDED = (
    ["<|python_tag|>", '{"', "name", '":', ' "', "get", "_weather", '",', ' "', "parameters", '":', ' {"', "city",
     '":', ' "', "Paris", '",', ' "', "unit", '":', ' "', "c", "elsius", '"}}', "; ", '{"', "name", '":', ' "',
     "get", "_time", '",', ' "', "parameters", '":', " {}}"],
    ParsedOutput(None, [ParsedCall("get_weather", WEATHER_ARGS), ParsedCall("get_time", "{}")]),
)
LLAMA3_CASES = {
    "recorded": ("".join(LLAMA3_RECORDED[0]), LLAMA3_RECORDED[1]),
    "no tag, arguments key, nested strings": (
        f'{{"name": "search", "arguments": {TRICKY_ARGS}}}',
        ParsedOutput(None, [ParsedCall("search", TRICKY_ARGS)]),
    ),
    "text is content, braces and all": ("Use {x} here.", ParsedOutput("Use {x} here.", [])),
    "part of the tag is content": ("<|python", ParsedOutput("<|python", [])),
    "a malformed first call is content": (' {"name": 1}; x', ParsedOutput(' {"name": 1}; x', [])),
    "after a good call the rest is dropped": (
        '{"name": "get_time", "parameters": {}} and more',
        ParsedOutput(None, [ParsedCall("get_time", "{}")]),
    ),
    "cut off inside the parameters": (
        '{"name": "get_weather", "parameters": {"city": "Par',
        ParsedOutput(None, [ParsedCall("get_weather", '{"city": "Par')]),
    ),
}


def test_llama3_recorded_stream_gives_the_same_calls():
    assert _streamed(Llama3JsonToolParser(), LLAMA3_RECORDED[0]) == LLAMA3_RECORDED[1]


@pytest.mark.parametrize("name", LLAMA3_CASES)
def test_llama3_json_whole_and_split_at_every_character_boundary(name):
    _assert_same_however_split(Llama3JsonToolParser, *LLAMA3_CASES[name])
