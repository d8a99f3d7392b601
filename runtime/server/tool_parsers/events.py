"""What a tool-call parser makes of generated text: content, and tool calls arriving in pieces.

A parser is fed the text of a choice as it is generated and answers with events; `finish` is
called once at the end. The non-streaming answer is the same events collected, so a streamed
reply and a complete one cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call's name is known; its arguments follow as ArgumentsDelta events."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = Content | ToolCallStart | ArgumentsDelta


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


@dataclass
class ParsedOutput:
    """A whole choice's text after parsing: its content (None when empty) and its tool calls."""

    content: str | None
    tool_calls: list[ParsedCall] = field(default_factory=list)


def append(events: list[Event], event: Event) -> None:
    """Adds `event`, merged into the last one where both are text of the same kind (fewer, larger deltas)."""
    last = events[-1] if events else None
    if isinstance(event, Content) and isinstance(last, Content):
        events[-1] = Content(last.text + event.text)
    elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index:
        events[-1] = ArgumentsDelta(event.index, last.text + event.text)
    else:
        events.append(event)


def collect(events: list[Event]) -> ParsedOutput:
    content: list[str] = []
    calls: list[ParsedCall] = []
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls.append(ParsedCall(event.name))
        else:
            calls[event.index].arguments += event.text
    return ParsedOutput("".join(content) or None, calls)


def parse_all(parser: ToolParser, text: str) -> ParsedOutput:
    return collect(parser.feed(text) + parser.finish())
