"""POST /v1/chat/completions: messages rendered with the model's chat template, a reply out."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.server.chat_template import ChatTemplate
from kvpilot.runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kvpilot.runtime.server.serving import Choice, Serving, logprob_value, new_request_id, sampled_logprobs


async def create_chat_completion(body: ChatCompletionRequest, http_request: Request, serving: Serving,
                                 template: ChatTemplate) -> Response:
    serving.check_model(body.model)
    prompt_token_ids = await serving.chat_prompt_token_ids(
        template, body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    request_id = new_request_id("chatcmpl")
    request = serving.engine_request(
        body, prompt_token_ids, prompt_param="messages", max_tokens=body.max_new_tokens,
        logprobs=body.num_logprobs, tenant=http_request.state.tenant, request_id=request_id,
        structured_outputs=await serving.structured_outputs(body),
    )
    response_format = ChatFormat(request_id, serving.model_name, body.n, body.num_logprobs)
    return await serving.respond(http_request, request, response_format, stream=body.stream,
                                 include_usage=body.include_usage)


class ChatFormat:
    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int | None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        # None: no logprobs; otherwise how many alternatives to list per token.
        self.top_logprobs = top_logprobs

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        content = []
        for sampled, candidates in sampled_logprobs(token_ids, logprobs or []):
            ranked = sorted(candidates.values(), key=lambda c: c.rank)
            content.append(TokenLogprob(
                **_top_logprob(sampled).model_dump(),
                top_logprobs=[_top_logprob(c) for c in ranked if c.rank <= self.top_logprobs],
            ))
        return ChatLogprobs(content=content)

    def opening_chunks(self) -> list[ChatCompletionChunk]:
        # OpenAI opens every choice with the speaker's role.
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.n)]

    def chunk(self, output: StreamOutput) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(
            index=output.index, delta=ChatDelta(content=output.text or None),
            logprobs=self._logprobs(output.token_ids, output.logprobs),
            finish_reason=output.finish_reason, stop_reason=output.stop_reason,
        )])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, usage=usage,
            choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                logprobs=self._logprobs(c.token_ids, c.logprobs),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                     for c in choices],
        )


def _top_logprob(entry: Logprob) -> TopLogprob:
    token = entry.decoded_token or ""
    return TopLogprob(token=token, logprob=logprob_value(entry), bytes=list(token.encode()))
