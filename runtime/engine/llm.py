"""The offline API: `LLM(model=DIR, **engine_args).generate(prompts, sampling_params)`.

The EngineCore runs in this process; its outputs go through the same OutputProcessor as the
server's, so an offline request's text, stop strings and logprobs are the served ones.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from kvpilot.runtime.config import EngineArgs
from kvpilot.runtime.engine.core import EngineCore, EngineStats
from kvpilot.runtime.engine.output_processor import OutputProcessor, StreamOutput
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.outputs import CompletionOutput, RequestOutput
from kvpilot.runtime.request import Request, SamplingParams
from kvpilot.runtime.structured_output.grammar import check as check_grammar

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineArgs.from_kwargs(model, **engine_args).create_engine_config()
        self.tokenizer, _ = load_tokenizer(model, self.config.model.tokenizer)
        eos = self.config.model.eos_token_ids
        self.eos_token_id = eos[0] if eos else None
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in input order.

        `cache_salt` (one for all prompts, or one per prompt) keeps prefix-cache hits among the
        requests that share it, as the server's per-request field does. `lora_request` (one for
        all prompts, or one per prompt, None for the base model) names each prompt's adapter; one
        not loaded yet is loaded first (LoRAAdapterError when it does not fit the model).
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        priorities = _per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        salts = _per_prompt(cache_salt, len(prompts), "cache_salt")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        # Everything is checked before anything is queued, so a bad prompt leaves the engine as it was.
        token_ids = [self._tokenize(p) for p in prompts]
        for ids, p in zip(token_ids, params):
            self.engine.validate(ids, p.for_choice(0))
            if p.structured_outputs is not None:
                check_grammar(p.structured_outputs)
        for lora in dict.fromkeys(loras):
            loaded = self.engine.loaded_loras
            if lora is not None and (loaded is None or lora.lora_int_id not in loaded):
                self.engine.add_lora(lora)

        # n > 1 runs as n independent requests (choices), as the serving frontend does.
        streams: list[list[list[StreamOutput]]] = []
        try:
            for ids, p, prio, salt, lora in zip(token_ids, params, priorities, salts, loras):
                request_id = str(next(self._request_counter))
                streams.append([[] for _ in range(p.n)])
                for index in range(p.n):
                    request = Request(request_id if p.n == 1 else f"{index}_{request_id}", ids,
                                      p.for_choice(index), eos_token_id=self.eos_token_id, priority=prio,
                                      cache_salt=salt, max_model_len=self.config.scheduler.max_model_len,
                                      lora_request=lora)
                    self.output_processor.add_request(request_id, request.request_id, index,
                                                      request.sampling_params, ids, streams[-1][index].append,
                                                      num_choices=p.n)
                    self.engine.add_request(request)
            while self.output_processor.has_unfinished_requests():
                # Requests a stop string ended here still run in the engine until told.
                self.engine.abort_requests(self.output_processor.process_outputs(self.engine.step()))
        except BaseException:
            unfinished = list(self.output_processor.choices)
            self.output_processor.abort(unfinished)
            self.engine.abort_requests(unfinished)
            raise
        return [_request_output(prompt, ids, choices) for prompt, ids, choices in zip(prompts, token_ids, streams)]

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


def _request_output(prompt: Prompt, prompt_token_ids: list[int], choices: list[list[StreamOutput]]) -> RequestOutput:
    first = choices[0]
    return RequestOutput(
        request_id=first[0].request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt_token_ids,
        # Carried by a choice's first delta only.
        prompt_logprobs=first[0].prompt_logprobs,
        outputs=[_completion(index, outputs) for index, outputs in enumerate(choices)],
        finished=True,
        num_cached_tokens=first[-1].num_cached_tokens,
    )


def _completion(index: int, outputs: list[StreamOutput]) -> CompletionOutput:
    token_ids = [token for output in outputs for token in output.token_ids]
    logprobs = cumulative = None
    if outputs[0].logprobs is not None:
        logprobs = [entry for output in outputs for entry in output.logprobs]
        cumulative = sum(candidates[token].logprob for token, candidates in zip(token_ids, logprobs))
    return CompletionOutput(
        index=index,
        text="".join(output.text for output in outputs),
        token_ids=token_ids,
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=outputs[-1].finish_reason,
        stop_reason=outputs[-1].stop_reason,
    )
