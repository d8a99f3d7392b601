"""Readers of the output a forced tool choice constrains (tool_choice `required` or a named function).

A structured-output constraint makes the model write exactly the JSON these read, so they hold no
content and need no tags: a named function's output is its arguments object, and `required` is
vLLM's array of `{"name": ..., "parameters": {...}}` calls (see tool_choice.py).
"""

from __future__ import annotations

import enum

from kvpilot.runtime.server.tool_parsers.events import ArgumentsDelta, Event, ToolCallStart, append
from kvpilot.runtime.server.tool_parsers.function_object import FunctionObjectScanner, Scan


class NamedFunctionParser:
    """Everything generated is the arguments of one call to `name`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = self._start()
        if text:
            events.append(ArgumentsDelta(0, text))
        return events

    def finish(self) -> list[Event]:
        return self._start()

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [ToolCallStart(0, self.name)]


class _Array(enum.Enum):
    BEFORE = enum.auto()
    BEFORE_ITEM = enum.auto()
    IN_ITEM = enum.auto()
    AFTER_ITEM = enum.auto()
    OVER = enum.auto()  # the closing bracket, or text that is not a call array


class RequiredCallsParser:
    """A JSON array of calls; the calls are announced and their parameters streamed as they come."""

    def __init__(self) -> None:
        self._state = _Array.BEFORE
        self._scanner: FunctionObjectScanner | None = None
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            if self._state is _Array.OVER:
                break
            self._push(ch, events)
        return events

    def finish(self) -> list[Event]:
        return []

    def _push(self, ch: str, events: list[Event]) -> None:
        state = self._state
        if state is _Array.IN_ITEM:
            scan = self._scanner.push(ch)
            for event in self._scanner.drain():
                append(events, event)
            if scan is Scan.DONE:
                self._calls += self._scanner.announced
                self._state = _Array.AFTER_ITEM
            elif scan is Scan.ERROR:
                self._state = _Array.OVER
        elif ch.isspace():
            return
        elif state is _Array.BEFORE:
            self._state = _Array.BEFORE_ITEM if ch == "[" else _Array.OVER
        elif state is _Array.BEFORE_ITEM:
            self._scanner = FunctionObjectScanner(self._calls, arguments_keys=("parameters",))
            self._state = _Array.IN_ITEM
            self._push(ch, events)
        elif ch == ",":
            self._state = _Array.BEFORE_ITEM
        else:
            self._state = _Array.OVER
