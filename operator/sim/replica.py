"""One engine replica at the level of its scheduler steps. Pure: times are passed in, and the
replica says when its next step ends; fleet.py keeps the clock.

It follows the engine's scheduler (DESIGN.md, "The scheduler"): one token budget per step over
decoding requests first, then prefill chunks (chunked prefill), then new requests from the
waiting queue, in `fcfs` or `priority` order, while `max_num_seqs` and the KV pool allow;
preemption by recompute (fcfs: the last admitted; priority: the largest (priority, arrival)).

Where it is exact, and where it is not:
- Steps are exact in count and in cost (the profile's formula), but a run of steps in which only
  decoding requests take part (no prefill, nobody admissible) is one event: every decoding request
  gains a token per step, so the replica keeps one step counter and each request the step at which
  it joined; the run's length and duration are solved in closed form (its step costs form an
  arithmetic series, as the context grows by one token per request per step). An arrival ends such
  a run at the end of the step in flight, as the engine's busy loop sees new requests between steps.
- KV: a request holds ceil(tokens / block_size) blocks. The pool's accounting uses the bound
  (tokens + block_size - 1) / block_size summed before the floor, which is never below the exact
  sum and at most one block per request above it, so the exact count never exceeds the pool. A
  request admitted holds blocks for its whole prompt at once (the engine allocates per chunk).
- A waiting request whose first token has not come within the request timeout is dropped from the
  queue at the next admission or control interval (its client gave up), counted as timed out.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Protocol

from kvpilot.operator.sim.profile import Profile

FCFS = "fcfs"
PRIORITY = "priority"

IDLE, STEP, RUN = 0, 1, 2


class Request:
    __slots__ = ("index", "arrival", "prompt", "output", "priority", "first_token", "generated",
                 "blocks", "remaining", "computed", "admitted", "joined", "entry")

    def __init__(self, index: int, arrival: float, prompt: int, output: int, priority: int) -> None:
        self.index = index
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.priority = priority  # the engine's order: lower runs first
        self.first_token: float | None = None
        self.generated = 0  # tokens generated before a preemption (recomputed as prompt)
        self.blocks = 0  # held while prefilling
        self.remaining = 0  # prefill tokens still to compute
        self.computed = 0
        self.admitted = 0  # admission order, for fcfs preemption
        self.joined = 0  # the replica's step count when generated tokens were 0 (decoding only)
        self.entry = -1  # its live entry in the decoding heap; -1 when not decoding


class Ledger(Protocol):
    """Where requests end; fleet.py records them per request."""

    def first_token(self, request: Request, now: float) -> None: ...
    def finished(self, request: Request, now: float) -> None: ...
    def timed_out(self, request: Request, now: float) -> None: ...


class Replica:
    __slots__ = ("name", "profile", "max_num_seqs", "max_num_batched_tokens", "timeout", "ledger", "policy",
                 "waiting", "prefilling", "decoding", "num_decoding", "sum_prompt", "sum_joined", "steps",
                 "prefill_blocks", "mode", "run_start", "run_steps", "run_first", "chunks", "preemptions",
                 "admissions", "ranked", "finished", "due", "clock", "_order", "_pool")

    def __init__(self, name: str, profile: Profile, *, max_num_seqs: int, max_num_batched_tokens: int,
                 timeout: float, ledger: Ledger, policy: str = FCFS) -> None:
        self.name = name
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.timeout = timeout
        self.ledger = ledger
        self.policy = policy
        self.waiting: list[tuple[int, float, int, Request]] = []  # a heap in the policy's order
        self.prefilling: list[Request] = []  # admitted, prompt not computed yet, in admission order
        self.decoding: list[tuple[int, int, Request]] = []  # heap of (finishing step, entry, request)
        self.num_decoding = 0
        # Context of the decoding requests at step count S: sum_prompt + num_decoding * S - sum_joined.
        self.sum_prompt = 0
        self.sum_joined = 0
        self.steps = 0
        self.prefill_blocks = 0
        self.mode = IDLE
        self.run_start = 0.0
        self.run_steps = 0
        self.run_first = 0.0  # a run's first step's cost less its context growth
        self.chunks: list[tuple[Request, int]] = []
        self.preemptions = 0
        self.finished = 0  # requests completed here: vllm:request_success_total
        # (admission number, request) in admission order; entries of requests since ended or
        # admitted again are dropped lazily. fcfs preempts the newest live one.
        self.admissions: list[tuple[int, Request]] = []
        # The same, as a heap of the largest (priority, arrival, admission) first: priority's victims.
        self.ranked: list[tuple[int, float, int, Request]] = []
        self.due = math.inf  # when the step (or run) in flight ends; inf when idle
        self.clock = 0.0  # when the last one ended
        self._order = itertools.count()
        self._pool = profile.num_gpu_blocks

    # What fleet.py asks.

    def play(self, arrivals: Sequence[Request], until: float) -> int:
        """Take `arrivals` (in time order, none after `until`) as they come, and run every step
        that ends by `until`. Returns how many steps (or runs of steps) ended."""
        when = self.due
        advance = self.advance
        ended = 0
        for request in arrivals:
            now = request.arrival
            while when < now:
                self.clock = when
                advance(when)
                when = self.due
                ended += 1
            self.add(request, now)
            when = self.due
        while when <= until:
            self.clock = when
            advance(when)
            when = self.due
            ended += 1
        return ended

    def add(self, request: Request, now: float) -> float | None:
        """Queue an arrival. Returns when the replica's next event now falls, or None when it
        is unchanged."""
        self._queue(request)
        if self.mode == IDLE:
            return self._plan(now)
        if self.mode == RUN:
            done = self._steps_done(now - self.run_start)
            if done + 1 < self.run_steps:
                self.run_steps = done + 1
                self.due = self.run_start + self._run_seconds(done + 1)
                return self.due
        return None

    def advance(self, now: float) -> float | None:
        """The step (or run of steps) in flight ends at `now`. Returns the next one's end."""
        if self.mode == STEP:
            self.steps += 1
            for request, chunk in self.chunks:
                request.computed += chunk
                request.remaining -= chunk
                if request.remaining == 0:
                    self._prefilled(request, now)
            self.chunks = []
        elif self.mode == RUN:
            self.steps += self.run_steps
        decoding = self.decoding
        while decoding and decoding[0][0] <= self.steps:
            _, entry, request = heapq.heappop(decoding)
            if request.entry == entry:
                self._stop_decoding(request)
                self.finished += 1
                self.ledger.finished(request, now)
        return self._plan(now)

    def nudge(self, now: float) -> float | None:
        """An idle replica looks at its queue again (after a policy switch changed its head)."""
        return self._plan(now) if self.mode == IDLE else None

    def set_policy(self, policy: str) -> None:
        """A live switch re-orders the waiting queue; nothing is dropped."""
        if policy != self.policy:
            self.policy = policy
            self.waiting = [self._key(request) for *_, request in self.waiting]
            heapq.heapify(self.waiting)

    def expire(self, now: float) -> None:
        """Drop the waiting requests whose clients have given up."""
        waiting = self.waiting
        if not waiting or (self.policy == FCFS and now - waiting[0][1] <= self.timeout):
            return  # fcfs: the head arrived first, so no one has waited longer
        kept = [item for item in self.waiting if not self._expired(item[3], now)]
        if len(kept) != len(self.waiting):
            for *_, request in self.waiting:
                if self._expired(request, now):
                    self.ledger.timed_out(request, now)
            heapq.heapify(kept)
            self.waiting = kept

    def kv_blocks(self, now: float) -> int:
        """Blocks held at `now` (the bound described above)."""
        steps = self.steps + (self._steps_done(now - self.run_start) if self.mode == RUN else 0)
        return self.prefill_blocks + self._decoding_blocks(steps)

    def exact_kv_blocks(self, now: float) -> int:
        """The sum of every request's own ceil(tokens / block_size), for the invariant checks."""
        steps = self.steps + (self._steps_done(now - self.run_start) if self.mode == RUN else 0)
        size = self.profile.block_size
        held = sum(request.blocks for request in self.prefilling)
        for _, entry, request in self.decoding:
            if request.entry == entry:
                held += -(-(request.prompt + steps - request.joined) // size)
        return held

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return self.num_decoding + len(self.prefilling)

    def empty(self) -> bool:
        return not self.waiting and not self.prefilling and not self.num_decoding

    def fits(self, prompt: int, output: int) -> bool:
        """Whether one request could ever run here alone."""
        return -(-(prompt + output + 1) // self.profile.block_size) + 1 <= self._pool

    # The scheduler.

    def _plan(self, now: float) -> float | None:
        pool = self._pool
        while self.num_decoding and self.prefill_blocks + self._decoding_blocks(self.steps + 1) > pool:
            self._preempt()
        if self.prefilling or self._admissible(now):
            return self._step(now)
        if not self.num_decoding:
            self.mode = IDLE
            self.due = math.inf
            return None
        decoding = self.decoding
        while decoding[0][2].entry != decoding[0][1]:
            heapq.heappop(decoding)
        n = self.num_decoding
        size = self.profile.block_size
        context = self.sum_prompt + n * self.steps - self.sum_joined
        # The most steps before the bound passes the pool: context + n k + n (size - 1) < (room + 1) size.
        room = pool - self.prefill_blocks
        fitting = ((room + 1) * size - 1 - context - n * (size - 1)) // n
        profile = self.profile
        self.mode = RUN
        self.run_start = now
        self.run_steps = max(1, min(decoding[0][0] - self.steps, fitting))
        self.run_first = profile.step_seconds(n, n, context)
        self.due = now + self._run_seconds(self.run_steps)
        return self.due

    def _run_seconds(self, k: int) -> float:
        # Step j (1..k) attends context + n j tokens.
        return k * self.run_first + self.profile.per_context_token_s * self.num_decoding * k * (k + 1) / 2

    def _steps_done(self, elapsed: float) -> int:
        """Whole steps of the current run finished `elapsed` seconds into it."""
        a = self.profile.per_context_token_s * self.num_decoding / 2
        b = self.run_first + a
        k = int(elapsed / b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * max(elapsed, 0.0))) / (2 * a))
        k = min(k, self.run_steps)
        while k < self.run_steps and self._run_seconds(k + 1) <= elapsed:
            k += 1
        while k > 0 and self._run_seconds(k) > elapsed:
            k -= 1
        return k

    def _step(self, now: float) -> float | None:
        profile = self.profile
        n = self.num_decoding
        budget = self.max_num_batched_tokens - n
        tokens = n
        context = self.sum_prompt + n * (self.steps + 1) - self.sum_joined
        chunks = []
        for request in self.prefilling:
            if budget <= 0:
                break
            chunk = min(request.remaining, budget)
            chunks.append((request, chunk))
            budget -= chunk
            tokens += chunk
            context += request.computed + chunk
        waiting = self.waiting
        used = self.prefill_blocks + self._decoding_blocks(self.steps + 1)
        while budget > 0 and waiting and n + len(self.prefilling) < self.max_num_seqs:
            request = waiting[0][3]
            if self._expired(request, now):
                heapq.heappop(waiting)
                self.ledger.timed_out(request, now)
                continue
            need = self._blocks_for(request)
            if used + need > self._pool:
                break
            heapq.heappop(waiting)
            used += need
            self.prefill_blocks += need
            request.blocks = need
            request.remaining = request.prompt + request.generated
            request.computed = 0
            request.admitted = next(self._order)
            self.admissions.append((request.admitted, request))
            heapq.heappush(self.ranked, (-request.priority, -request.arrival, -request.admitted, request))
            self.prefilling.append(request)
            chunk = min(request.remaining, budget)
            chunks.append((request, chunk))
            budget -= chunk
            tokens += chunk
            context += chunk
        if tokens == 0:
            self.mode = IDLE
            self.due = math.inf
            return None
        self.mode = STEP
        self.chunks = chunks
        self.due = now + profile.step_seconds(tokens, n + len(chunks), context)
        return self.due

    def _admissible(self, now: float) -> bool:
        waiting = self.waiting
        while waiting and self._expired(waiting[0][3], now):
            self.ledger.timed_out(heapq.heappop(waiting)[3], now)
        if not waiting or self.num_decoding + len(self.prefilling) >= self.max_num_seqs:
            return False
        used = self.prefill_blocks + self._decoding_blocks(self.steps + 1)
        return used + self._blocks_for(waiting[0][3]) <= self._pool

    def _prefilled(self, request: Request, now: float) -> None:
        self.prefilling.remove(request)
        self.prefill_blocks -= request.blocks
        request.blocks = 0
        if request.first_token is None:
            request.first_token = now
            self.ledger.first_token(request, now)
        generated = request.generated + 1
        if generated >= request.output:
            self.finished += 1
            self.ledger.finished(request, now)
            return
        request.joined = self.steps - generated
        request.entry = next(self._order)
        self.num_decoding += 1
        self.sum_prompt += request.prompt
        self.sum_joined += request.joined
        heapq.heappush(self.decoding, (request.joined + request.output, request.entry, request))

    def _stop_decoding(self, request: Request) -> None:
        request.entry = -1
        self.num_decoding -= 1
        self.sum_prompt -= request.prompt
        self.sum_joined -= request.joined

    def _preempt(self) -> None:
        victim = self._lowest_ranked() if self.policy == PRIORITY else self._last_admitted()
        if victim.entry >= 0:
            victim.generated = self.steps - victim.joined
            self._stop_decoding(victim)
            # Its heap entry stays until its old finishing step; drop such entries once they outnumber the live.
            if len(self.decoding) > 2 * self.num_decoding + 64:
                self.decoding = [item for item in self.decoding if item[2].entry == item[1]]
                heapq.heapify(self.decoding)
        else:
            self.prefilling.remove(victim)
            self.prefill_blocks -= victim.blocks
            victim.blocks = 0
        self.preemptions += 1
        self._queue(victim)

    def _last_admitted(self) -> Request:
        admissions = self.admissions
        if len(admissions) > 2 * self.num_running + 64:
            admissions[:] = [item for item in admissions if _running(*item)]
        while not _running(*admissions[-1]):
            admissions.pop()
        return admissions[-1][1]

    def _lowest_ranked(self) -> Request:
        ranked = self.ranked
        if len(ranked) > 2 * self.num_running + 64:
            ranked[:] = [item for item in ranked if _running(-item[2], item[3])]
            heapq.heapify(ranked)
        while not _running(-ranked[0][2], ranked[0][3]):
            heapq.heappop(ranked)
        return ranked[0][3]

    def _queue(self, request: Request) -> None:
        heapq.heappush(self.waiting, self._key(request))

    def _key(self, request: Request) -> tuple[int, float, int, Request]:
        return (request.priority if self.policy == PRIORITY else 0, request.arrival, request.index, request)

    def _blocks_for(self, request: Request) -> int:
        # The prompt (plus what a preemption made it recompute) and the first token's slot.
        return -(-(request.prompt + request.generated + 1) // self.profile.block_size)

    def _decoding_blocks(self, steps: int) -> int:
        n = self.num_decoding
        return (self.sum_prompt + n * steps - self.sum_joined + n * (self.profile.block_size - 1)) // self.profile.block_size

    def _expired(self, request: Request, now: float) -> bool:
        return request.first_token is None and now - request.arrival > self.timeout


def _running(admitted: int, request: Request) -> bool:
    """Whether this admission of `request` is still running (decoding, or prefilling: holding blocks)."""
    return request.admitted == admitted and (request.entry >= 0 or request.blocks > 0)
