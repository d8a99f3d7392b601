"""The offline API: `LLM(model=DIR, **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.engine.core import EngineCore, EngineStats
from kvpilot.runtime.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PromptLogprobsChunk,
    RequestOutput,
    TokenLogprobs,
)
from kvpilot.runtime.request import Request, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineArgs.from_kwargs(model, **engine_args).create_engine_config()
        tokenizer_file = Path(model) / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"model: no tokenizer.json in {model}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        eos = self.config.model.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        self.engine = EngineCore(self.config)
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in input order."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        # Everything is checked before anything is queued, so a bad prompt leaves the engine as it was.
        token_ids = [self._tokenize(p) for p in prompts]
        for ids, p in zip(token_ids, params):
            self.engine.validate(ids, p.for_choice(0))

        # n > 1 runs as n independent requests (choices), as the serving frontend does.
        choices: list[list[_Collector]] = []
        for ids, p, prio in zip(token_ids, params, priorities):
            request_id = str(next(self._request_counter))
            choices.append([
                _Collector(Request(request_id if p.n == 1 else f"{i}_{request_id}", ids, p.for_choice(i),
                                   eos_token_id=self.eos_token_id, priority=prio,
                                   max_model_len=self.config.scheduler.max_model_len), request_id)
                for i in range(p.n)
            ])
        collectors = {c.request.request_id: c for group in choices for c in group}
        for collector in collectors.values():
            self.engine.add_request(collector.request)
        try:
            while any(not c.finished for c in collectors.values()):
                for output in self.engine.step():
                    collectors[output.request_id].add(output)
        except BaseException:
            self.engine.abort_requests([rid for rid, c in collectors.items() if not c.finished])
            raise
        return [self._request_output(prompt, group) for group, prompt in zip(choices, prompts)]

    def _request_output(self, prompt: Prompt, choices: list[_Collector]) -> RequestOutput:
        first = choices[0]
        prompt_logprobs = None
        if first.request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                self.decode_logprobs(first.prompt_logprobs[pos])
                for pos in range(1, first.request.num_prompt_tokens)
            ]
        return RequestOutput(
            request_id=first.client_request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=first.request.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[c.completion(index, self) for index, c in enumerate(choices)],
            finished=True,
            num_cached_tokens=first.num_cached_tokens,
        )

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                # Not left to the tokenizer: a BOS token alone would make it look non-empty.
                raise ValueError("prompt is empty: it must have at least one character")
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return list(prompt)

    def decode_logprobs(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        return {
            token: Logprob(logprob, rank, self.tokenizer.decode([token], skip_special_tokens=False))
            for token, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
        }


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    prompts = list(prompts)
    for p in prompts:
        if not isinstance(p, (str, list)) or (isinstance(p, list) and not all(isinstance(t, int) for t in p)):
            raise ValueError("prompts must be strings or lists of token ids")
    return prompts


def _per_prompt(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


class _Collector:
    """Accumulates one choice's per-step outputs."""

    def __init__(self, request: Request, client_request_id: str) -> None:
        self.request = request
        self.client_request_id = client_request_id
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: dict[int, TokenLogprobs] = {}
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, output: EngineCoreOutput) -> None:
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs or [])
        chunk: PromptLogprobsChunk | None = output.new_prompt_logprobs
        if chunk is not None:
            # Keyed by position: a preempted request recomputes its prompt and reports it again.
            for offset, entry in enumerate(chunk.entries):
                self.prompt_logprobs[chunk.start + offset] = entry
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason

    def completion(self, index: int, llm: LLM) -> CompletionOutput:
        logprobs = cumulative = None
        if self.request.sampling_params.logprobs is not None:
            logprobs = [llm.decode_logprobs(entry) for entry in self.logprobs]
            cumulative = sum(entry.logprobs[0] for entry in self.logprobs)
        return CompletionOutput(
            index=index,
            text=llm.tokenizer.decode(self.token_ids, skip_special_tokens=True),
            token_ids=self.token_ids,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
