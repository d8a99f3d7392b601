"""The streamed chunks' bytes: a text-only chunk from its template is the chunk pydantic renders."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import BaseModel

from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.server.chat import ChatFormat
from kvpilot.runtime.server.completions import CompletionFormat
from kvpilot.runtime.server.serving import TextChunks, sse_event

TEXTS = ["Hello", " world", 'a "quoted" \\ back\\slash', "tab\there\nnewline\r\x00\x1f\x7f", "héllo wörld",
         "日本語のテキスト", "emoji 🙂👍🏽", "\u2028\u2029 separators", "</script>&<>'", "\ufffd", " "]


def _output(index: int, text: str, **fields) -> StreamOutput:
    values = dict(request_id="r", index=index, text=text, token_ids=[7], logprobs=None, finish_reason=None,
                  stop_reason=None, num_prompt_tokens=3, num_output_tokens=1, num_cached_tokens=0)
    return StreamOutput(**{**values, **fields})


FORMATS = {
    "completions": lambda: CompletionFormat("cmpl-0123", "tiny", num_logprobs=None),
    "chat": lambda: ChatFormat("chatcmpl-0123", "tiny", n=3, top_logprobs=None),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_template_events_equal_pydantic_renderings(name):
    response_format = FORMATS[name]()
    chunks = TextChunks(response_format.chunk)
    for index in (0, 2, 1):
        for text in TEXTS:
            output = _output(index, text)
            assert response_format.text_only(output)
            assert chunks.event(output) == sse_event(response_format.chunk(output))


def test_what_is_not_text_only():
    completions = CompletionFormat("cmpl-0123", "tiny", num_logprobs=None)
    assert not completions.text_only(_output(0, "x", finish_reason="length"))
    assert not completions.text_only(_output(0, "x", prompt_logprobs=[None]))
    logprobs = [{7: Logprob(-0.5, 1, "x")}]
    assert not CompletionFormat("cmpl-0123", "tiny", num_logprobs=1).text_only(_output(0, "x", logprobs=logprobs))
    chat = ChatFormat("chatcmpl-0123", "tiny", n=1, top_logprobs=None)
    # An empty delta is `{}`, not `{"content": ""}`.
    assert not chat.text_only(_output(0, ""))
    assert not chat.text_only(_output(0, "x", finish_reason="stop", stop_reason="x"))
    assert not ChatFormat("chatcmpl-0123", "tiny", n=1, top_logprobs=0).text_only(_output(0, "x", logprobs=logprobs))


def test_sse_event_is_pydantics_json():
    chunk = CompletionFormat("cmpl-0123", "tiny", num_logprobs=None).chunk(_output(0, "é\n"))
    assert sse_event(chunk) == f"data: {chunk.model_dump_json()}\n\n".encode()


def test_msgspec_escapes_every_code_point_as_pydantic_does():
    class Text(BaseModel):
        text: str

    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    assert Text(text=every).model_dump_json().encode() == b'{"text":' + msgspec.json.encode(every) + b"}"


def test_templates_are_per_choice():
    response_format = ChatFormat("chatcmpl-0123", "tiny", n=2, top_logprobs=None)
    chunks = TextChunks(response_format.chunk)
    first, second = chunks.event(_output(0, "a")), chunks.event(_output(1, "a"))
    assert b'"index":0' in first and b'"index":1' in second
    assert chunks.event(_output(1, "b")) == sse_event(response_format.chunk(_output(1, "b")))
