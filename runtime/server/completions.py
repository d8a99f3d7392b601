"""POST /v1/completions: a prompt or a batch of prompts (text or token ids) in, text out, in OpenAI's legacy shape."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

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
from kvpilot.runtime.server.resume import refuse_resume_with
from kvpilot.runtime.server.serving import Choice, Serving, logprob_value, new_request_id, sampled_logprobs


async def create_completion(body: CompletionRequest, http_request: Request, serving: Serving) -> Response:
    lora_request = serving.check_model(body.model, http_request.state.tenant)
    prompts = body.prompts
    refuse_resume_with(body, {"a list of prompts": len(prompts) > 1, "echo": body.echo})
    # A lone prompt's n is checked with the other limits (param "n").
    if len(prompts) > 1 and len(prompts) * body.n > serving.limits.max_n:
        raise bad_request(f"{len(prompts)} prompts with n={body.n} are {len(prompts) * body.n} choices, more than "
                          f"the {serving.limits.max_n} one request may have (--max-n)", "prompt")
    prompt_token_ids = [await _prompt_token_ids(prompt, serving) for prompt in prompts]
    request_id = new_request_id("cmpl")
    # With echo, the logprobs of the prompt come first: the engine computes them.
    echo_logprobs = body.logprobs if body.echo else None
    asked = [num for num in (echo_logprobs, body.prompt_logprobs) if num is not None]
    prompt_logprobs = max(asked) if asked else None
    structured_outputs = await serving.structured_outputs(body)
    requests = [serving.engine_request(
        body, ids, prompt_param="prompt", max_tokens=body.max_tokens, logprobs=body.logprobs,
        tenant=http_request.state.tenant, request_id=request_id if len(prompts) == 1 else f"{request_id}-{index}",
        prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs, lora_request=lora_request,
    ) for index, ids in enumerate(prompt_token_ids)]
    echoed = None
    if body.echo:
        echoed = [EchoedPrompt(
            text=prompt if isinstance(prompt, str) else await serving.tokenizers.decode(ids, skip_special_tokens=False),
            token_ids=ids, first_token=await serving.tokenizers.decode(ids[:1], skip_special_tokens=False),
        ) for prompt, ids in zip(prompts, prompt_token_ids)]
    model_name = serving.model_name if lora_request is None else lora_request.lora_name
    response_format = CompletionFormat(request_id, model_name, body.logprobs, n=body.n, echoed=echoed,
                                       prompt_logprobs=body.prompt_logprobs,
                                       prompt_token_ids=prompt_token_ids if body.return_token_ids else None)
    return await serving.respond(http_request, requests, response_format, stream=body.stream,
                                 include_usage=body.include_usage, continuous_usage=body.continuous_usage)


async def _prompt_token_ids(prompt: str | list[int], serving: Serving) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    if not prompt:
        # Not left to the tokenizer: the BOS it adds would make an empty prompt look non-empty.
        raise bad_request("prompt is empty: it must have at least one character", "prompt")
    return await serving.prompt_token_ids(prompt, add_special_tokens=True, param="prompt")


@dataclass(frozen=True)
class EchoedPrompt:
    text: str
    token_ids: list[int]
    # The first token's text: it has no logprob (nothing comes before it), so the engine sends none.
    first_token: str


class CompletionFormat:
    def __init__(self, request_id: str, model: str, num_logprobs: int | None, *, n: int = 1,
                 echoed: list[EchoedPrompt] | None = None, prompt_logprobs: int | None = None,
                 prompt_token_ids: list[list[int]] | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_logprobs = num_logprobs
        self.n = n
        # Per prompt, with echo; choice i of prompt p has index p * n + i.
        self.echoed = echoed
        # What the client asked for in vLLM's `prompt_logprobs` field (the engine may compute more for echo).
        self.prompt_logprobs = prompt_logprobs
        # Per prompt, when the client asked for token ids (return_token_ids); None otherwise.
        self.prompt_token_ids = prompt_token_ids
        # Per choice: where the next token's text starts (text_offset).
        self._offsets: dict[int, int] = defaultdict(int)
        # The streamed choices whose first chunk went out.
        self._opened: set[int] = set()

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage)

    def _choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                prompt_logprobs: list[dict[int, Logprob] | None] | None, finish_reason: str | None,
                stop_reason: int | str | None, first: bool) -> CompletionChoice:
        """One choice, or one chunk of it; the first carries the echoed prompt, the prompt logprobs and
        the prompt's token ids."""
        result = None if self.num_logprobs is None else CompletionLogprobs()
        echoed = self.echoed[index // self.n] if self.echoed is not None and first else None
        if echoed is not None:
            text = echoed.text + text
            if result is not None:
                self._add_prompt_logprobs(result, index, echoed, prompt_logprobs or [])
        if result is not None:
            for sampled, candidates in sampled_logprobs(token_ids, logprobs or []):
                self._add(result, index, sampled.decoded_token or "", logprob_value(sampled), _top(candidates))
        ids_asked = self.prompt_token_ids is not None
        return CompletionChoice(
            index=index, text=text, logprobs=result, finish_reason=finish_reason, stop_reason=stop_reason,
            prompt_logprobs=self._prompt_logprobs_field(prompt_logprobs, echoed) if first else None,
            token_ids=token_ids if ids_asked else None,
            prompt_token_ids=self.prompt_token_ids[index // self.n] if ids_asked and first else None,
        )

    def _add(self, result: CompletionLogprobs, index: int, token: str, logprob: float | None,
             top: dict[str, float] | None) -> None:
        result.tokens.append(token)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(self._offsets[index])
        self._offsets[index] += len(token)

    def _add_prompt_logprobs(self, result: CompletionLogprobs, index: int, echoed: EchoedPrompt,
                             entries: list[dict[int, Logprob] | None]) -> None:
        # The first prompt token has nothing before it, so no logprob (null, as OpenAI and vLLM send).
        self._add(result, index, echoed.first_token, None, None)
        for token_id, entry in zip(echoed.token_ids[1:], entries[1:]):
            actual = entry[token_id]
            self._add(result, index, actual.decoded_token or "", logprob_value(actual),
                      _top(entry, self.num_logprobs, token_id))

    def _prompt_logprobs_field(self, entries: list[dict[int, Logprob] | None] | None,
                               echoed: EchoedPrompt | None) -> list[dict[str, PromptLogprob] | None] | None:
        if entries is None or self.prompt_logprobs is None:
            return None
        # Echo may have asked the engine for more alternatives than this field wants; the prompt's
        # own token always stays.
        limit = None if echoed is None else self.prompt_logprobs
        actual = [None] * len(entries) if echoed is None else echoed.token_ids
        return [None if entry is None else {
            str(token): PromptLogprob(logprob=logprob_value(lp), rank=lp.rank, decoded_token=lp.decoded_token or "")
            for token, lp in entry.items() if limit is None or lp.rank <= limit or token == actual_token
        } for entry, actual_token in zip(entries, actual)]

    def opening_chunks(self) -> list[CompletionResponse]:
        return []

    def text_only(self, output: StreamOutput) -> bool:
        echo_pending = self.echoed is not None and output.index not in self._opened
        return (self.num_logprobs is None and output.prompt_logprobs is None and not output.finished
                and not echo_pending and self.prompt_token_ids is None)

    def chunk(self, output: StreamOutput) -> CompletionResponse:
        first = output.index not in self._opened
        self._opened.add(output.index)
        return self._response([self._choice(output.index, output.text, output.token_ids, output.logprobs,
                                            output.prompt_logprobs, output.finish_reason, output.stop_reason, first)])

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return self._response([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> CompletionResponse:
        return self._response([
            self._choice(c.index, c.text, c.token_ids, c.logprobs, c.prompt_logprobs, c.finish_reason,
                         c.stop_reason, first=True)
            for c in choices
        ], usage)


def _top(candidates: dict[int, Logprob], limit: int | None = None, keep: int | None = None) -> dict[str, float]:
    """Text -> logprob of the candidates at one position (those ranked within `limit`, and `keep`)."""
    top: dict[str, float] = {}
    # Tokens can decode to the same text (partial UTF-8 is all "\ufffd"): keep the likeliest.
    for token, candidate in sorted(candidates.items(), key=lambda item: item[1].rank):
        if limit is None or candidate.rank <= limit or token == keep:
            top.setdefault(candidate.decoded_token or "", logprob_value(candidate))
    return top
