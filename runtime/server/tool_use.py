"""A chat request's tools: what the template sees, what constrains the output, and how it is read back.

vLLM's semantics: `tool_choice: "auto"` lets the model choose and a tool-call parser (the
server's `--tool-call-parser`, enabled by `--enable-auto-tool-choice`) finds the calls in the text;
without both flags, "auto" is refused. `"required"` and a named function are guaranteed: the
output is constrained by a JSON schema (structured outputs) that only admits the calls, and read
with the readers in tool_parsers/forced.py. `"none"` shows the tools to the template and reads no
calls.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.runtime.server.errors import bad_request
from kvpilot.runtime.server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatTool,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from kvpilot.runtime.server.tool_parsers import TOOL_PARSERS
from kvpilot.runtime.server.tool_parsers.events import Content, Event, ToolCallStart, ToolParser, collect
from kvpilot.runtime.server.tool_parsers.forced import NamedFunctionParser, RequiredCallsParser
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
# What a function without parameters is called with.
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The server's flags (not engine settings: the engine never sees a tool)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None


@dataclass(frozen=True)
class ToolUse:
    """One request's tools; `parser` is None where no calls are read (no tools, or tool_choice "none")."""

    tools: list[dict] | None = None
    parser: Callable[[], ToolParser] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Where calls were made the choice finishes with this (auto and required, as OpenAI answers).
    finish_reason: str | None = None
    # OpenAI's parallel_tool_calls=false: only the first call counts.
    max_calls: int | None = None


def tool_use(body: ChatCompletionRequest, settings: ToolSettings) -> ToolUse:
    """The request's tools as the server's settings allow them; 400 for a choice they do not."""
    if body.tools is None:
        return ToolUse()
    tools = [tool.as_template_input() for tool in body.tools]
    choice = body.tool_choice
    max_calls = None if body.parallel_tool_calls else 1
    if choice == "none":
        return ToolUse(tools)
    if choice == "auto":
        if not settings.enable_auto_tool_choice or settings.tool_call_parser is None:
            raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolUse(tools, TOOL_PARSERS[settings.tool_call_parser], finish_reason="tool_calls",
                       max_calls=max_calls)
    if choice == "required":
        schema = required_calls_schema(body.tools, max_calls)
        return ToolUse(tools, RequiredCallsParser, _forced(schema), finish_reason="tool_calls", max_calls=max_calls)
    function = body.named_tool
    return ToolUse(tools, lambda: NamedFunctionParser(function.name), _forced(_parameters(function.parameters)))


def _forced(schema: dict) -> StructuredOutputsParams:
    # Calls are read by programs, so their JSON is compact: the grammar leaves the model no blank
    # space to wander into between tokens (a weak model otherwise can, up to max_tokens).
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def required_calls_schema(tools: list[ChatTool], max_calls: int | None = None) -> dict:
    """vLLM's schema for `required`: a non-empty array of `{"name": <a tool>, "parameters": <its schema>}`.

    `$defs` move to the root, where the parameters' `#/$defs/...` references now point.
    """
    alternatives, defs = [], {}
    for tool in tools:
        parameters = _parameters(tool.function.parameters)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request(f"Tool definition {name!r} has multiple schemas, which is not supported.", "tools")
        # "type" sits in each alternative, not beside anyOf: objects admit only the properties
        # their own schema names, and an object schema naming none would admit no call at all.
        alternatives.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(parameters: dict | None) -> dict:
    # A copy: the schema is edited ($defs moved) and must not change the request's tools.
    return copy.deepcopy(parameters) if parameters is not None else dict(NO_PARAMETERS)


def new_tool_call_id() -> str:
    # vLLM's form of a random call id.
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def assistant_message(text: str, tool_use: ToolUse) -> tuple[AssistantMessage, bool]:
    """A whole choice's message, and whether it made calls."""
    if tool_use.parser is None:
        return AssistantMessage(content=text), False
    parser = tool_use.parser()
    parsed = collect(_within(parser.feed(text) + parser.finish(), tool_use.max_calls))
    if not parsed.tool_calls:
        return AssistantMessage(content=parsed.content or ""), False
    calls = [ToolCall(id=new_tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
             for call in parsed.tool_calls]
    return AssistantMessage(content=parsed.content, tool_calls=calls), True


class StreamedCalls:
    """One streamed choice: its text in, content and OpenAI tool-call deltas out."""

    def __init__(self, tool_use: ToolUse) -> None:
        self.parser = tool_use.parser()
        self.max_calls = tool_use.max_calls
        self.called = False

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[ToolCallDelta] | None]:
        events = self.parser.feed(text)
        if finished:
            events += self.parser.finish()
        content, calls = [], []
        for event in _within(events, self.max_calls):
            if isinstance(event, Content):
                content.append(event.text)
            elif isinstance(event, ToolCallStart):
                self.called = True
                calls.append(ToolCallDelta(index=event.index, id=new_tool_call_id(), type="function",
                                           function=FunctionCallDelta(name=event.name, arguments="")))
            else:
                calls.append(ToolCallDelta(index=event.index, function=FunctionCallDelta(arguments=event.text)))
        return "".join(content) or None, calls or None


def _within(events: list[Event], max_calls: int | None) -> list[Event]:
    if max_calls is None:
        return events
    return [e for e in events if isinstance(e, Content) or e.index < max_calls]


def finish_reason(reason: str | None, called: bool, tool_use: ToolUse) -> str | None:
    """A choice that stopped after making calls reports "tool_calls" (one cut off keeps "length")."""
    if called and reason == "stop" and tool_use.finish_reason is not None:
        return tool_use.finish_reason
    return reason
