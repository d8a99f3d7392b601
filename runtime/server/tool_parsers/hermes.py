"""The `hermes` parser: tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

The format of Hermes 2 Pro, Qwen2.5 and Qwen3 templates (vLLM's `hermes` parser reads the same).
Text outside the blocks is content; whitespace that only separates content from a block is
dropped. A block that turns out malformed before its call is announced is content, tags
included; once announced, a call stands, and the rest of its block up to `</tool_call>` is
skipped. Text that might still become a tag is held back until the next characters tell.
"""

from __future__ import annotations

import enum

from kvpilot.runtime.server.tool_parsers.events import Content, Event, ToolCallStart, append
from kvpilot.runtime.server.tool_parsers.function_object import FunctionObjectScanner, Scan

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


class _Mode(enum.Enum):
    CONTENT = enum.auto()
    BLOCK = enum.auto()  # inside <tool_call>, reading the JSON object
    TO_END = enum.auto()  # after the object (or a malformed rest), up to </tool_call>


class HermesToolParser:
    def __init__(self) -> None:
        self._mode = _Mode.CONTENT
        self._held = ""  # content or tag text that cannot be judged yet
        self._after_block = False  # whitespace right after a block is dropped
        self._calls = 0
        self._scanner: FunctionObjectScanner | None = None
        self._block: list[str] = []  # the block's raw text (whitespace before it first), for a malformed one

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            if self._mode is _Mode.CONTENT:
                text = self._content(text, events)
            elif self._mode is _Mode.BLOCK:
                text = self._object(text, events)
            else:
                text = self._to_end(text)
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._mode is _Mode.CONTENT and self._held:
            events.append(Content(self._held))
        elif self._mode is _Mode.BLOCK and not self._scanner.announced:
            # Cut off before its call was announced: what the model wrote stays as it wrote it.
            events.append(Content("".join(self._block)))
        self._held = ""
        return events

    def _content(self, text: str, events: list[Event]) -> str:
        if self._after_block:
            text = text.lstrip()
            if not text:
                return ""
            self._after_block = False
        text, self._held = self._held + text, ""
        start = text.find(TOOL_CALL_START)
        if start >= 0:
            head = text[:start].rstrip()
            _emit(events, head)
            self._mode, self._block = _Mode.BLOCK, [text[len(head):start], TOOL_CALL_START]
            self._scanner = FunctionObjectScanner(self._calls, arguments_keys=("arguments",))
            return text[start + len(TOOL_CALL_START):]
        # Hold back a possible start of the tag, and the whitespace before it.
        cut = len(text) - _partial_tag(text, TOOL_CALL_START)
        head = text[:cut].rstrip()
        _emit(events, head)
        self._held = text[len(head):]
        return ""

    def _object(self, text: str, events: list[Event]) -> str:
        scanner = self._scanner
        for position, ch in enumerate(text):
            scan = scanner.push(ch)
            if scan is Scan.ERROR and not scanner.announced:
                events.append(Content("".join(self._block)))
                self._mode = _Mode.CONTENT
                return text[position:]
            self._block.append(ch)
            self._collect(events)
            if scan is not Scan.MORE:
                self._mode = _Mode.TO_END
                return text[position + (scan is Scan.DONE):]
        return ""

    def _collect(self, events: list[Event]) -> None:
        for event in self._scanner.drain():
            if isinstance(event, ToolCallStart):
                self._calls += 1
            append(events, event)

    def _to_end(self, text: str) -> str:
        text, self._held = self._held + text, ""
        end = text.find(TOOL_CALL_END)
        if end >= 0:
            self._mode, self._after_block = _Mode.CONTENT, True
            return text[end + len(TOOL_CALL_END):]
        # Whatever stands between the object and its end tag is dropped.
        self._held = text[len(text) - _partial_tag(text, TOOL_CALL_END):]
        return ""


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _emit(events: list[Event], text: str) -> None:
    if text:
        events.append(Content(text))
