"""POST /v1/chat/completions: messages rendered with the model's chat template, a reply out."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.server.chat_template import ChatTemplate
from kvpilot.runtime.server.errors import bad_request
from kvpilot.runtime.server.protocol import (
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
from kvpilot.runtime.server.resume import refuse_resume_with
from kvpilot.runtime.server.serving import Choice, Serving, logprob_value, new_request_id, sampled_logprobs
from kvpilot.runtime.server.tool_use import StreamedCalls, ToolSettings, ToolUse, assistant_message, tool_use
from kvpilot.runtime.server.tool_use import finish_reason as tool_finish_reason
from kvpilot.runtime.structured_output.params import StructuredOutputsParams


async def create_chat_completion(body: ChatCompletionRequest, http_request: Request, serving: Serving,
                                 template: ChatTemplate, tool_settings: ToolSettings) -> Response:
    lora_request = serving.check_model(body.model, http_request.state.tenant)
    refuse_resume_with(body, {"tools": bool(body.tools), "echo": body.echo})
    tools = tool_use(body, tool_settings)
    prompt_token_ids = await serving.chat_prompt_token_ids(
        template, body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, tools=tools.tools,
    )
    structured_outputs = await _constraint(body, tools, serving)
    request_id = new_request_id("chatcmpl")
    request = serving.engine_request(
        body, prompt_token_ids, prompt_param="messages", max_tokens=body.max_new_tokens,
        logprobs=body.num_logprobs, tenant=http_request.state.tenant, request_id=request_id,
        structured_outputs=structured_outputs, lora_request=lora_request,
    )
    model_name = serving.model_name if lora_request is None else lora_request.lora_name
    response_format = ChatFormat(request_id, model_name, body.n, body.num_logprobs, tools,
                                 echoed=body.echoed_text,
                                 prompt_token_ids=prompt_token_ids if body.return_token_ids else None)
    return await serving.respond(http_request, request, response_format, stream=body.stream,
                                 include_usage=body.include_usage, continuous_usage=body.continuous_usage)


async def _constraint(body: ChatCompletionRequest, tools: ToolUse, serving: Serving
                      ) -> StructuredOutputsParams | None:
    """The request's own structured-output constraint, or the one a forced tool choice makes; not both."""
    requested = await serving.structured_outputs(body)
    if tools.structured_outputs is None:
        return requested
    if requested is not None:
        raise bad_request("You can only either use structured outputs or a tool_choice that forces calls "
                          "(required, or a named function), not both.", "tool_choice")
    await serving.check_structured_outputs(tools.structured_outputs, "tools")
    return tools.structured_outputs


class ChatFormat:
    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int | None,
                 tools: ToolUse = ToolUse(), echoed: str = "", prompt_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.n = n
        # None: no logprobs; otherwise how many alternatives to list per token.
        self.top_logprobs = top_logprobs
        self.tools = tools
        # What each choice's content starts with (the request's echo), never seen by the tool parser.
        self.echoed = echoed
        # When the client asked for token ids (return_token_ids); None otherwise.
        self.prompt_token_ids = prompt_token_ids
        # Per streamed choice, where tool calls are read from its text.
        self._calls: dict[int, StreamedCalls] = {}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
               prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=choices, usage=usage, prompt_token_ids=prompt_token_ids)

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
        # OpenAI opens every choice with the speaker's role; an echo follows it, as in vLLM.
        chunks = [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))],
                              prompt_token_ids=self.prompt_token_ids)
                  for i in range(self.n)]
        if self.echoed:
            chunks += [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=self.echoed))])
                       for i in range(self.n)]
        return chunks

    def text_only(self, output: StreamOutput) -> bool:
        # An empty delta renders without its content: not a template's shape. A tool parser reads
        # every piece of text, so its requests never take the template path.
        return (self.tools.parser is None and self.top_logprobs is None and bool(output.text)
                and not output.finished and self.prompt_token_ids is None)

    def chunk(self, output: StreamOutput) -> ChatCompletionChunk | None:
        if self.tools.parser is None:
            delta, finish_reason = ChatDelta(content=output.text or None), output.finish_reason
        else:
            calls = self._calls.setdefault(output.index, StreamedCalls(self.tools))
            content, tool_calls = calls.delta(output.text, output.finished)
            if (content is None and tool_calls is None and not output.finished and self.top_logprobs is None
                    and self.prompt_token_ids is None):
                # Text the parser holds back: an empty delta would tell the client nothing (vLLM sends
                # none), unless it carries the tokens' logprobs or ids.
                return None
            delta = ChatDelta(content=content, tool_calls=tool_calls)
            finish_reason = tool_finish_reason(output.finish_reason, calls.called, self.tools)
        return self._chunk([ChatChunkChoice(
            index=output.index, delta=delta, logprobs=self._logprobs(output.token_ids, output.logprobs),
            finish_reason=finish_reason, stop_reason=output.stop_reason, token_ids=self._token_ids(output.token_ids),
        )])

    def _token_ids(self, token_ids: list[int]) -> list[int] | None:
        return token_ids if self.prompt_token_ids is not None else None

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, usage=usage,
            choices=[self._choice(c) for c in choices], prompt_token_ids=self.prompt_token_ids,
        )

    def _choice(self, choice: Choice) -> ChatChoice:
        message, called = assistant_message(choice.text, self.tools)
        if self.echoed:
            message.content = self.echoed + (message.content or "")
        return ChatChoice(index=choice.index, message=message,
                          logprobs=self._logprobs(choice.token_ids, choice.logprobs),
                          finish_reason=tool_finish_reason(choice.finish_reason, called, self.tools),
                          stop_reason=choice.stop_reason, token_ids=self._token_ids(choice.token_ids))


def _top_logprob(entry: Logprob) -> TopLogprob:
    token = entry.decoded_token or ""
    return TopLogprob(token=token, logprob=logprob_value(entry), bytes=list(token.encode()))
