"""Tool-call parsers for `tool_choice: "auto"`, by the names `--tool-call-parser` takes (vLLM's).

Each parser is a small module that turns generated text into content and tool calls,
incrementally (events.py); forced.py reads what `required` and named choices constrain.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpilot.runtime.server.tool_parsers.events import ToolParser
from kvpilot.runtime.server.tool_parsers.hermes import HermesToolParser
from kvpilot.runtime.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
