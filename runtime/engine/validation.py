"""Checks a request must pass before it reaches the engine; each error names the field at fault."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.runtime.request import ParamError, SamplingParams

# vLLM's default cap on logprobs and prompt_logprobs.
MAX_LOGPROBS = 20


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    num_kv_blocks: int,
    block_size: int,
    resume_token_ids: Sequence[int] = (),
) -> None:
    if params.n != 1:
        raise ValueError(f"n={params.n}: the engine core runs one sequence per request; fan n > 1 out first")
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("prompt is empty: it must have at least one token")
    if num_prompt >= max_model_len:
        raise ValueError(
            f"prompt has {num_prompt} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of the vocabulary (size {vocab_size}): {bad[:5]}")
    token_lists = {
        "stop_token_ids": params.stop_token_ids,
        "logit_bias": list(params.logit_bias or {}),
        "allowed_token_ids": params.allowed_token_ids or [],
        "bad_words": [t for word in params.bad_words_token_ids for t in word],
    }
    for name, token_ids in token_lists.items():
        bad = [t for t in token_ids if t >= vocab_size]
        if bad:
            raise ParamError(name, f"{name}: token ids out of the vocabulary (size {vocab_size}): {bad[:5]}")
    if resume_token_ids:
        _validate_resume(resume_token_ids, params, num_prompt, max_model_len, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > min(MAX_LOGPROBS, vocab_size):
            raise ValueError(f"{name} must be at most {min(MAX_LOGPROBS, vocab_size)}, got {value}")
    max_len = max_model_len if params.max_tokens is None else min(num_prompt + params.max_tokens, max_model_len)
    # The last sampled token never needs a KV slot.
    needed = -(-(max_len - 1) // block_size)
    if needed > num_kv_blocks - 1:
        raise ValueError(
            f"request may grow to {max_len} tokens ({needed} KV blocks) but the KV cache holds only "
            f"{num_kv_blocks - 1} blocks: lower max_tokens or raise num_gpu_blocks_override"
        )


def _validate_resume(resume_token_ids: Sequence[int], params: SamplingParams, num_prompt: int,
                     max_model_len: int, vocab_size: int) -> None:
    """A resumed request's output so far must be one its parameters could have produced."""
    bad = [t for t in resume_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError("resume_token_ids", f"resume_token_ids: token ids out of the vocabulary "
                                             f"(size {vocab_size}): {bad[:5]}")
    # A grammar's state would have to be replayed through the tokens; nothing needs that yet.
    if params.structured_outputs is not None:
        raise ParamError("resume_token_ids", "resume_token_ids cannot be combined with structured outputs")
    num_resumed = len(resume_token_ids)
    room = max_model_len - num_prompt
    limit = room if params.max_tokens is None else min(params.max_tokens, room)
    if num_resumed > limit:
        raise ParamError("resume_token_ids", f"resume_token_ids has {num_resumed} tokens, more than the "
                                             f"{limit} this request may produce (max_tokens and the context)")
