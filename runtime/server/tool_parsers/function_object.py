"""An incremental scanner for one JSON function call, `{"name": "...", "<arguments key>": {...}}`.

It reads a character at a time, so a stream split anywhere scans the same. The name is decoded;
the arguments value is passed through as the model wrote it (OpenAI's `arguments` is a string,
which need not be valid JSON), starting as soon as the name is known. A malformed object is
reported (Scan.ERROR); what a parser makes of it depends on whether the call was announced already.
"""

from __future__ import annotations

import enum
import json

from kvpilot.runtime.server.tool_parsers.events import ArgumentsDelta, Event, ToolCallStart, append

_WHITESPACE = " \t\n\r"
_VALUE_STARTS = '{["-0123456789tfn'
# A call that names no arguments has none.
NO_ARGUMENTS = "{}"


class Scan(enum.Enum):
    MORE = "more"
    DONE = "done"  # the object's closing brace was read
    ERROR = "error"  # the character is not consumed


class _State(enum.Enum):
    BEFORE_OBJECT = enum.auto()
    BEFORE_FIRST_KEY = enum.auto()
    BEFORE_KEY = enum.auto()
    IN_KEY = enum.auto()
    BEFORE_COLON = enum.auto()
    BEFORE_VALUE = enum.auto()
    IN_NAME = enum.auto()
    IN_VALUE = enum.auto()
    AFTER_VALUE = enum.auto()


class _ValueEnd:
    """Finds where a JSON value ends, without parsing it: strings, nesting and scalars."""

    def __init__(self, first: str) -> None:
        self.depth = 1 if first in "{[" else 0
        self.in_string = first == '"'
        self.escaped = False
        self.scalar = not self.in_string and self.depth == 0
        self.done = False

    def push(self, ch: str) -> bool:
        """False when `ch` is past the value (it ends a scalar) and so not part of it."""
        if self.scalar:
            if ch in _WHITESPACE or ch in ",}]":
                self.done = True
                return False
            return True
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self.done = self.depth == 0
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


class FunctionObjectScanner:
    def __init__(self, index: int, arguments_keys: tuple[str, ...]) -> None:
        self.index = index
        # The first of these keys the object has holds the arguments.
        self.arguments_keys = arguments_keys
        self.name: str | None = None
        self.announced = False
        self._state = _State.BEFORE_OBJECT
        self._text: list[str] = []  # the key or name being read, raw
        self._key = ""
        self._value: _ValueEnd | None = None
        self._in_arguments = False
        self._seen_arguments = False
        self._held_arguments: list[str] = []  # read before the name was
        self._events: list[Event] = []

    def drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def push(self, ch: str) -> Scan:
        state = self._state
        if state is _State.IN_VALUE:
            return self._push_value(ch)
        if state in (_State.IN_KEY, _State.IN_NAME):
            return self._push_string(ch)
        if ch in _WHITESPACE:
            return Scan.MORE
        if state is _State.BEFORE_OBJECT:
            return self._to(_State.BEFORE_FIRST_KEY) if ch == "{" else Scan.ERROR
        if state in (_State.BEFORE_FIRST_KEY, _State.BEFORE_KEY):
            if ch == '"':
                self._text = []
                return self._to(_State.IN_KEY)
            return self._close() if ch == "}" and state is _State.BEFORE_FIRST_KEY else Scan.ERROR
        if state is _State.BEFORE_COLON:
            return self._to(_State.BEFORE_VALUE) if ch == ":" else Scan.ERROR
        if state is _State.BEFORE_VALUE:
            return self._start_value(ch)
        # AFTER_VALUE
        if ch == ",":
            return self._to(_State.BEFORE_KEY)
        return self._close() if ch == "}" else Scan.ERROR

    def _to(self, state: _State) -> Scan:
        self._state = state
        return Scan.MORE

    def _push_string(self, ch: str) -> Scan:
        self._text.append(ch)
        if ch != '"' or _escaped(self._text):
            return Scan.MORE
        try:
            text = json.loads('"' + "".join(self._text))
        except json.JSONDecodeError:
            return Scan.ERROR
        if self._state is _State.IN_KEY:
            self._key = text
            return self._to(_State.BEFORE_COLON)
        self.name = text
        if self._held_arguments:
            self._announce()
        return self._to(_State.AFTER_VALUE)

    def _start_value(self, ch: str) -> Scan:
        if ch not in _VALUE_STARTS:
            return Scan.ERROR
        if self._key == "name" and self.name is None:
            if ch != '"':
                return Scan.ERROR
            self._text = []
            return self._to(_State.IN_NAME)
        self._in_arguments = self._key in self.arguments_keys and not self._seen_arguments
        if self._in_arguments and self.name is not None:
            self._announce()
        self._value = _ValueEnd(ch)
        self._append_arguments(ch)
        self._state = _State.IN_VALUE
        return self._end_value() if self._value.done else Scan.MORE

    def _push_value(self, ch: str) -> Scan:
        if ch == "<" and not self._value.in_string:
            # JSON has no "<" outside a string: the model has moved on to a tag (an end tag after
            # arguments it never closed), which the arguments must not swallow.
            return Scan.ERROR
        if not self._value.push(ch):
            self._end_value()
            return self.push(ch)
        self._append_arguments(ch)
        return self._end_value() if self._value.done else Scan.MORE

    def _end_value(self) -> Scan:
        if self._in_arguments:
            self._in_arguments, self._seen_arguments = False, True
        return self._to(_State.AFTER_VALUE)

    def _append_arguments(self, ch: str) -> None:
        if not self._in_arguments:
            return
        if self.announced:
            self._emit_arguments(ch)
        else:
            self._held_arguments.append(ch)

    def _announce(self) -> None:
        self.announced = True
        self._events.append(ToolCallStart(self.index, self.name))
        if self._held_arguments:
            self._emit_arguments("".join(self._held_arguments))
            self._held_arguments = []

    def _emit_arguments(self, text: str) -> None:
        append(self._events, ArgumentsDelta(self.index, text))

    def _close(self) -> Scan:
        if self.name is None:
            return Scan.ERROR
        if not self.announced:
            self._announce()
        if not self._seen_arguments:
            self._emit_arguments(NO_ARGUMENTS)
        return Scan.DONE


def _escaped(text: list[str]) -> bool:
    """Whether the last character is escaped: an odd run of backslashes before it."""
    run = 0
    for ch in reversed(text[:-1]):
        if ch != "\\":
            break
        run += 1
    return run % 2 == 1
