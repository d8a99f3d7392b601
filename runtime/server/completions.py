"""POST /v1/completions: a prompt (text or token ids) in, text out, in OpenAI's legacy shape."""

from __future__ import annotations

import time
from collections import defaultdict

from fastapi import Request
from fastapi.responses import Response

from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.server.errors import bad_request
from kvpilot.runtime.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    Usage,
)
from kvpilot.runtime.server.serving import Choice, Serving, logprob_value, new_request_id, sampled_logprobs


async def create_completion(body: CompletionRequest, http_request: Request, serving: Serving) -> Response:
    serving.check_model(body.model)
    if isinstance(body.prompt, str):
        if not body.prompt:
            # Not left to the tokenizer: the BOS it adds would make an empty prompt look non-empty.
            raise bad_request("prompt is empty: it must have at least one character", "prompt")
        prompt_token_ids = await serving.prompt_token_ids(body.prompt, add_special_tokens=True, param="prompt")
    else:
        prompt_token_ids = list(body.prompt)
    request_id = new_request_id("cmpl")
    request = serving.engine_request(
        body, prompt_token_ids, prompt_param="prompt", max_tokens=body.max_tokens, logprobs=body.logprobs,
        tenant=http_request.state.tenant, request_id=request_id,
        structured_outputs=await serving.structured_outputs(body),
    )
    response_format = CompletionFormat(request_id, serving.model_name, body.logprobs is not None)
    return await serving.respond(http_request, request, response_format, stream=body.stream,
                                 include_usage=body.include_usage, continuous_usage=body.continuous_usage)


class CompletionFormat:
    def __init__(self, request_id: str, model: str, with_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.with_logprobs = with_logprobs
        # Per choice: where the next token's text starts (text_offset).
        self._offsets: dict[int, int] = defaultdict(int)

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None
                  ) -> CompletionLogprobs | None:
        if not self.with_logprobs:
            return None
        result = CompletionLogprobs()
        for sampled, candidates in sampled_logprobs(token_ids, logprobs or []):
            token = sampled.decoded_token or ""
            result.tokens.append(token)
            result.token_logprobs.append(logprob_value(sampled))
            top: dict[str, float] = {}
            # Tokens can decode to the same text (partial UTF-8 is all "\ufffd"): keep the likeliest.
            for candidate in sorted(candidates.values(), key=lambda c: c.rank):
                top.setdefault(candidate.decoded_token or "", logprob_value(candidate))
            result.top_logprobs.append(top)
            result.text_offset.append(self._offsets[index])
            self._offsets[index] += len(token)
        return result

    @staticmethod
    def _prompt_logprobs(entries: list[dict[int, Logprob] | None] | None) -> list[dict[str, PromptLogprob] | None] | None:
        if entries is None:
            return None
        return [None if entry is None else {
            str(token): PromptLogprob(logprob=logprob_value(lp), rank=lp.rank, decoded_token=lp.decoded_token or "")
            for token, lp in entry.items()
        } for entry in entries]

    def opening_chunks(self) -> list[CompletionResponse]:
        return []

    def text_only(self, output: StreamOutput) -> bool:
        return not self.with_logprobs and output.prompt_logprobs is None and not output.finished

    def chunk(self, output: StreamOutput) -> CompletionResponse:
        return self._response([CompletionChoice(
            index=output.index, text=output.text,
            logprobs=self._logprobs(output.index, output.token_ids, output.logprobs),
            finish_reason=output.finish_reason, stop_reason=output.stop_reason,
            prompt_logprobs=self._prompt_logprobs(output.prompt_logprobs),
        )])

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._response([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> CompletionResponse:
        return self._response([
            CompletionChoice(index=c.index, text=c.text, logprobs=self._logprobs(c.index, c.token_ids, c.logprobs),
                             finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                             prompt_logprobs=self._prompt_logprobs(c.prompt_logprobs))
            for c in choices
        ], usage)
