"""From a parsed OpenAI request to AsyncLLM and back, shared by completions and chat.

A request becomes an `EngineRequest` (sampling parameters, engine priority and cache salt after
the tenant's policy), then is answered either as one JSON body or as server-sent events. The
two endpoints differ only in their prompt and in their `ResponseFormat`.

Client disconnects abort the request: a stream is cancelled by Starlette when its client goes
away, and a non-streaming request watches for the disconnect itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvpilot.runtime.engine.async_llm import AsyncLLM
from kvpilot.runtime.engine.core_client import EngineDeadError
from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.models.generation_config import SAMPLING_KEYS
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.server.errors import APIError, bad_request
from kvpilot.runtime.server.protocol import GenerationRequest, Usage
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry

# JSON has no -inf; vLLM reports an impossible token's logprob as this.
MIN_LOGPROB = -9999.0
SSE_DONE = "data: [DONE]\n\n"

T = TypeVar("T")


@dataclass
class EngineRequest:
    """What AsyncLLM.generate is asked, after the tenant's policy was applied."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    tenant: str | None


@dataclass
class Choice:
    """One choice, accumulated over its stream (the non-streaming answer)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, output: StreamOutput) -> None:
        self.text += output.text
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs or []
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


class UsageCounter:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self._output_tokens: dict[int, int] = {}

    def add(self, output: StreamOutput) -> None:
        self.prompt_tokens = output.num_prompt_tokens
        # Cumulative per choice: the latest value is the count.
        self._output_tokens[output.index] = output.num_output_tokens

    def usage(self) -> Usage:
        completion = sum(self._output_tokens.values())
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)


class ResponseFormat(Protocol):
    """How one endpoint shapes its answer (completions.py, chat.py)."""

    def opening_chunks(self) -> list[BaseModel]: ...

    def chunk(self, output: StreamOutput) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel: ...


def sampled_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]]
                     ) -> Iterator[tuple[Logprob, dict[int, Logprob]]]:
    """(the sampled token's Logprob, every Logprob at that position) for each token."""
    for token_id, candidates in zip(token_ids, logprobs):
        yield candidates[token_id], candidates


def logprob_value(entry: Logprob) -> float:
    return max(entry.logprob, MIN_LOGPROB)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_dead_error(err: EngineDeadError) -> APIError:
    return APIError(503, f"the engine is not running: {err}", code="engine_dead")


class Serving:
    def __init__(self, engine: AsyncLLM, model_name: str, tenants: TenantRegistry | None,
                 sampling_defaults: dict | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tenants = tenants
        # The model's generation config: it replaces OpenAI's defaults, never a field the client set.
        self.sampling_defaults = sampling_defaults or {}

    def _sampling_field(self, body: GenerationRequest, name: str):
        if name in body.model_fields_set or name not in self.sampling_defaults:
            return getattr(body, name)
        return self.sampling_defaults[name]

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist (this server serves {self.model_name!r})",
                           param="model", code="model_not_found")

    def engine_request(self, body: GenerationRequest, prompt_token_ids: list[int], *, prompt_param: str,
                       max_tokens: int | None, logprobs: int | None, tenant: Tenant | None,
                       request_id: str) -> EngineRequest:
        """Checks the request against the model and applies the tenant's priority and salt."""
        max_model_len = self.engine.max_model_len
        num_prompt = len(prompt_token_ids)
        if max_tokens is None:
            max_tokens = max_model_len - num_prompt
            if max_tokens < 1:
                raise bad_request(f"the prompt has {num_prompt} tokens, which leaves no room to generate "
                                  f"within this model's maximum context length of {max_model_len} tokens",
                                  prompt_param)
        elif num_prompt + max_tokens > max_model_len:
            raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                              f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt and "
                              f"{max_tokens} in max_tokens): shorten the prompt or lower max_tokens",
                              "max_tokens")
        try:
            params = SamplingParams(
                n=body.n, max_tokens=max_tokens, **{name: self._sampling_field(body, name) for name in SAMPLING_KEYS},
                seed=body.seed, stop=body.stop_strings,
                stop_token_ids=body.stop_token_ids, include_stop_str_in_output=body.include_stop_str_in_output,
                ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs,
            )
            self.engine.validate(prompt_token_ids, params)
        except ValueError as err:
            raise bad_request(str(err)) from err
        if tenant is None:
            priority, cache_salt = body.priority or 0, body.cache_salt
        else:
            priority = tenant.engine_priority(body.priority)
            cache_salt = self.tenants.cache_salt(tenant, body.cache_salt)
        return EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, priority=priority,
            cache_salt=cache_salt, tenant=None if tenant is None else tenant.name,
        )

    async def respond(self, http_request: Request, request: EngineRequest, response_format: ResponseFormat,
                      *, stream: bool, include_usage: bool) -> Response:
        if stream:
            events = self._events(request, response_format, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            collected = await _unless_disconnected(http_request, self._collect(request))
        except ValueError as err:
            raise bad_request(str(err)) from err
        if collected is None:
            # The client went away (the request is aborted); nobody is left to read an answer.
            return Response(status_code=499)
        return JSONResponse(response_format.response(*collected).model_dump())

    def _generate(self, request: EngineRequest) -> AsyncIterator[StreamOutput]:
        return self.engine.generate(
            request.prompt_token_ids, request.params, request.request_id, priority=request.priority,
            cache_salt=request.cache_salt, tenant=request.tenant,
        )

    async def _collect(self, request: EngineRequest) -> tuple[list[Choice], Usage]:
        choices = [Choice(index) for index in range(request.params.n)]
        usage = UsageCounter()
        # aclosing: a cancelled collection closes the stream, which aborts the request in the engine.
        async with contextlib.aclosing(self._generate(request)) as outputs:
            async for output in outputs:
                choices[output.index].add(output)
                usage.add(output)
        return choices, usage.usage()

    async def _events(self, request: EngineRequest, response_format: ResponseFormat,
                      include_usage: bool) -> AsyncIterator[str]:
        usage = UsageCounter()
        try:
            for chunk in response_format.opening_chunks():
                yield _sse(chunk)
            async with contextlib.aclosing(self._generate(request)) as outputs:
                async for output in outputs:
                    usage.add(output)
                    yield _sse(response_format.chunk(output))
        except ValueError as err:
            yield _sse_error(bad_request(str(err)))
            return
        except EngineDeadError as err:
            # An error event, then the stream ends without [DONE]: the answer is incomplete.
            yield _sse_error(engine_dead_error(err))
            return
        if include_usage:
            yield _sse(response_format.usage_chunk(usage.usage()))
        yield SSE_DONE


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"


async def _unless_disconnected(http_request: Request, work: Awaitable[T]) -> T | None:
    """`await work`, but cancel it and return None as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # this handler is being cancelled (shutdown): take the work with it
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    # Let the cancelled work close its stream (so the abort goes out) before answering.
    await asyncio.wait({task})
    return None


async def _wait_for_disconnect(http_request: Request) -> None:
    # The body was read already, so the next message the server has for us is the disconnect.
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
