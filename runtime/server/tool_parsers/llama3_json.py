"""The `llama3_json` parser: Llama 3.x's JSON tool calls, `{"name": ..., "parameters": {...}}`.

As vLLM reads them: a reply that opens with a JSON object (after an optional `<|python_tag|>`)
is tool calls, several separated by `;`, with `parameters` or `arguments` for the arguments; any
other reply is content. A reply that turns out malformed before its first call is announced is
content as written; after that, what follows the last good call is dropped.
"""

from __future__ import annotations

import enum

from kvpilot.runtime.server.tool_parsers.events import Content, Event, ToolCallStart, append
from kvpilot.runtime.server.tool_parsers.function_object import FunctionObjectScanner, Scan

PYTHON_TAG = "<|python_tag|>"


class _Mode(enum.Enum):
    START = enum.auto()  # not yet known whether the reply is calls or content
    CONTENT = enum.auto()
    CALL = enum.auto()  # inside a call's object
    BETWEEN = enum.auto()  # after a call: whitespace and ";" until the next one
    OVER = enum.auto()


class Llama3JsonToolParser:
    def __init__(self) -> None:
        self._mode = _Mode.START
        self._raw: list[str] = []  # the reply so far, while it may still turn out to be content
        self._scanner: FunctionObjectScanner | None = None
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for position, ch in enumerate(text):
            if self._mode is _Mode.CONTENT:
                append(events, Content(text[position:]))
                break
            if self._mode is _Mode.OVER:
                break
            self._push(ch, events)
        return events

    def finish(self) -> list[Event]:
        if self._mode in (_Mode.START, _Mode.CALL) and not self._calls and self._raw:
            # Cut off before a call was announced: the reply stays as written.
            return [Content("".join(self._raw))]
        return []

    def _push(self, ch: str, events: list[Event]) -> None:
        if not self._calls:
            self._raw.append(ch)
        if self._mode is _Mode.START:
            self._start(events)
        elif self._mode is _Mode.CALL:
            self._call(ch, events)
        elif ch == "{":
            self._new_call(ch, events)
        elif not (ch.isspace() or ch == ";"):
            self._mode = _Mode.OVER

    def _start(self, events: list[Event]) -> None:
        head = "".join(self._raw).lstrip()
        if PYTHON_TAG.startswith(head):
            return  # nothing yet, or part of the tag
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG):].lstrip()
            if not head:
                return
        if head == "{":
            self._new_call("{", events)
        else:
            self._as_content(events)

    def _as_content(self, events: list[Event]) -> None:
        self._mode = _Mode.CONTENT
        append(events, Content("".join(self._raw)))
        self._raw = []

    def _new_call(self, ch: str, events: list[Event]) -> None:
        self._scanner = FunctionObjectScanner(self._calls, arguments_keys=("parameters", "arguments"))
        self._mode = _Mode.CALL
        self._call(ch, events)

    def _call(self, ch: str, events: list[Event]) -> None:
        scan = self._scanner.push(ch)
        for event in self._scanner.drain():
            if isinstance(event, ToolCallStart):
                self._calls += 1
                self._raw = []
            append(events, event)
        if scan is Scan.DONE:
            self._mode = _Mode.BETWEEN
        elif scan is Scan.ERROR:
            if self._calls:
                self._mode = _Mode.OVER
            else:
                self._as_content(events)
