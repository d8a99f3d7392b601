"""The unified token-budget scheduler: each step maps requests to token counts, with no phases.

A request only has tokens computed (`num_computed_tokens`) and tokens not yet computed; a prompt
chunk and a decode token are the same kind of work. `schedule()` hands out one step's budget of
`max_num_batched_tokens`:

1. Running requests first, in admission order: each gets what it has left, capped by
   `long_prefill_token_threshold` and the budget. When the KV-cache manager has no room for
   it, a victim (the last admitted, or under `priority` the largest (priority, arrival)) is
   preempted by recompute: its blocks are freed and it waits again, at the head of an FCFS
   queue or in its place by (priority, arrival) in a priority queue.
2. Then, unless this step preempted, waiting requests in queue order, each starting after its
   longest prefix-cache hit, until the budget, `max_num_seqs` or the blocks run out. The head
   that does not fit stops admission, so a long request is never starved by shorter ones. Passed
   over, keeping their places: a request whose grammar is still compiling, and one whose LoRA
   adapter finds every adapter slot in use by running requests of other adapters (at most
   `max_loras` adapters run in one step; the slot changes go to the workers with the step).

`update_from_output()` appends the sampled tokens and runs the stop checks (min_tokens, EOS and
stop token ids, then max_tokens; and a complete grammar); `finish_requests()` ends requests from
outside (aborts, stop strings). Each finished id reaches the runner in the next SchedulerOutput.
Under async scheduling a step is scheduled before the previous one's tokens are known: a request
whose step will sample counts a placeholder for that token until it arrives.

Under pipeline parallelism up to `pipeline_depth` steps are in flight, one in each stage. A request
waits while its token is in flight (no stage but the last has it), and each step takes at most
1/pipeline_depth of the running requests, so that the next step has others to run while this one
moves through the later stages. The tokens reach the runners with each request's next step.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.runtime.config import SchedulerConfig, SchedulingPolicy
from kvpilot.runtime.core.kv_cache_manager import KVCacheManager
from kvpilot.runtime.core.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvpilot.runtime.core.sched.request_queue import create_request_queue
from kvpilot.runtime.lora.slots import LoRASlots
from kvpilot.runtime.outputs import EngineCoreOutput
from kvpilot.runtime.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 lora_slots: LoRASlots | None = None, pipeline_depth: int = 1) -> None:
        """`lora_slots`: the device's adapter slots, when the engine serves LoRA adapters;
        `pipeline_depth`: the pipeline stages, so the steps in flight at once."""
        self.config = config
        self.pipeline_depth = pipeline_depth
        self.kv_cache_manager = kv_cache_manager
        self.lora_slots = lora_slots
        self._policy = SchedulingPolicy.parse(config.policy)
        self.waiting = create_request_queue(self._policy)
        # Admission order; a dict so that removal is O(1) and the last admitted is at the end.
        self.running: dict[str, Request] = {}
        # Every unfinished request, waiting or running.
        self.requests: dict[str, Request] = {}
        # Finished or aborted since the last schedule(): the runner drops their rows.
        self._finished_req_ids: list[str] = []
        # Ids of requests that ended with tokens still in flight (async scheduling), with how many:
        # those tokens are not theirs, nor those of a new request that takes the id meanwhile.
        self._tokens_in_flight_for_ended: dict[str, int] = {}
        self.num_preemptions = 0

    @property
    def policy(self) -> SchedulingPolicy:
        return self._policy

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> EngineCoreOutput | None:
        """Queue the request; or, when the output it was resumed with already ends it (its last
        token a stop, or no tokens left to produce), finish it at once and return its output."""
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the scheduler")
        max_model_len = self.config.max_model_len
        if max_model_len is not None:
            request.max_tokens = min(request.max_tokens, max_model_len - request.num_prompt_tokens)
        if request.output_token_ids and self._check_stop(request, request.output_token_ids[-1]):
            return EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                    finish_reason=request.finish_reason, stop_reason=request.stop_reason)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        return None

    def set_policy(self, policy: SchedulingPolicy | str) -> None:
        """Live from the next step; ValueError for a policy the scheduler does not know."""
        policy = SchedulingPolicy.parse(policy)
        queue = create_request_queue(policy)
        if policy == self._policy:
            return
        # Preempted requests sit at the head of an FCFS queue, in the order they went back; the
        # rest follow by arrival. A priority queue ignores the order it is filled in.
        preempted = [r for r in self.waiting if r.status == RequestStatus.PREEMPTED]
        fresh = [r for r in self.waiting if r.status != RequestStatus.PREEMPTED]
        for request in preempted + sorted(fresh, key=lambda r: (r.arrival_time, r.request_id)):
            queue.add_request(request)
        self.waiting = queue
        self._policy = policy

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        # Only the running requests that gained blocks: the rest ship nothing but their count.
        cached_reqs: dict[str, CachedRequestData] = {}
        preempted: list[str] = []
        allocate_slots = self.kv_cache_manager.allocate_slots
        without_allocation = self.kv_cache_manager.num_tokens_without_allocation
        threshold = self.config.long_prefill_token_threshold
        running_status = RequestStatus.RUNNING
        pipelined = self.pipeline_depth > 1
        running_share = -(-len(self.running) // self.pipeline_depth)

        # Runs for every running request every step: _chunk and the fast path of allocate_slots
        # are inlined.
        for request in list(self.running.values()):
            if budget == 0:
                break
            # A victim of an earlier preemption in this loop.
            if request.status != running_status:
                continue
            # Under async scheduling the tokens in flight may already be all it may produce; and a
            # grammar's next mask needs the token in flight, so its request waits for it.
            placeholders = request.num_output_placeholders
            if placeholders and (pipelined or request.structured_output_request is not None
                                 or len(request.output_token_ids) + placeholders >= request.max_tokens):
                continue
            if pipelined and len(num_scheduled) == running_share:
                break
            req_id = request.request_id
            num_new = len(request.all_token_ids) + placeholders - request.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if request.num_computed_tokens + num_new <= without_allocation.get(req_id, -1):
                num_scheduled[req_id] = num_new
                budget -= num_new
                continue
            while (blocks := allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim.request_id in num_scheduled:
                    budget += num_scheduled.pop(victim.request_id)
                    cached_reqs.pop(victim.request_id, None)
                if victim is request:
                    break
            if blocks is None:
                continue
            num_scheduled[req_id] = num_new
            if blocks:
                cached_reqs[req_id] = CachedRequestData(req_id, [b.block_id for b in blocks])
            budget -= num_new
        if pipelined:
            self._ship_new_tokens(num_scheduled, cached_reqs)

        new_reqs = [] if preempted else self._admit_waiting(budget, num_scheduled)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=list(cached_reqs.values()),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=preempted,
            lora_assignments=self.lora_slots.take_assignments() if self.lora_slots is not None else [],
        )
        self._finished_req_ids = []
        # The output carries the counts at the start of the step; from here on they include what
        # this step computes. A request that reaches its end samples a token not known until the
        # step's output comes back: a placeholder until then.
        requests = self.requests
        for req_id, num_new in num_scheduled.items():
            request = requests[req_id]
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return output

    def _ship_new_tokens(self, num_scheduled: dict[str, int], cached_reqs: dict[str, CachedRequestData]) -> None:
        """Each scheduled running request's tokens that the runners do not hold: those sampled since
        they last heard of it."""
        for req_id in num_scheduled:
            request = self.requests[req_id]
            all_token_ids = request.all_token_ids
            if request.num_tokens_at_runners < len(all_token_ids):
                cached = cached_reqs.setdefault(req_id, CachedRequestData(req_id, []))
                cached.new_token_ids = all_token_ids[request.num_tokens_at_runners:]
                request.num_tokens_at_runners = len(all_token_ids)

    def _chunk(self, request: Request, budget: int, num_hit: int = 0) -> int:
        # A prefix hit is capped at num_tokens - 1, so at least one token is left to compute.
        num_new = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens - num_hit
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int]) -> list[NewRequestData]:
        """Admit from the head of the waiting queue until budget, seats or blocks run out."""
        admitted: list[NewRequestData] = []
        # Requests whose grammar is still compiling, whose adapter has no slot, or (preempted under
        # pipeline parallelism) whose token is still in flight: they keep their place, the rest go ahead.
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:
                passed_over.append(self.waiting.pop_request())
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_ready:
                    passed_over.append(self.waiting.pop_request())
                    continue
                request.status = RequestStatus.WAITING
            lora = request.lora_request
            if lora is not None and not self.lora_slots.can_acquire(lora):
                passed_over.append(self.waiting.pop_request())
                continue
            # Waiting requests hold no KV: new ones have none yet, preempted ones gave it back.
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = self._chunk(request, budget, num_hit)
            if self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks, num_hit) is None:
                # Head-of-line: skipping ahead would starve the head.
                break
            self.waiting.pop_request()
            lora_slot = -1 if lora is None else self.lora_slots.acquire(request.request_id, lora)
            self.running[request.request_id] = request
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            request.num_tokens_at_runners = len(request.all_token_ids)
            admitted.append(NewRequestData(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=num_hit,
                lora_slot=lora_slot,
            ))
        for request in reversed(passed_over):
            self.waiting.prepend_request(request)
        return admitted

    def _pick_victim(self) -> Request:
        if self._policy == SchedulingPolicy.PRIORITY:
            return max(self.running.values(), key=lambda r: (r.priority, r.arrival_time))
        return next(reversed(self.running.values()))

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV and start over from the head of the queue."""
        self.kv_cache_manager.free(request)
        del self.running[request.request_id]
        self._release_lora_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens, check stops, and say what each request got.

        `scheduler_output` is the step these tokens answer; the runner's output is
        self-contained, so it is not read.
        """
        outputs: list[EngineCoreOutput] = []
        mro = model_runner_output
        requests = self.requests
        all_sampled = mro.sampled_token_ids
        all_logprobs = mro.logprobs
        all_prompt_logprobs = mro.prompt_logprobs
        ended = self._tokens_in_flight_for_ended
        # This loop runs for every request every step: Request.append_output_token_id and the
        # no-stop-possible case of _check_stop are inlined.
        for index, req_id in enumerate(mro.req_ids):
            sampled = all_sampled[index]
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            # A prefill chunk that samples nothing changes nothing here.
            if not sampled and prompt_logprobs is None:
                continue
            if ended and sampled and req_id in ended:
                self._drop_token_in_flight(req_id)
                continue
            request = requests.get(req_id)
            # Ended after the step was scheduled, in a prefill chunk (prompt logprobs, no token).
            if request is None:
                continue
            # The runner's list is ours now: it is the output unless a stop cuts it short.
            new_token_ids = sampled
            finish_reason = None
            grammar = request.structured_output_request
            output_token_ids = request.output_token_ids
            for i, token_id in enumerate(sampled):
                request.num_output_placeholders -= 1
                output_token_ids.append(token_id)
                request.all_token_ids.append(token_id)
                if grammar is not None:
                    grammar.accept(token_id)
                # Only a stopping token or the last token allowed can stop the request.
                if ((token_id in request.stopping_token_ids or len(output_token_ids) >= request.max_tokens)
                        and self._check_stop(request, token_id)):
                    pass
                elif grammar is not None and grammar.is_finished:
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    continue
                finish_reason = request.status.finish_reason
                new_token_ids = sampled[: i + 1]
                break
            logprobs = all_logprobs[index]
            if logprobs is not None and len(logprobs) != len(new_token_ids):
                logprobs = logprobs[: len(new_token_ids)]
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
            if finish_reason is not None:
                # A request preempted while this step ran waits to resume, and can finish there.
                if self.running.pop(req_id, None) is None:
                    self.waiting.remove_request(request)
                self._forget(request)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set the finished status if `token_id`, just appended, ends the request."""
        num_output = len(request.output_token_ids)
        if token_id in request.stopping_token_ids and num_output >= request.sampling_params.min_tokens:
            request.status = RequestStatus.FINISHED_STOPPED
            # EOS comes first: it names no stop reason even when it is a stop token id as well.
            if token_id != request.eos_token_id or request.sampling_params.ignore_eos:
                request.stop_reason = token_id
            return True
        # max_tokens is bounded by the room the model length leaves (add_request).
        if num_output >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def finish_requests(self, request_ids: Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string); unknown ids are ignored."""
        if not finished_status.is_finished:
            raise ValueError(f"{finished_status.name} is not a finished status")
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                del self.running[req_id]
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._forget(request)

    def _forget(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._release_lora_slot(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)
        if request.num_output_placeholders:
            self._tokens_in_flight_for_ended[request.request_id] = request.num_output_placeholders

    def _release_lora_slot(self, request: Request) -> None:
        if request.lora_request is not None:
            self.lora_slots.release(request.request_id)

    def running_lora_adapters(self) -> list[str]:
        return self.lora_slots.running_adapters() if self.lora_slots is not None else []

    def waiting_lora_adapters(self) -> list[str]:
        """The adapters of waiting requests, each once, in queue order."""
        names = (r.lora_request.lora_name for r in self.waiting if r.lora_request is not None)
        return list(dict.fromkeys(names))

    def _drop_token_in_flight(self, req_id: str) -> None:
        left = self._tokens_in_flight_for_ended.pop(req_id) - 1
        if left:
            self._tokens_in_flight_for_ended[req_id] = left
