"""EngineCore: owns the scheduler, the KV-cache manager and the model runner, and steps them.

One step is `schedule -> execute -> update`. This class is the in-process core; the serving
process wraps it in a loop with ZMQ sockets.

With async scheduling (vLLM's --async-scheduling) the model runs on a thread of its own and the
core keeps two steps in flight: step N+1 is scheduled while step N runs, its requests' unsampled
tokens counted as placeholders (the runner feeds each decode the token it sampled itself), and
step N's tokens are applied once it returns. A request that finished in step N still runs in
step N+1; that token is not its own and is dropped. Torch releases the GIL in its kernels, so
the scheduling overlaps the model even on a CPU.

With pipeline parallelism the core keeps a step in flight for each stage, whatever
--async-scheduling says: it submits steps to the executor until as many are in flight as there are
stages or nothing else can run (the scheduler holds a request back while its token is in flight),
then applies the oldest.

With KV-cache events on (--kv-events-config), what a step stored in and evicted from the prefix
cache is queued for the publisher's thread at the end of the step, and what an abort or a reset
changed at the end of that call (engine/kv_event_publisher.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.core.sched.output import ModelRunnerOutput, SchedulerOutput
from kvpilot.runtime.core.sched.scheduler import Scheduler
from kvpilot.runtime.engine.kv_event_publisher import KVEventPublisher
from kvpilot.runtime.engine.messages import EngineStats
from kvpilot.runtime.engine.validation import validate_request
from kvpilot.runtime.lora.adapter import load_adapter
from kvpilot.runtime.lora.host_cache import AdapterLRU
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.lora.slots import LoRASlots
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.outputs import EngineCoreOutput
from kvpilot.runtime.request import Request, RequestStatus
from kvpilot.runtime.structured_output.manager import StructuredOutputManager
from kvpilot.runtime.worker.executor import create_executor

# How long a step with nothing to run but grammars to compile waits for one of them.
GRAMMAR_WAIT_SECONDS = 0.05

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class EngineCore:
    def __init__(self, config: EngineConfig, device: torch.device | None = None) -> None:
        self.config = config
        self.executor = create_executor(config, device or default_device())
        self.num_kv_blocks = self._num_kv_blocks()
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        kv_events = config.cache.kv_events_config
        publishes_kv_events = kv_events is not None and kv_events.publishes
        self.kv_cache_manager = KVCacheManager(
            self.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            enable_kv_cache_events=publishes_kv_events,
        )
        lora = config.lora
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager,
                                   LoRASlots(lora.max_loras) if lora.enable_lora else None,
                                   pipeline_depth=config.parallel.pipeline_parallel_size)
        # The adapters the workers hold in host memory: the same calls as theirs, in the same order
        # (host_cache.py), so this is what they hold, without the weights.
        self.loaded_loras: AdapterLRU[None] | None = \
            AdapterLRU(lora.max_cpu_loras or lora.max_loras) if lora.enable_lora else None
        # Adapters added and not removed since. A request queued before its adapter was removed
        # brings it back into the host caches; it is not reported as loaded for that.
        self._added_lora_ids: set[int] = set()
        # A checkpoint may list several EOS tokens (Llama 3.1 Instruct: <|end_of_text|>, <|eom_id|>,
        # <|eot_id|>, and a chat turn ends with the last). A request names the first as its EOS; the
        # others end it as stop token ids do, as in vLLM.
        self._other_eos_token_ids = frozenset(config.model.eos_token_ids[1:])
        self.structured_output = StructuredOutputManager(
            lambda: load_tokenizer(config.model.path, config.model.tokenizer)[0].to_str(),
            config.model.vocab_size, config.model.eos_token_ids,
        )
        # Grammars of waiting requests that were still compiling at the last step, by request id.
        self._compiling: dict = {}
        # Unfinished requests with a grammar (finished ones are dropped at the next step): a step
        # without any looks at none.
        self._grammar_requests: dict[str, Request] = {}
        # Queue times measured at first scheduling, waiting to ride on the request's next output.
        self._queue_times: dict[str, float] = {}
        self._pipeline_depth = config.parallel.pipeline_parallel_size
        self._model_thread = (ThreadPoolExecutor(1, thread_name_prefix="engine-model")
                              if config.scheduler.async_scheduling and self._pipeline_depth == 1 else None)
        # Steps submitted, oldest first, each with what waits for its output.
        self._in_flight: deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = deque()
        # Last, so that a port in use fails the start only after everything else could start.
        self.kv_event_publisher = (
            KVEventPublisher(kv_events, config.cache.block_size, self.kv_cache_manager.cached_block_hashes)
            if publishes_kv_events else None
        )

    def _num_kv_blocks(self) -> int:
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        budget = self.executor.kv_cache_budget_bytes()
        # More than every sequence at full length (plus the null block) could never be used.
        enough = sched.max_num_seqs * -(-sched.max_model_len // cache.block_size) + 1
        num_blocks = min(budget // self.executor.kv_cache_bytes_per_block(), enough)
        if num_blocks < 2:
            raise ValueError(f"the KV-cache budget of {budget} bytes is too small for one KV block")
        return num_blocks

    def validate(self, prompt_token_ids: list[int], params, resume_token_ids: Sequence[int] = ()) -> None:
        validate_request(
            prompt_token_ids, params,
            max_model_len=self.config.scheduler.max_model_len,
            vocab_size=self.config.model.vocab_size,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.cache.block_size,
            resume_token_ids=resume_token_ids,
        )

    def add_request(self, request: Request) -> EngineCoreOutput | None:
        """Queue the request; returns its final output instead when the output it was resumed with
        already ends it (see Scheduler.add_request)."""
        self.validate(request.prompt_token_ids, request.sampling_params, request.output_token_ids)
        self._check_lora(request)
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if self._other_eos_token_ids and not request.sampling_params.ignore_eos:
            request.stopping_token_ids = request.stopping_token_ids | self._other_eos_token_ids
        if request.sampling_params.structured_outputs is not None:
            request.structured_output_request = self.structured_output.request_for(
                request.sampling_params.structured_outputs)
            request.status = RequestStatus.WAITING_FOR_FSM
            self._compiling[request.request_id] = request.structured_output_request
            self._grammar_requests[request.request_id] = request
        return self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._queue_times.pop(request_id, None)
            self._compiling.pop(request_id, None)
        # Blocks published when scheduled but never computed were just evicted.
        self._publish_kv_events()

    def has_unfinished_requests(self) -> bool:
        # A step in flight still has outputs to deliver (or to drop) before the core is idle.
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> list[EngineCoreOutput]:
        if self._pipeline_depth > 1:
            outputs = self._step_in_flight(self._pipeline_depth, self._into_pipeline)
        elif self._model_thread is not None:
            outputs = self._step_in_flight(2, self._on_model_thread)
        else:
            outputs = self._step_sync()
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        if self.kv_event_publisher is not None and (events := self.kv_cache_manager.take_kv_events()):
            self.kv_event_publisher.publish(events)

    def _step_sync(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        failed = self._check_compiled()
        scheduler_output = self._schedule(allow_idle=bool(self._compiling or failed))
        if scheduler_output is None:
            self._wait_for_grammars()
            return failed
        return failed + self._update(scheduler_output, self.executor.execute_model(scheduler_output))

    def _step_in_flight(self, depth: int, submit: Callable[[SchedulerOutput], Callable[[], ModelRunnerOutput]]
                        ) -> list[EngineCoreOutput]:
        """Submit the next step unless `depth` are in flight, then apply the oldest once that many
        are or nothing else can run. `submit` starts a step and returns what waits for its output."""
        failed = self._check_compiled()
        if self.scheduler.has_unfinished_requests() and len(self._in_flight) < depth:
            # Nothing to run can be right while a step is in flight: its tokens decide what comes next.
            # So can grammars still compiling.
            scheduler_output = self._schedule(allow_idle=bool(self._in_flight or self._compiling or failed))
            if scheduler_output is not None:
                self._in_flight.append((scheduler_output, submit(scheduler_output)))
                if len(self._in_flight) < depth:
                    return failed
            elif not self._in_flight:
                self._wait_for_grammars()
        if not self._in_flight:
            return failed
        scheduler_output, output = self._in_flight.popleft()
        return failed + self._update(scheduler_output, output())

    def _on_model_thread(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        return self._model_thread.submit(self.executor.execute_model, scheduler_output).result

    def _into_pipeline(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        # The executor answers in the order the steps went in, as the core applies them.
        self.executor.submit_model(scheduler_output)
        return self.executor.collect_model

    def _schedule(self, allow_idle: bool = False) -> SchedulerOutput | None:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not (scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids):
            if allow_idle:
                return None
            # Every request fits the pool on its own (validate), so an idle step means a scheduler bug;
            # failing beats spinning forever.
            raise RuntimeError(f"scheduler made no progress with {self.scheduler.num_waiting} waiting requests")
        self._note_queue_times(scheduler_output)
        for assignment in scheduler_output.lora_assignments:
            self.loaded_loras.use(assignment.lora_request, _nothing)
        scheduler_output.grammar_bitmask = self._grammar_bitmask(scheduler_output)
        return scheduler_output

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput):
        """Masks for the requests with a grammar that sample this step (their last token is scheduled).

        Under async scheduling the scheduler holds a grammar request back while a token of it is in
        flight, so each mask here follows every token the request has.
        """
        sampling = []
        for req_id, request in list(self._grammar_requests.items()):
            if request.is_finished:
                del self._grammar_requests[req_id]
            # schedule() has advanced num_computed_tokens past this step's tokens already.
            elif req_id in scheduler_output.num_scheduled_tokens and request.num_computed_tokens == request.num_tokens:
                sampling.append((req_id, request.structured_output_request, request.output_token_ids))
        return self.structured_output.grammar_bitmask(sampling)

    def _check_compiled(self) -> list[EngineCoreOutput]:
        """Forget the grammars compiled since the last step, and abort the requests whose grammar
        failed. The frontend checks each grammar first, so a failure here is a disagreement between
        the two (a tokenizer-specific one)."""
        if not self._compiling:
            return []
        failed = {}
        for req_id, grammar in list(self._compiling.items()):
            if grammar.is_ready:
                del self._compiling[req_id]
                if grammar.error is not None:
                    logger.error("refused request %s: its grammar failed to compile: %s", req_id, grammar.error)
                    failed[req_id] = f"the structured output's grammar did not compile: {grammar.error}"
        self.abort_requests(failed)
        return [EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason="abort", error=error)
                for req_id, error in failed.items()]

    def _wait_for_grammars(self) -> None:
        """Nothing to run but grammars to compile: sleep on them rather than spin."""
        if self._compiling:
            self.structured_output.wait_for_any(self._compiling.values(), GRAMMAR_WAIT_SECONDS)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        # Only steps after an admission have queue times to hand out: the rest skip the scan.
        if self._queue_times:
            for output in outputs:
                output.queue_time = self._queue_times.pop(output.request_id, None)
        return outputs

    def _note_queue_times(self, scheduler_output) -> None:
        now = time.monotonic()
        for new in scheduler_output.scheduled_new_reqs:
            request = self.scheduler.requests[new.req_id]
            # A resumed request was queued once already; only the first wait counts.
            if request.num_preemptions == 0:
                self._queue_times[new.req_id] = now - request.arrival_time

    def _check_lora(self, request: Request) -> None:
        lora = request.lora_request
        if lora is None:
            return
        if self.loaded_loras is None:
            raise ValueError(f"request {request.request_id!r} names the LoRA adapter {lora.lora_name!r}, "
                             "but LoRA is not enabled (--enable-lora)")
        if lora.lora_int_id not in self.loaded_loras:
            # Evicted from host memory: the workers will read it from its folder again. A folder
            # gone or broken since is this request's error here, not a worker's failure later.
            load_adapter(lora.lora_name, lora.lora_path, self.config.model, self.config.lora.max_lora_rank)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads the adapter into the workers' host caches; LoRAAdapterError (naming the adapter and
        the problem) when it does not fit the model, with nothing changed."""
        if self.loaded_loras is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        # Read here first: a worker that failed to load it would fail the engine.
        load_adapter(lora_request.lora_name, lora_request.lora_path, self.config.model, self.config.lora.max_lora_rank)
        self._in_model_order(self.executor.add_lora, lora_request)
        self.loaded_loras.use(lora_request, _nothing)
        self._added_lora_ids.add(lora_request.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drops the adapter from the host caches. Requests already queued with it still run: they
        carry its path, and a slot is filled from it again if need be."""
        if self.loaded_loras is None:
            raise ValueError("LoRA is not enabled (--enable-lora)")
        self._in_model_order(self.executor.remove_lora, lora_int_id)
        self.loaded_loras.remove(lora_int_id)
        self._added_lora_ids.discard(lora_int_id)

    def _in_model_order(self, call, *args) -> None:
        """Runs `call` after the steps in flight, on the model thread under async scheduling: the
        workers' host caches change in the order the steps were scheduled in."""
        if self._model_thread is None:
            call(*args)
        else:
            self._model_thread.submit(call, *args).result()

    def set_scheduling_policy(self, policy: str) -> None:
        self.scheduler.set_policy(policy)

    def reset_prefix_cache(self) -> bool:
        reset = self.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def shutdown(self) -> None:
        if self._model_thread is not None:
            # The model thread may be inside the executor: let it finish before the executor goes.
            self._model_thread.shutdown(wait=True, cancel_futures=True)
        self._in_flight.clear()
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            scheduling_policy=self.scheduler.policy,
            running_lora_adapters=self.scheduler.running_lora_adapters(),
            waiting_lora_adapters=self.scheduler.waiting_lora_adapters(),
            loaded_lora_adapters=self._loaded_lora_names(),
        )

    def _loaded_lora_names(self) -> list[str]:
        if self.loaded_loras is None:
            return []
        return [lora.lora_name for lora in self.loaded_loras.loaded() if lora.lora_int_id in self._added_lora_ids]


def _nothing(lora_request: LoRARequest) -> None:
    """The EngineCore's host cache holds names only: loading is the workers'."""
