"""The model runner: applies a SchedulerOutput to the persistent batch, runs the model, samples.

One `execute_model` call is one step: drop the rows of finished and preempted requests, add the
new (or resumed) ones and the blocks others gained, condense; flatten the scheduled tokens into
the step buffers (StepInputs); run the model (a pure-decode step padded to a captured size, and
replayed as a CUDA graph where one exists); then sample the requests whose every token is now
computed (a partial prefill chunk samples nothing). The sampled tokens are appended to the batch
as well as returned, so that under async scheduling the next step, scheduled before the tokens
reach the scheduler, already feeds them to the model.
"""

from __future__ import annotations

import numpy as np
import torch

from kvpilot.runtime import distributed
from kvpilot.runtime.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvpilot.runtime.core.sched.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from kvpilot.runtime.layers.attention import get_attention_backend
from kvpilot.runtime.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from kvpilot.runtime.lora.device_slots import DeviceLoRASlots
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.models.loader import load_model
from kvpilot.runtime.outputs import PromptLogprobsChunk, TokenLogprobs
from kvpilot.runtime.request import GREEDY_TEMPERATURE
from kvpilot.runtime.worker.cuda_graphs import DecodeGraphs, can_capture
from kvpilot.runtime.worker.device_copy import to_device
from kvpilot.runtime.worker.input_batch import InputBatch
from kvpilot.runtime.worker.logits_state import LogitsState
from kvpilot.runtime.worker.step_inputs import StepBuffers, StepInputs, decode_sizes


class ModelRunner:
    """One rank's model, KV cache and persistent batch; with TP 1 it is the whole executor."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        backend = get_attention_backend(config.model.attention_backend, device, config.model.torch_dtype)
        self.model = load_model(config.model, backend, device)
        self.sampler = Sampler(backend.name)
        self.generator = torch.Generator(device=device).manual_seed(config.model.seed)
        sched = config.scheduler
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.batch = InputBatch(max_num_reqs=sched.max_num_seqs, max_model_len=self.max_model_len,
                                max_blocks_per_req=max_blocks_per_req, device=device,
                                vocab_size=config.model.vocab_size)
        # Pure-decode steps are padded to these sizes unless eager (on a CPU too, so that the
        # path graphs replay is the one the parity tests run).
        self.decode_sizes = [] if config.model.enforce_eager else decode_sizes(sched.max_num_seqs)
        self.buffers = StepBuffers(max(sched.max_num_batched_tokens, sched.max_num_seqs), sched.max_num_seqs,
                                   max_blocks_per_req, device)
        # Adapter slots, when the engine serves LoRA adapters.
        self.lora = DeviceLoRASlots(self.model, config.model, config.lora, device) \
            if config.lora.enable_lora else None
        # A captured graph would not see the per-step LoRA index (its kernels read it from the host).
        self.capture_graphs = bool(self.decode_sizes) and self.lora is None and can_capture(
            device, backend.name, config.model.enforce_eager, config.parallel.world_size)
        self.graphs: DecodeGraphs | None = None
        self.logits_state = LogitsState(config.model.vocab_size, config.model.eos_token_ids, device)
        self.pipelined = config.parallel.pipeline_parallel_size > 1
        self._sampled_req_ids: list[str] | None = None
        self._sampling_settings: dict = {}

    def kv_cache_bytes_per_block(self) -> int:
        layer = self.model.attention_layers[0]
        element_size = torch.empty(0, dtype=self.config.model.torch_dtype).element_size()
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_dim * element_size
        return per_layer * len(self.model.attention_layers)

    def kv_cache_budget_bytes(self) -> int:
        """Bytes this rank can give the KV cache: the configured budget, or what the device has left."""
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_CACHE_BYTES
        # The weights are loaded by now, so what the device already holds is theirs (and other
        # processes'). Activation peaks are not profiled yet: leave headroom in the fraction.
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free)
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={cache.gpu_memory_utilization} leaves no room for the KV cache: "
                f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB are already in use"
            )
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for layer in self.model.attention_layers:
            layer.kv_cache = torch.zeros(
                2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                dtype=self.config.model.torch_dtype, device=self.device,
            )
        if self.capture_graphs:
            # The graphs read the caches where they are now: capture after allocating them.
            self.graphs = DecodeGraphs(self.model, self.buffers, self.decode_sizes, self.max_model_len)

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives in its caller's process."""

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads the adapter into this rank's host cache (the EngineCore checked that it fits)."""
        self.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        self.lora.remove(lora_int_id)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])

        step = StepInputs.build(self.batch, scheduler_output.num_scheduled_tokens, self.block_size)
        # The scheduler advances its counts the same way and ships none for a plain decode.
        self.batch.num_computed_tokens[step.rows] = step.seq_lens
        hidden = self._forward(step)  # None before the last pipeline stage
        prompt_logprobs = self._prompt_logprobs(step, hidden) if hidden is not None else {}

        # A request samples only once every token it has is computed; a partial prefill chunk does not.
        sample_idx = np.flatnonzero(step.seq_lens == self.batch.num_tokens[step.rows])
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(step.req_ids)
        # Before the last pipeline stage there is nothing to sample from.
        if len(sample_idx) and hidden is not None:
            self._sample(step, hidden, sample_idx, scheduler_output.grammar_bitmask, sampled, logprobs)
        return ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _sample(self, step: StepInputs, hidden: torch.Tensor, sample_idx: np.ndarray,
                grammar: GrammarBitmask | None, sampled: list, logprobs: list) -> None:
        """Samples the requests at `sample_idx` (of the step), filling their entries of `sampled`
        and `logprobs`, and appends their tokens to the batch; under pipeline parallelism the
        tokens reach every stage's batch with the requests' next step instead."""
        every_row = len(sample_idx) == step.num_tokens
        if not every_row:
            # Only the rows that sample reach the LM head (a pure decode step samples every row).
            hidden = hidden[to_device(step.query_start_loc[1:][sample_idx] - 1, self.device)]
        logits = self.model.compute_logits(hidden)
        sample_ids = step.req_ids if every_row else [step.req_ids[i] for i in sample_idx]
        sample_rows = step.rows[sample_idx]
        metadata = self._sampling_metadata(sample_rows, sample_ids)
        metadata.grammar_bitmask = self._grammar_bitmask(grammar, sample_ids)
        output = self.sampler(logits, metadata, self.generator)
        self.logits_state.record_sampled(sample_ids, output.sampled_token_ids)
        tokens = output.sampled_token_ids.tolist()
        if not self.pipelined:
            self.batch.append_tokens(sample_rows, tokens)
        if every_row:
            sampled[:] = [[token] for token in tokens]
        else:
            for j, i in enumerate(sample_idx.tolist()):
                sampled[i].append(tokens[j])
        if output.logprobs is not None:
            for j, i in enumerate(sample_idx):
                num = self.batch.num_logprobs.get(step.req_ids[i])
                if num is not None:
                    logprobs[i] = [_row_logprobs(output.logprobs, j, num)]

    def _forward(self, step: StepInputs) -> torch.Tensor | None:
        """The final hidden states of the step's tokens, padding rows cut off; None on a pipeline
        stage before the last, which hands its residual stream on to the next instead."""
        padded = step.decode_size(self.decode_sizes) if self.decode_sizes else None
        graphed = padded is not None and self.graphs is not None
        input_ids, positions, metadata = self.buffers.load(step, padded, full_block_tables=graphed)
        if self.lora is not None:
            self.lora.batch.set_token_slots(_token_lora_slots(self.batch.lora_slot[step.rows], step,
                                                              len(input_ids)))
        if self.pipelined:
            return self._forward_stage(input_ids, positions, metadata, step.num_tokens)
        hidden = self.graphs.replay(padded) if graphed else self.model(input_ids, positions, metadata)
        return hidden[: step.num_tokens]

    def _forward_stage(self, input_ids, positions, metadata, num_tokens: int) -> torch.Tensor | None:
        stream = None
        if not distributed.is_first_stage():
            # Every rank builds the same step, so the stream's size is known without asking.
            received = torch.empty(2, len(input_ids), self.config.model.hidden_size,
                                   dtype=self.config.model.torch_dtype, device=self.device)
            stream = tuple(distributed.receive_from_previous_stage(received))
        out = self.model(input_ids, positions, metadata, stream)
        if distributed.is_last_stage():
            return out[:num_tokens]
        distributed.send_to_next_stage(torch.stack(out))
        return None

    def _update_batch(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.batch.remove_request(req_id)
            self.logits_state.remove_request(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            self.batch.remove_request(req_id, preempted=True)
            self.logits_state.remove_request(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.batch.add_request(new)
            self.logits_state.add_request(new)
        for assignment in scheduler_output.lora_assignments:
            self.lora.assign(assignment)
        for cached in scheduler_output.scheduled_cached_reqs:
            row = self.batch.row_of[cached.req_id]
            self.batch.append_blocks(row, cached.new_block_ids)
            if cached.new_token_ids:
                self.batch.extend_tokens(row, cached.new_token_ids)
        if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids or scheduler_output.scheduled_new_reqs:
            # A request id may come back with other parameters (finished, then reused).
            self._sampled_req_ids = None
        self.batch.condense()

    def _sampling_metadata(self, rows: np.ndarray, req_ids: list[str]) -> SamplingMetadata:
        # A request's sampling parameters never change, so the rows' settings are a function of
        # the sampled requests in their order: the same list as last step (most steps, unless
        # requests came or went) reuses them.
        if req_ids != self._sampled_req_ids:
            self._sampled_req_ids, self._sampling_settings = list(req_ids), self._sampling_settings_of(rows, req_ids)
        return SamplingMetadata(
            **self._sampling_settings,
            adjustments=self.logits_state.adjustments(req_ids, lambda i: self.batch.output_token_ids(rows[i])),
        )

    def _sampling_settings_of(self, rows: np.ndarray, req_ids: list[str]) -> dict:
        """SamplingMetadata's fields that depend on the requests alone (not on their tokens)."""
        temperature = self.batch.temperature[rows]
        top_k, top_p, min_p = self.batch.top_k[rows], self.batch.top_p[rows], self.batch.min_p[rows]
        greedy = temperature < GREEDY_TEMPERATURE
        # The per-request lookups run only while some request in the batch uses them.
        asked = [self.batch.num_logprobs[r] for r in req_ids if r in self.batch.num_logprobs] \
            if self.batch.num_logprobs else []
        generators = self.batch.generators
        return dict(
            temperature=to_device(temperature, self.device),
            top_k=to_device(top_k, self.device) if (top_k > 0).any() else None,
            top_p=to_device(top_p, self.device) if (top_p < 1).any() else None,
            min_p=to_device(min_p, self.device) if (min_p > 0).any() else None,
            generators={i: generators[r] for i, r in enumerate(req_ids) if r in generators} if generators else {},
            max_num_logprobs=max(asked) if asked else None,
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
        )

    def _grammar_bitmask(self, grammar: GrammarBitmask | None, req_ids: list[str]
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The engine core's masks, on the rows (of `req_ids`, the sampled requests) they belong to."""
        if grammar is None:
            return None
        sample_row = {req_id: i for i, req_id in enumerate(req_ids)}
        masks = torch.frombuffer(bytearray(grammar.bitmask), dtype=torch.int32).view(len(grammar.req_ids), -1)
        rows = [sample_row[req_id] for req_id in grammar.req_ids]
        return to_device(rows, self.device), to_device(masks, self.device)

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        """Logprobs of each prompt token given the ones before it, for this step's chunk of the prompt."""
        chunks: dict[str, PromptLogprobsChunk] = {}
        if not self.batch.num_prompt_logprobs:
            return chunks
        for i, req_id in enumerate(step.req_ids):
            num = self.batch.num_prompt_logprobs.get(req_id)
            if num is None:
                continue
            row, start = step.rows[i], step.starts[i]
            # Position p predicts token p + 1; the last prompt position predicts an output token.
            end = min(step.seq_lens[i], self.batch.num_prompt_tokens[row] - 1)
            if end <= start:
                continue
            first = step.query_start_loc[i]
            logits = self.model.compute_logits(hidden[first : first + end - start]).float()
            targets = to_device(self.batch.token_ids[row, start + 1 : end + 1], self.device)
            gathered = gather_logprobs(torch.log_softmax(logits, dim=-1), num, targets)
            chunks[req_id] = PromptLogprobsChunk(
                start=int(start) + 1,
                entries=[_row_logprobs(gathered, j, num) for j in range(end - start)],
            )
        return chunks


def _token_lora_slots(row_slots: np.ndarray, step: StepInputs, num_tokens: int) -> np.ndarray:
    """Each of the step's `num_tokens` tokens' adapter slot: its request's, -1 for padding."""
    slots = np.repeat(row_slots, np.diff(step.query_start_loc))
    return np.pad(slots, (0, num_tokens - len(slots)), constant_values=-1)


def _row_logprobs(tensors, row: int, num: int) -> TokenLogprobs:
    rank = int(tensors.ranks[row])
    return TokenLogprobs(
        token_ids=tensors.token_ids[row, : num + 1].tolist(),
        logprobs=tensors.logprobs[row, : num + 1].tolist(),
        ranks=[rank, *range(1, num + 1)],
    )
