"""The model runner: applies a SchedulerOutput to the persistent batch, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.runtime.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from kvpilot.runtime.core.sched.output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from kvpilot.runtime.layers.attention import AttentionMetadata, get_attention_backend
from kvpilot.runtime.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from kvpilot.runtime.models.loader import load_model
from kvpilot.runtime.outputs import PromptLogprobsChunk, TokenLogprobs
from kvpilot.runtime.request import GREEDY_TEMPERATURE
from kvpilot.runtime.worker.input_batch import InputBatch
from kvpilot.runtime.worker.logits_state import LogitsState


class ModelRunner:
    """One rank's model, KV cache and persistent batch; with TP 1 it is the whole executor."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        self.model = load_model(config.model, get_attention_backend(config.model.attention_backend, device), device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device).manual_seed(config.model.seed)
        self.batch = InputBatch(
            max_num_reqs=config.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            max_blocks_per_req=-(-self.max_model_len // self.block_size),
        )
        eos = config.model.eos_token_ids
        self.logits_state = LogitsState(config.model.vocab_size, eos[0] if eos else None, device)

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

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives in its caller's process."""

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])

        step = _StepInputs.build(self.batch, scheduler_output.num_scheduled_tokens, self.block_size)
        # The scheduler advances its counts the same way and ships none for a plain decode.
        self.batch.num_computed_tokens[step.rows] = step.seq_lens
        metadata = step.attention_metadata(self.device)
        hidden = self.model(
            _tensor(step.input_ids, self.device),
            _tensor(step.positions, self.device),
            metadata,
        )
        prompt_logprobs = self._prompt_logprobs(step, hidden)

        # A request samples only once every token it has is computed; a partial prefill chunk does not.
        done = step.seq_lens == self.batch.num_tokens[step.rows]
        sample_idx = np.flatnonzero(done)
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(step.req_ids)
        if len(sample_idx):
            last_token = _tensor(step.query_start_loc[1:][sample_idx] - 1, self.device)
            logits = self.model.compute_logits(hidden[last_token])
            sample_ids = [step.req_ids[i] for i in sample_idx]
            metadata = self._sampling_metadata(step.rows[sample_idx], sample_ids)
            metadata.grammar_bitmask = self._grammar_bitmask(scheduler_output.grammar_bitmask, sample_ids)
            output = self.sampler(logits, metadata, self.generator)
            self.logits_state.record_sampled(sample_ids, output.sampled_token_ids)
            tokens = output.sampled_token_ids.tolist()
            for j, i in enumerate(sample_idx):
                sampled[i] = [tokens[j]]
                self.batch.append_token(step.rows[i], tokens[j])
                num = self.batch.num_logprobs.get(step.req_ids[i])
                if num is not None and output.logprobs is not None:
                    logprobs[i] = [_row_logprobs(output.logprobs, j, num)]
        return ModelRunnerOutput(
            req_ids=step.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

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
        for cached in scheduler_output.scheduled_cached_reqs:
            row = self.batch.row_of[cached.req_id]
            self.batch.append_blocks(row, cached.new_block_ids)
        self.batch.condense()

    def _sampling_metadata(self, rows: np.ndarray, req_ids: list[str]) -> SamplingMetadata:
        temperature = self.batch.temperature[rows]
        top_k, top_p, min_p = self.batch.top_k[rows], self.batch.top_p[rows], self.batch.min_p[rows]
        greedy = temperature < GREEDY_TEMPERATURE
        asked = [self.batch.num_logprobs[r] for r in req_ids if r in self.batch.num_logprobs]
        return SamplingMetadata(
            temperature=_tensor(temperature, self.device),
            top_k=_tensor(top_k, self.device) if (top_k > 0).any() else None,
            top_p=_tensor(top_p, self.device) if (top_p < 1).any() else None,
            min_p=_tensor(min_p, self.device) if (min_p > 0).any() else None,
            generators={i: self.batch.generators[r] for i, r in enumerate(req_ids) if r in self.batch.generators},
            max_num_logprobs=max(asked) if asked else None,
            adjustments=self.logits_state.adjustments(req_ids, lambda i: self.batch.output_token_ids(rows[i])),
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
        return torch.tensor(rows, device=self.device), masks.to(self.device)

    def _prompt_logprobs(self, step: "_StepInputs", hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        """Logprobs of each prompt token given the ones before it, for this step's chunk of the prompt."""
        chunks: dict[str, PromptLogprobsChunk] = {}
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
            targets = _tensor(self.batch.token_ids[row, start + 1 : end + 1], self.device)
            gathered = gather_logprobs(torch.log_softmax(logits, dim=-1), num, targets)
            chunks[req_id] = PromptLogprobsChunk(
                start=int(start) + 1,
                entries=[_row_logprobs(gathered, j, num) for j in range(end - start)],
            )
        return chunks


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _row_logprobs(tensors, row: int, num: int) -> TokenLogprobs:
    rank = int(tensors.ranks[row])
    return TokenLogprobs(
        token_ids=tensors.token_ids[row, : num + 1].tolist(),
        logprobs=tensors.logprobs[row, : num + 1].tolist(),
        ranks=[rank, *range(1, num + 1)],
    )


@dataclass(frozen=True)
class _StepInputs:
    """Flattened inputs of one step, in batch-row order, computed with vectorised host arrays.

    Per request (in `req_ids` order): rows, starts, seq_lens, query_start_loc (one more entry).
    Per scheduled token: positions, input_ids, slot_mapping.
    """

    req_ids: list[str]
    rows: np.ndarray
    # Tokens already in the KV cache before this step.
    starts: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    positions: np.ndarray
    input_ids: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    max_query_len: int

    @classmethod
    def build(cls, batch: InputBatch, num_scheduled: dict[str, int], block_size: int) -> "_StepInputs":
        req_ids = [r for r in batch.req_ids if r is not None and r in num_scheduled]
        rows = np.array([batch.row_of[r] for r in req_ids], dtype=np.int64)
        counts = np.array([num_scheduled[r] for r in req_ids], dtype=np.int64)
        starts = batch.num_computed_tokens[rows]
        seq_lens = starts + counts
        query_start_loc = np.concatenate(([0], np.cumsum(counts)))

        token_rows = np.repeat(rows, counts)
        offsets = np.arange(query_start_loc[-1]) - np.repeat(query_start_loc[:-1], counts)
        positions = np.repeat(starts, counts) + offsets
        block_ids = batch.block_table[token_rows, positions // block_size]
        max_blocks = int(-(-seq_lens.max() // block_size))
        return cls(
            req_ids=req_ids, rows=rows, starts=starts, seq_lens=seq_lens, query_start_loc=query_start_loc,
            positions=positions, input_ids=batch.token_ids[token_rows, positions],
            slot_mapping=block_ids * block_size + positions % block_size,
            block_tables=batch.block_table[rows, :max_blocks], max_query_len=int(counts.max()),
        )

    def attention_metadata(self, device: torch.device) -> AttentionMetadata:
        decoding = np.diff(self.query_start_loc) == 1
        decode_reqs = np.flatnonzero(decoding)
        return AttentionMetadata(
            slot_mapping=_tensor(self.slot_mapping, device),
            query_start_loc=_tensor(self.query_start_loc, device),
            seq_lens=_tensor(self.seq_lens, device),
            block_tables=_tensor(self.block_tables, device),
            max_query_len=self.max_query_len,
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc_cpu=self.query_start_loc.tolist(),
            seq_lens_cpu=self.seq_lens.tolist(),
            decode_reqs=_tensor(decode_reqs, device),
            decode_tokens=_tensor(self.query_start_loc[decode_reqs], device),
            prefill_reqs=np.flatnonzero(~decoding).tolist(),
        )
