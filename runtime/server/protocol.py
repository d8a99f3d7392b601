"""The OpenAI (and vLLM-extension) request and response bodies, as pydantic models.

Unknown request fields are ignored, as OpenAI's API and vLLM do; known fields the server cannot
honour are refused, never silently dropped. Types are strict: `"5"` or `true` is no number, and
no float is infinite. Range checks that need a second field, the model or the server's limits
(min_tokens <= max_tokens, prompt + max_tokens <= max_model_len, --max-n) are made later, in
`serving.py`, where the numbers are known.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from kvpilot.runtime.config import SchedulingPolicy
from kvpilot.runtime.structured_output.params import StructuredOutputsParams

# vLLM's cap on logprobs; the engine enforces it too.
MAX_LOGPROBS = 20
# Tokens one request may bias (OpenAI's own limit is of this order).
MAX_LOGIT_BIAS = 300
# vLLM's default VLLM_MAX_NUM_BAD_WORDS is of this order; each word costs a check per token.
MAX_BAD_WORDS = 128
# Bad words are short, so that tokenizing them all on the event loop costs well under a millisecond.
MAX_BAD_WORD_LENGTH = 256
# Content parts a text-only model cannot take (OpenAI's and vLLM's media parts).
MEDIA_PART_TYPES = ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "image_embeds")
# The roles chat templates are written for (OpenAI's, with its newer "developer").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Far deeper than a real request nests (a JSON schema takes a level or two per property), far
# shallower than what breaks the recursive code that reads a body (json.dumps, Jinja's tojson,
# the grammar compiler).
MAX_NESTING = 64
# Integers cross to the engine as 64-bit (msgpack, torch); anything larger is refused here.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# -- requests -------------------------------------------------------------------------------------


class RequestBody(BaseModel):
    """A request body; its text must be encodable, which JSON's "\\ud800" escapes are not, and its
    nesting bounded."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_text_and_depth(cls, data):
        _check_text_and_depth(data)
        return data


def _check_text_and_depth(value) -> None:
    """ValueError for a lone surrogate in any string (keys too) of `value`, or for nesting deeper
    than MAX_NESTING. A loop, not a recursion: JSON nested a thousand deep parses, and broke the
    recursive walk (a 500)."""
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("text must be valid Unicode: it holds a lone surrogate") from None
        elif isinstance(item, (dict, list)):
            if depth == MAX_NESTING:
                raise ValueError(f"the request nests deeper than {MAX_NESTING} levels of objects and arrays")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            # Token ids, the bulk of a long prompt, hold no text: a 100k-id prompt was 13 ms of the loop.
            pending.extend((child, depth + 1) for child in children if type(child) is not int)


class StreamOptions(RequestBody):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (its choice's tokens); the last usage-only
    # chunk still comes with include_usage alone.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestBody):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # Output is held to the schema either way (as vLLM does); strict is accepted for OpenAI's clients.
    strict: bool | None = None


class ResponseFormat(RequestBody):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StructuredOutputsBody(RequestBody):
    """vLLM's structured_outputs object; exactly one constraint (checked in StructuredOutputsParams).

    vLLM's other keys (structural_tag, whitespace_pattern, ...) are not implemented: refused, not ignored.
    """

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class GenerationRequest(RequestBody):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    # Bounded by the server's --max-n.
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # 0 or -1 disable top-k, as in vLLM.
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    # Choice i samples with seed + i, which the engine takes within [0, 2**63) (checked below, with n).
    seed: int | None = Field(None, ge=0, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Engine priority: lower runs first (vLLM). A tenant's priority replaces it unless the tenant
    # allows request priorities.
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    # Prefix-cache isolation; combined with (never replacing) the tenant's own salt.
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: the logprob of each prompt token, with this many alternatives (completions only).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's: token id (as a string) -> a bias within [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # vLLM's: 1 is off; JSON has no infinity, so any positive number is finite here.
    repetition_penalty: float = Field(1.0, gt=0)
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    # OpenAI's: best_of candidates, the n likeliest returned. Only best_of == n (which returns
    # every candidate, so means nothing more) is accepted.
    best_of: int | None = None
    # Structured outputs, in OpenAI's shape, vLLM's, and vLLM's older guided_* fields; one at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    return_token_ids: bool = Field(False, description=(
        "vLLM's: the answer carries token ids, the prompt's (`prompt_token_ids`) and each choice's "
        "(`token_ids`); a stream sends the prompt's once and each chunk's new tokens."))
    resume_token_ids: list[int] = Field(default_factory=list, description=(
        "kvpilot's: output tokens this request already produced elsewhere (a stream cut short on another "
        "replica, continued here). They count as output: toward max_tokens, min_tokens, the penalties and "
        "usage.completion_tokens; a seeded request samples what an uninterrupted run would; the answer "
        "carries only the text and tokens that follow, and its text continues theirs, stop strings "
        "included. One sequence only: not with n > 1, a list of prompts, echo, tools or structured "
        "outputs; and no more tokens than max_tokens allows."))

    @field_validator("seed")
    @classmethod
    def _every_choice_has_a_seed(cls, seed: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if seed is not None and seed > INT64_MAX - (n - 1):
            raise ValueError(f"choice i samples with seed + i, which must stay below 2**63: seed {seed} leaves "
                             f"no room for n={n}")
        return seed

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        if logit_bias is None:
            return None
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(logit_bias)}")
        for token, bias in logit_bias.items():
            # isdigit alone admits "²" and "٣": token ids are ASCII digits.
            if not (token.isascii() and token.isdigit()) or not -100 <= bias <= 100:
                raise ValueError(f"maps token ids to biases within [-100, 100], got {token!r}: {bias!r}")
        return logit_bias

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported by this server (only best_of == n, here {self.n})")
        if self.guided_whitespace_pattern is not None:
            raise ValueError("guided_whitespace_pattern is not supported by this server")
        return self

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The constraint the request asks for and the field it came in; ValueError for two at once
        or a malformed one."""
        given: dict[str, dict] = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = ({"json_object": True} if self.response_format.type == "json_object"
                                        else {"json": self.response_format.json_schema.schema_})
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                given[f"guided_{kind}"] = {kind: getattr(self, f"guided_{kind}")}
        if not given:
            return None, None
        if len(given) > 1:
            raise ValueError(f"give one structured-output constraint, got {', '.join(given)}")
        (field, constraint), = given.items()
        return StructuredOutputsParams(**constraint), field

    @property
    def token_logit_bias(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(token): bias for token, bias in self.logit_bias.items()}

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and "" in ([stop] if isinstance(stop, str) else stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("stop_token_ids", "allowed_token_ids", "resume_token_ids")
    @classmethod
    def _non_negative_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("token ids must be non-negative")
        return ids

    @field_validator("bad_words")
    @classmethod
    def _no_blank_bad_word(cls, words: list[str]) -> list[str]:
        if any(not word.strip() for word in words):
            raise ValueError("bad words must not be empty or blank")
        if any(len(word) > MAX_BAD_WORD_LENGTH for word in words):
            raise ValueError(f"bad words may be at most {MAX_BAD_WORD_LENGTH} characters long")
        return words

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationRequest):
    # A prompt (a string or token ids) or a batch of them; each gets its n choices.
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy default; null asks for whatever room the context has left (vLLM).
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The prompt comes first in each choice's text (and, with logprobs, in its logprobs).
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt):
        if not prompt:
            raise ValueError("the prompt (or batch of prompts) must not be empty")
        if any(isinstance(p, list) and any(t < 0 for t in p) for p in _as_batch(prompt)):
            raise ValueError("token ids must be non-negative")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts; a single prompt is a batch of one."""
        return _as_batch(self.prompt)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:
            raise ValueError("suffix is not supported")
        return suffix


def _as_batch(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCallParam(RequestBody):
    name: str
    # JSON text, as OpenAI's API returns it.
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, arguments: str) -> str:
        try:
            _arguments_object(arguments)
        except json.JSONDecodeError as err:
            raise ValueError(f"a tool call's arguments must be JSON text: {err}") from None
        return arguments

    @property
    def arguments_object(self):
        return _arguments_object(self.arguments)


def _arguments_object(arguments: str):
    # An empty string is a call without arguments, as vLLM reads it.
    return json.loads(arguments) if arguments else {}


class ToolCallParam(RequestBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(RequestBody):
    role: Literal[CHAT_ROLES]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and the call a tool turn answers.
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role} messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        # Said before the parts are parsed: pydantic would only say that the part is no TextPart.
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                raise ValueError(f"this model takes text only: {part['type']} content parts are not supported")
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_template_input(self) -> dict:
        message = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            # Templates index into the arguments (Qwen2.5's writes them with tojson), so they get
            # the object, as vLLM hands them over, not its JSON text.
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": call.function.arguments_object}}
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(RequestBody):
    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON schema for the arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_input(self) -> dict:
        return {"type": self.type, "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # max_completion_tokens is OpenAI's current name; max_tokens its deprecated one. Absent both,
    # the completion may use what is left of the context (vLLM).
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat-template controls.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: each reply starts with the final message's text when that message is the
    # assistant's own (a reply continued, as with continue_final_message).
    echo: bool = False
    tools: list[ChatTool] | None = None
    # With tools and no choice, "auto" (OpenAI's default, and vLLM's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # OpenAI's; false keeps a reply's first call only (and `required` asks for one).
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self):
        # vLLM's checks and messages.
        if self.tools == []:
            raise ValueError("`tools` must not be an empty array. Either provide at least one tool or omit "
                             "the field entirely.")
        if self.tool_choice is None and self.tools:
            self.tool_choice = "auto"
        if self.tool_choice not in (None, "none") and self.tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool is None:
            raise ValueError("The tool specified in `tool_choice` does not match any of the specified `tools`")
        return self

    @property
    def echoed_text(self) -> str:
        """What each reply starts with: see `echo`."""
        final = self.messages[-1]
        return final.text if self.echo and final.role == "assistant" else ""

    @property
    def named_tool(self) -> FunctionDefinition | None:
        """The function a named tool_choice forces, if any."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        return next((tool.function for tool in self.tools if tool.function.name == self.tool_choice.function.name),
                    None)

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message requires add_generation_prompt to be false")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is supported on /v1/completions only")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """What the engine is asked for: the sampled token's logprob plus top_logprobs others."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # With messages: the tools the chat template is shown, as for /v1/chat/completions.
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are rendered by the chat template, so they need messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(RequestBody):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestBody):
    """vLLM's POST /v1/unload_lora_adapter."""

    lora_name: str = Field(min_length=1)


class SchedulingPolicyRequest(RequestBody):
    policy: str

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> SchedulingPolicy:
        if policy not in tuple(SchedulingPolicy):
            raise ValueError(f"must be one of {', '.join(SchedulingPolicy)}, got {policy!r}")
        return SchedulingPolicy(policy)


# -- responses ------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    # None for an echoed prompt's first token, which nothing comes before.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


def _not_asked(token_ids: list[int] | None) -> bool:
    """vLLM's token-id fields are left out of answers that did not ask for them (return_token_ids)."""
    return token_ids is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's shape: per prompt position (None for the first), token id -> its logprob; only on the
    # first chunk of a streamed choice.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    # vLLM's extension: the stop token id or stop string that ended the choice.
    stop_reason: int | str | None = None
    # vLLM's, with return_token_ids: the choice's new tokens; its prompt's on its first chunk.
    token_ids: list[int] | None = Field(None, exclude_if=_not_asked)
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_not_asked)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class OmitAbsent(BaseModel):
    """Leaves out the fields that are None: OpenAI omits what a message or delta does not carry."""

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    # None when the reply is tool calls only.
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler) -> dict:
        message = handler(self)
        if message["tool_calls"] is None:
            del message["tool_calls"]
        return message


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's, with return_token_ids.
    token_ids: list[int] | None = Field(None, exclude_if=_not_asked)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's, with return_token_ids.
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_not_asked)


class FunctionCallDelta(OmitAbsent):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(OmitAbsent):
    """A call's first delta has its id, type and name; the later ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(OmitAbsent):
    # A delta carries only what changed: `{}` on the closing chunk, not nulls.
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's, with return_token_ids: the chunk's new tokens.
    token_ids: list[int] | None = Field(None, exclude_if=_not_asked)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # vLLM's, with return_token_ids: on the opening chunks (the role's) only.
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_not_asked)
