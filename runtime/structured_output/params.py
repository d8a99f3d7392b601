"""What a request asks its output to match: vLLM's StructuredOutputsParams.

Pure data, checked on construction, with no grammar engine behind it: it crosses the ZMQ socket
inside SamplingParams (msgspec encodes the dataclass) and is compiled in the engine core.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

# The constraint kinds, in vLLM's field names; exactly one is set per request.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output tokens; set exactly one of the five kinds.

    - `json`: a JSON Schema (a dict, or its JSON text); the output is one JSON value that
      validates against it. This is how to ask for "the output must match this schema", e.g.
      ``SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))``.
      Objects admit no properties the schema does not name (OpenAI's strict mode).
    - `regex`: the output matches the regular expression as a whole.
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a context-free grammar, in EBNF (llama.cpp's GBNF, with a `root` rule) or in Lark
      (llguidance's dialect, with a `start` rule).
    - `json_object`: True for any JSON object (OpenAI's `response_format: json_object`).

    `disable_any_whitespace` (vLLM's name) emits compact JSON, with no whitespace between tokens;
    by default up to 20 whitespace characters may separate two JSON tokens (enough to indent).

    Once the grammar is complete only an end-of-sequence token is allowed, and the request
    finishes with finish_reason "stop" when it is sampled. The frontend refuses a schema the grammar
    engine cannot enforce (an HTTP 400 naming the feature) before the request reaches the engine.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured outputs json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured outputs json must be a JSON Schema (an object)")
        if self.regex == "" or self.grammar is not None and not self.grammar.strip():
            raise ValueError(f"structured outputs {self.kind} must not be empty")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which of the five kinds this is."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def json_schema(self) -> Any:
        """The `json` schema as a Python value (parsed when it came as text)."""
        return _json.loads(self.json) if isinstance(self.json, str) else self.json

    @property
    def key(self) -> tuple[str, str, bool]:
        """Equal for equal constraints (a schema's key order does not matter): the compile cache's key."""
        kind = self.kind
        if kind == "json":
            spec = _json.dumps(self.json_schema, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace
