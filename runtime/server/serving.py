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
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvpilot.runtime.engine.async_llm import AsyncLLM, SlowConsumerError
from kvpilot.runtime.engine.bad_words import bad_words_token_ids
from kvpilot.runtime.engine.core_client import EngineDeadError
from kvpilot.runtime.engine.output_processor import StreamOutput
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.outputs import Logprob
from kvpilot.runtime.models.generation_config import SAMPLING_KEYS
from kvpilot.runtime.request import SamplingParams
from kvpilot.runtime.server.chat_template import ChatTemplate, ChatTemplateError
from kvpilot.runtime.server.errors import APIError, bad_request, sse_error
from kvpilot.runtime.server.limits import ServerLimits
from kvpilot.runtime.server.lora_adapters import ServedAdapters
from kvpilot.runtime.server.prompt_batch import merged
from kvpilot.runtime.server.protocol import ChatMessage, GenerationRequest, Usage
from kvpilot.runtime.server.streaming import StallingStreamingResponse
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry
from kvpilot.runtime.server.tokenizer_pool import PromptTooLong, TokenizerPool
from kvpilot.runtime.structured_output.grammar import UnsupportedGrammar
from kvpilot.runtime.structured_output.grammar import check as check_grammar
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

# JSON has no -inf; vLLM reports an impossible token's logprob as this.
MIN_LOGPROB = -9999.0
SSE_DONE = b"data: [DONE]\n\n"

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
    # The output it continues (the request's resume_token_ids).
    resume_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter its `model` names (None: the base model).
    lora_request: LoRARequest | None = None


@dataclass
class Choice:
    """One choice, accumulated over its stream (the non-streaming answer)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, output: StreamOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.text += output.text
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs or []
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason


class UsageCounter:
    def __init__(self, batch: list[EngineRequest]) -> None:
        # Per prompt, counted once however many choices it has.
        self._prompt_tokens = sum(len(request.prompt_token_ids) for request in batch)
        self._output_tokens: dict[int, int] = {}

    def add(self, output: StreamOutput) -> None:
        # Cumulative per choice: the latest value is the count.
        self._output_tokens[output.index] = output.num_output_tokens

    def usage(self) -> Usage:
        prompt = self._prompt_tokens
        completion = sum(self._output_tokens.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class ResponseFormat(Protocol):
    """How one endpoint shapes its answer (completions.py, chat.py)."""

    def opening_chunks(self) -> list[BaseModel]: ...

    # None: nothing to send for this output (a tool-call parser holds its text back).
    def chunk(self, output: StreamOutput) -> BaseModel | None: ...

    def text_only(self, output: StreamOutput) -> bool:
        """Whether chunk(output) is a function of output.index and output.text alone (a delta of
        text, without logprobs, not the last): such chunks are streamed from a TextChunks template."""
        ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel: ...


class TextChunks:
    """The SSE events of a stream's text-only chunks, from one rendering per choice.

    The first text-only chunk of each choice is built and dumped by pydantic, as every other chunk
    is, with a marker for its text; the bytes around the marker are kept, and every later text-only
    chunk of that choice is those bytes around its JSON-encoded text. pydantic stays the one
    definition of a chunk's shape, and a token costs a string encoding instead of building and
    dumping models. msgspec escapes strings as pydantic does, code point for code point (a test
    checks all of them).
    """

    # JSON escapes its NULs, so the marker cannot occur in a rendered chunk but as the text itself.
    MARKER = "\x00text\x00"

    def __init__(self, render: Callable[[StreamOutput], BaseModel]) -> None:
        self._render = render
        self._parts: dict[int, tuple[bytes, bytes]] = {}

    def event(self, output: StreamOutput) -> bytes:
        parts = self._parts.get(output.index)
        if parts is None:
            event = sse_event(self._render(dataclasses.replace(output, text=self.MARKER)))
            head, _, tail = event.partition(_json(self.MARKER))
            parts = self._parts[output.index] = (head, tail)
        return parts[0] + _json(output.text) + parts[1]


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


def check_limits(limits: ServerLimits, body: GenerationRequest) -> None:
    """400 for a request over one of the server's per-request limits."""
    if body.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} (--max-n), got {body.n}", "n")
    stop = body.stop_strings
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings are allowed (--max-stop-strings), "
                          f"got {len(stop)}", "stop")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_string_length:
        raise bad_request(f"stop strings may be at most {limits.max_stop_string_length} characters long "
                          f"(--max-stop-string-length), got one of {longest}", "stop")
    if len(body.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"at most {limits.max_stop_token_ids} stop_token_ids are allowed "
                          f"(--max-stop-token-ids), got {len(body.stop_token_ids)}", "stop_token_ids")


class Serving:
    def __init__(self, engine: AsyncLLM, model_name: str, tenants: TenantRegistry | None,
                 limits: ServerLimits, tokenizers: TokenizerPool, sampling_defaults: dict | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tenants = tenants
        self.limits = limits
        self.tokenizers = tokenizers
        self.adapters = ServedAdapters(engine, model_name, tenants)
        # The model's generation config: it replaces OpenAI's defaults, never a field the client set.
        self.sampling_defaults = sampling_defaults or {}
        # Called once per request aborted because its client stopped reading (a metric).
        self.on_slow_client: Callable[[], None] = lambda: None

    def _sampling_field(self, body: GenerationRequest, name: str):
        if name in body.model_fields_set or name not in self.sampling_defaults:
            return getattr(body, name)
        return self.sampling_defaults[name]

    async def prompt_token_ids(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """Tokenized on the pool; 400 without tokenizing when the text is surely too long for the model."""
        try:
            return await self.tokenizers.encode(text, add_special_tokens=add_special_tokens,
                                                max_tokens=self.engine.max_model_len)
        except PromptTooLong as err:
            raise bad_request(str(err), param) from err

    async def chat_prompt_token_ids(self, template: ChatTemplate, messages: list[ChatMessage], *,
                                    add_generation_prompt: bool, continue_final_message: bool = False,
                                    tools: list[dict] | None = None) -> list[int]:
        try:
            prompt = await self.tokenizers.run(template.render, [m.as_template_input() for m in messages],
                                               add_generation_prompt, continue_final_message, tools)
        except ChatTemplateError as err:
            raise bad_request(str(err), "messages") from err
        # The template writes the special tokens (BOS included) itself.
        return await self.prompt_token_ids(prompt, add_special_tokens=False, param="messages")

    async def structured_outputs(self, body: GenerationRequest) -> StructuredOutputsParams | None:
        """The request's output constraint, checked (on the tokenizer pool: a large schema takes a
        while) against what the grammar engine can enforce; 400 naming the field and the feature."""
        try:
            params, field = body.structured_outputs_params()
        except ValueError as err:
            raise bad_request(str(err), "structured_outputs") from err
        if params is not None:
            await self.check_structured_outputs(params, field)
        return params

    async def check_structured_outputs(self, params: StructuredOutputsParams, field: str) -> None:
        """400 naming `field` when the grammar engine cannot enforce `params`."""
        try:
            await self.tokenizers.run(check_grammar, params)
        except UnsupportedGrammar as err:
            raise bad_request(f"{field}: {err}", field) from err

    def check_model(self, model: str | None, tenant: Tenant | None = None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a model this server does
        not serve, or an adapter the tenant may not use."""
        return self.adapters.resolve(model, tenant)

    def engine_request(self, body: GenerationRequest, prompt_token_ids: list[int], *, prompt_param: str,
                       max_tokens: int | None, logprobs: int | None, tenant: Tenant | None,
                       request_id: str, prompt_logprobs: int | None = None,
                       structured_outputs: StructuredOutputsParams | None = None,
                       lora_request: LoRARequest | None = None) -> EngineRequest:
        """Checks the request against the model and the limits, and applies the tenant's priority and salt.

        `structured_outputs` is the constraint `structured_outputs()` checked (or one the route made).
        """
        check_limits(self.limits, body)
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
                prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                logit_bias=body.token_logit_bias, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, allowed_token_ids=body.allowed_token_ids,
                # Bounded (protocol.py) to well under a millisecond of tokenizing.
                bad_words_token_ids=bad_words_token_ids(
                    body.bad_words, lambda text: self.engine.encode(text, add_special_tokens=False)),
                structured_outputs=structured_outputs,
            )
            self.engine.validate(prompt_token_ids, params, body.resume_token_ids)
        except ValueError as err:
            raise bad_request(str(err), getattr(err, "param", None)) from err
        if tenant is None:
            priority, cache_salt = body.priority or 0, body.cache_salt
        else:
            priority = tenant.engine_priority(body.priority)
            cache_salt = self.tenants.cache_salt(tenant, body.cache_salt)
        return EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, params=params, priority=priority,
            cache_salt=cache_salt, tenant=None if tenant is None else tenant.name,
            resume_token_ids=body.resume_token_ids, lora_request=lora_request,
        )

    async def respond(self, http_request: Request, request: EngineRequest | list[EngineRequest],
                      response_format: ResponseFormat, *, stream: bool, include_usage: bool,
                      continuous_usage: bool = False) -> Response:
        """Answers one request, or a batch of them (one per prompt, each with the same n).

        `continuous_usage`: the usage so far on every chunk (vLLM's stream_options.continuous_usage_stats).
        """
        batch = [request] if isinstance(request, EngineRequest) else request
        # Each of the n choices of each prompt is a sequence of the tenant's limit, held until the
        # response ends.
        http_request.state.sequences.acquire(sum(r.params.n for r in batch))
        if stream:
            events = self._events(batch, response_format, include_usage, continuous_usage)
            return StallingStreamingResponse(events, self.limits.stream_stall_timeout_s, self.on_slow_client,
                                             media_type="text/event-stream")
        try:
            collected = await _unless_disconnected(http_request, self._collect(batch))
        except ValueError as err:
            raise bad_request(str(err)) from err
        if collected is None:
            # The client went away (the request is aborted); nobody is left to read an answer.
            return Response(status_code=499)
        return JSONResponse(response_format.response(*collected).model_dump())

    def _generate(self, batch: list[EngineRequest], max_buffered_outputs: int | None = None
                  ) -> AsyncIterator[StreamOutput]:
        streams = [self.engine.generate(
            request.prompt_token_ids, request.params, request.request_id, priority=request.priority,
            cache_salt=request.cache_salt, tenant=request.tenant, max_buffered_outputs=max_buffered_outputs,
            resume_token_ids=request.resume_token_ids, lora_request=request.lora_request,
        ) for request in batch]
        return streams[0] if len(streams) == 1 else merged(streams, batch[0].params.n)

    async def _collect(self, batch: list[EngineRequest]) -> tuple[list[Choice], Usage]:
        choices = [Choice(index) for index in range(sum(r.params.n for r in batch))]
        usage = UsageCounter(batch)
        # aclosing: a cancelled collection closes the stream, which aborts the request in the engine.
        async with contextlib.aclosing(self._generate(batch)) as outputs:
            async for output in outputs:
                choices[output.index].add(output)
                usage.add(output)
        return choices, usage.usage()

    async def _events(self, batch: list[EngineRequest], response_format: ResponseFormat,
                      include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes | str]:
        usage = UsageCounter(batch)
        text_chunks = TextChunks(response_format.chunk)
        try:
            for chunk in response_format.opening_chunks():
                if continuous_usage:
                    chunk.usage = usage.usage()
                yield sse_event(chunk)
            # Only a stream's consumer can stall (on its client); a collection always reads.
            outputs = self._generate(batch, self.limits.max_buffered_outputs)
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    usage.add(output)
                    if not continuous_usage and response_format.text_only(output):
                        yield text_chunks.event(output)
                        continue
                    chunk = response_format.chunk(output)
                    if chunk is None:
                        continue
                    if continuous_usage:
                        # Per choice, as vLLM counts it: this choice's tokens so far.
                        chunk.usage = Usage(prompt_tokens=output.num_prompt_tokens,
                                            completion_tokens=output.num_output_tokens,
                                            total_tokens=output.num_prompt_tokens + output.num_output_tokens)
                    yield sse_event(chunk)
        except ValueError as err:
            yield sse_error(bad_request(str(err)))
            return
        except EngineDeadError as err:
            # An error event, then the stream ends without [DONE]: the answer is incomplete.
            yield sse_error(engine_dead_error(err))
            return
        except SlowConsumerError as err:
            self.on_slow_client()
            yield sse_error(APIError(429, str(err), code="client_too_slow"))
            return
        if include_usage:
            yield sse_event(response_format.usage_chunk(usage.usage()))
        yield SSE_DONE


def sse_event(chunk: BaseModel) -> bytes:
    return b"data: " + chunk.__pydantic_serializer__.to_json(chunk) + b"\n\n"


_json = msgspec.json.encode


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
