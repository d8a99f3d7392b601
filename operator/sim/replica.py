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
- Prefix caching (cache.py), for requests of a conversation: at admission a request's prefill
  starts after its leading blocks the replica holds (all but its last token at most, which the
  engine always computes); they still count in its blocks, as above, so the pool's accounting and
  the decode runs are unchanged. The cache keeps the freed blocks in the room the running
  requests leave, trimmed at admissions (the engine evicts as it allocates: between admissions a
  decode run may grow into room the cache still holds).
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
from collections.abc import Sequence
from typing import Protocol

from kvpilot.operator.sim.cache import PrefixCache
from kvpilot.operator.sim.profile import Profile

FCFS = "fcfs"
PRIORITY = "priority"

IDLE, STEP, RUN = 0, 1, 2


class Request:
    __slots__ = ("index", "arrival", "prompt", "output", "priority", "first_token", "generated",
                 "blocks", "remaining", "computed", "admitted", "joined", "entry", "conversation",
                 "shared_blocks", "pinned")

    def __init__(self, index: int, arrival: float, prompt: int, output: int, priority: int,
                 conversation: int = 0, shared_blocks: int = 0) -> None:
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
        self.conversation = conversation  # 0: shares no block with any other request
        self.shared_blocks = shared_blocks  # leading blocks every conversation shares (the system prompt)
        self.pinned = 0  # leading blocks it holds in the prefix cache


class Ledger(Protocol):
    """Where requests end; fleet.py records them per request."""

    def first_token(self, request: Request, now: float) -> None: ...
    def finished(self, request: Request, now: float) -> None: ...
    def timed_out(self, request: Request, now: float) -> None: ...


class Replica:
    __slots__ = ("name", "profile", "max_num_seqs", "max_num_batched_tokens", "timeout", "ledger", "policy",
                 "waiting", "prefilling", "decoding", "num_decoding", "sum_prompt", "sum_joined", "steps",
                 "prefill_blocks", "mode", "run_start", "run_steps", "run_first", "chunks", "preemptions",
                 "admissions", "ranked", "finished", "due", "clock", "cache", "prompt_tokens", "hit_tokens",
                 "_order", "_pool", "_size", "_base", "_per_token", "_per_sequence", "_per_context")

    def __init__(self, name: str, profile: Profile, *, max_num_seqs: int, max_num_batched_tokens: int,
                 timeout: float, ledger: Ledger, policy: str = FCFS) -> None:
        self.name = name
        self.profile = profile
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.timeout = timeout
        self.ledger = ledger
        self.policy = FCFS
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
        # Under priority only: the same as a heap of the largest (priority, arrival, admission)
        # first, priority's victims (built from `admissions` when the policy switches to it).
        self.ranked: list[tuple[int, float, int, Request]] = []
        self.due = math.inf  # when the step (or run) in flight ends; inf when idle
        self.clock = 0.0  # when the last one ended
        self.cache = PrefixCache()
        # Over admissions of requests of a conversation: tokens to prefill, and those found cached.
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self._order = itertools.count()
        # The profile's figures, read on every step.
        self._pool = profile.num_gpu_blocks
        self._size = profile.block_size
        self._base = profile.base_s
        self._per_token = profile.per_token_s
        self._per_sequence = profile.per_sequence_s
        self._per_context = profile.per_context_token_s
        self.set_policy(policy)

    # What fleet.py asks.

    def play(self, arrivals: Sequence[Request], until: float) -> int:
        """Take `arrivals` (in time order, none after `until`) as they come, and run every step
        that ends by `until` (inf: until idle). Returns how many steps (or runs of steps) ended."""
        until = min(until, sys.float_info.max)  # an idle replica's due is inf
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
        heapq.heappush(self.waiting, (request.priority if self.policy == PRIORITY else 0, request.arrival,
                                      request.index, request))
        mode = self.mode
        if mode == IDLE:
            return self._plan(now)
        if mode == RUN:
            done = self._steps_done(now - self.run_start)
            if done + 1 < self.run_steps:
                self.run_steps = done + 1
                self.due = self.run_start + self._run_seconds(done + 1)
                return self.due
        return None

    def advance(self, now: float) -> float | None:
        """The step (or run of steps) in flight ends at `now`. Returns the next one's end."""
        if self.mode == STEP:
            steps = self.steps = self.steps + 1
            for request, chunk in self.chunks:
                request.computed += chunk
                request.remaining -= chunk
                if request.remaining == 0:
                    self._prefilled(request, now)
            self.chunks = []
        else:
            steps = self.steps = self.steps + self.run_steps
        decoding = self.decoding
        while decoding and decoding[0][0] <= steps:
            _, entry, request = heapq.heappop(decoding)
            if request.entry == entry:
                self._stop_decoding(request)
                self._finished(request, now)
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
            self.ranked = []
            if policy == PRIORITY:
                for admitted, request in self.admissions:
                    if _running(admitted, request):
                        self.ranked.append((-request.priority, -request.arrival, -admitted, request))
                heapq.heapify(self.ranked)

    def expire(self, now: float) -> None:
        """Drop the waiting requests whose clients have given up."""
        waiting = self.waiting
        timeout = self.timeout
        if not waiting or (self.policy == FCFS and now - waiting[0][1] <= timeout):
            return  # fcfs: the head arrived first, so no one has waited longer
        if self.policy == FCFS:
            # In arrival order: those who have waited too long come off the heap first.
            kept = []
            while waiting and now - waiting[0][1] > timeout:
                item = heapq.heappop(waiting)
                if item[3].first_token is None:
                    self.ledger.timed_out(item[3], now)
                else:
                    kept.append(item)  # preempted after its first token: its client still waits
            for item in kept:
                heapq.heappush(waiting, item)
            return
        kept = [item for item in waiting if not self._expired(item[3], now)]
        if len(kept) != len(waiting):
            for *_, request in waiting:
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
        size = self._size
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

    def held_blocks(self, request: Request) -> int:
        """Leading blocks of `request`'s prompt held here: what the replica's KV events tell a router."""
        if not request.conversation:
            return 0
        return self.cache.leading(request.conversation, request.shared_blocks, request.prompt // self._size)

    def fits(self, prompt: int, output: int) -> bool:
        """Whether one request could ever run here alone."""
        return -(-(prompt + output + 1) // self._size) + 1 <= self._pool

    # The scheduler. The hot paths spell out _decoding_blocks, _expired and
    # Profile.step_seconds (same arithmetic, in the same order: the same floats).

    def _plan(self, now: float) -> float | None:
        pool = self._pool
        size = self._size
        n = self.num_decoding
        ahead = self.steps + 1
        used = self.prefill_blocks + (self.sum_prompt + n * ahead - self.sum_joined + n * (size - 1)) // size
        while n and used > pool:
            self._preempt()
            n = self.num_decoding
            used = self.prefill_blocks + (self.sum_prompt + n * ahead - self.sum_joined + n * (size - 1)) // size
        if self.prefilling:
            return self._step(now, used)
        waiting = self.waiting
        if waiting:
            timeout = self.timeout
            while waiting:
                head = waiting[0][3]
                if head.first_token is None and now - head.arrival > timeout:
                    heapq.heappop(waiting)
                    self.ledger.timed_out(head, now)
                    continue
                if n < self.max_num_seqs and used + -(-(head.prompt + head.generated + 1) // size) <= pool:
                    return self._step(now, used)
                break
        if not n:
            self.mode = IDLE
            self.due = math.inf
            return None
        decoding = self.decoding
        while decoding[0][2].entry != decoding[0][1]:
            heapq.heappop(decoding)
        steps = self.steps
        context = self.sum_prompt + n * steps - self.sum_joined
        # The most steps before the bound passes the pool: context + n k + n (size - 1) < (room + 1) size.
        room = pool - self.prefill_blocks
        fitting = ((room + 1) * size - 1 - context - n * (size - 1)) // n
        k = decoding[0][0] - steps
        if fitting < k:
            k = fitting
        if k < 1:
            k = 1
        per_context = self._per_context
        first = self._base + self._per_token * n + self._per_sequence * n + per_context * context
        self.mode = RUN
        self.run_start = now
        self.run_steps = k
        self.run_first = first
        due = self.due = now + (k * first + per_context * n * k * (k + 1) / 2)
        return due

    def _run_seconds(self, k: int) -> float:
        # Step j (1..k) attends context + n j tokens.
        return k * self.run_first + self._per_context * self.num_decoding * k * (k + 1) / 2

    def _steps_done(self, elapsed: float) -> int:
        """Whole steps of the current run finished `elapsed` seconds into it."""
        growth = self._per_context * self.num_decoding  # step j costs first + growth j
        first = self.run_first
        a = growth / 2
        b = first + a
        k = int(elapsed / b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * (elapsed if elapsed > 0.0 else 0.0))) / (2 * a))
        last = self.run_steps
        if k > last:
            k = last
        # The root is within a step of the answer; _run_seconds decides, spelled out.
        while k < last and (k + 1) * first + growth * (k + 1) * (k + 2) / 2 <= elapsed:
            k += 1
        while k > 0 and k * first + growth * k * (k + 1) / 2 > elapsed:
            k -= 1
        return k

    def _step(self, now: float, used: int) -> float | None:
        """One step of decodes, prefill chunks and admissions; `used`: the blocks held after it
        by the running requests."""
        n = self.num_decoding
        budget = self.max_num_batched_tokens - n
        tokens = n
        context = self.sum_prompt + n * (self.steps + 1) - self.sum_joined
        chunks = []
        prefilling = self.prefilling
        for request in prefilling:
            if budget <= 0:
                break
            chunk = request.remaining
            if chunk > budget:
                chunk = budget
            chunks.append((request, chunk))
            budget -= chunk
            tokens += chunk
            context += request.computed + chunk
        waiting = self.waiting
        if waiting and budget > 0:
            pool = self._pool
            size = self._size
            timeout = self.timeout
            running = n + len(prefilling)
            limit = self.max_num_seqs
            ranked = self.ranked if self.policy == PRIORITY else None
            while budget > 0 and waiting and running < limit:
                request = waiting[0][3]
                if request.first_token is None and now - request.arrival > timeout:
                    heapq.heappop(waiting)
                    self.ledger.timed_out(request, now)
                    continue
                # The prompt (plus what a preemption made it recompute) and the first token's slot.
                need = -(-(request.prompt + request.generated + 1) // size)
                if used + need > pool:
                    break
                heapq.heappop(waiting)
                used += need
                running += 1
                self.prefill_blocks += need
                request.blocks = need
                length = request.prompt + request.generated
                hit = self._hit(request, length, pool - used + need) if request.conversation else 0
                chunk = request.remaining = length - hit
                request.computed = hit
                admitted = request.admitted = next(self._order)
                self.admissions.append((admitted, request))
                if ranked is not None:
                    heapq.heappush(ranked, (-request.priority, -request.arrival, -admitted, request))
                prefilling.append(request)
                if chunk > budget:
                    chunk = budget
                chunks.append((request, chunk))
                budget -= chunk
                tokens += chunk
                context += hit + chunk
            if len(self.admissions) > 2 * running + 64:
                self._compact()
        if tokens == 0:
            self.mode = IDLE
            self.due = math.inf
            return None
        self.mode = STEP
        self.chunks = chunks
        due = self.due = now + (self._base + self._per_token * tokens + self._per_sequence * (n + len(chunks))
                                + self._per_context * context)
        return due

    def _hit(self, request: Request, length: int, room: int) -> int:
        """Tokens of a prompt of `length` tokens that need no prefill: its leading blocks held here,
        all but the last token at most. `room`: the free blocks before the request's own."""
        cache = self.cache
        size = self._size
        cache.trim(room)
        blocks = cache.leading(request.conversation, request.shared_blocks, (length - 1) // size)
        cache.pin(request.conversation, request.shared_blocks, 0, blocks)
        request.pinned = blocks
        cache.trim(room - request.blocks)
        self.prompt_tokens += length
        self.hit_tokens += blocks * size
        return blocks * size

    def _unpin(self, request: Request, computed_tokens: int) -> None:
        """`request` stops running; the blocks of its first `computed_tokens` stay cached."""
        self.cache.release(request.conversation, request.shared_blocks, request.pinned,
                           computed_tokens // self._size)
        request.pinned = 0

    def _finished(self, request: Request, now: float) -> None:
        if request.conversation:
            # The last token's KV is never computed: it is sampled, not fed back.
            self._unpin(request, request.prompt + request.output - 1)
        self.finished += 1
        self.ledger.finished(request, now)

    def _prefilled(self, request: Request, now: float) -> None:
        self.prefilling.remove(request)
        self.prefill_blocks -= request.blocks
        request.blocks = 0
        if request.conversation:
            # Its prompt's full blocks are computed: from now on other requests can hit them.
            full = (request.prompt + request.generated) // self._size
            self.cache.pin(request.conversation, request.shared_blocks, request.pinned, full)
            request.pinned = full
        if request.first_token is None:
            request.first_token = now
            self.ledger.first_token(request, now)
        generated = request.generated + 1
        if generated >= request.output:
            self._finished(request, now)
            return
        joined = request.joined = self.steps - generated
        entry = request.entry = next(self._order)
        self.num_decoding += 1
        self.sum_prompt += request.prompt
        self.sum_joined += joined
        heapq.heappush(self.decoding, (joined + request.output, entry, request))

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
            if victim.conversation:
                self._unpin(victim, victim.prompt + victim.generated - 1)
            # Its heap entry stays until its old finishing step; drop such entries once they outnumber the live.
            if len(self.decoding) > 2 * self.num_decoding + 64:
                self.decoding = [item for item in self.decoding if item[2].entry == item[1]]
                heapq.heapify(self.decoding)
        else:
            self.prefilling.remove(victim)
            self.prefill_blocks -= victim.blocks
            victim.blocks = 0
            if victim.conversation:
                self._unpin(victim, 0)
        self.preemptions += 1
        self._queue(victim)

    def _compact(self) -> None:
        """Drop the entries of requests no longer running, so that neither list outgrows them
        (both grow only by admissions)."""
        self.admissions = [item for item in self.admissions if _running(*item)]
        if self.ranked:
            self.ranked = [item for item in self.ranked if _running(-item[2], item[3])]
            heapq.heapify(self.ranked)

    def _last_admitted(self) -> Request:
        admissions = self.admissions
        while not _running(*admissions[-1]):
            admissions.pop()
        return admissions[-1][1]

    def _lowest_ranked(self) -> Request:
        ranked = self.ranked
        while not _running(-ranked[0][2], ranked[0][3]):
            heapq.heappop(ranked)
        return ranked[0][3]

    def _queue(self, request: Request) -> None:
        heapq.heappush(self.waiting, self._key(request))

    def _key(self, request: Request) -> tuple[int, float, int, Request]:
        return (request.priority if self.policy == PRIORITY else 0, request.arrival, request.index, request)

    def _decoding_blocks(self, steps: int) -> int:
        n = self.num_decoding
        return (self.sum_prompt + n * steps - self.sum_joined + n * (self._size - 1)) // self._size

    def _expired(self, request: Request, now: float) -> bool:
        return request.first_token is None and now - request.arrival > self.timeout


def _running(admitted: int, request: Request) -> bool:
    """Whether this admission of `request` is still running (decoding, or prefilling: holding blocks)."""
    return request.admitted == admitted and (request.entry >= 0 or request.blocks > 0)
