"""The event loop: arrivals from the trace, replicas' steps, control intervals and start-ups on
one clock, for one strategy.

Kubernetes is modelled as far as the control loop sees it: a Service spreads requests uniformly
at random over the ready replicas (none ready: the request is dropped); a new replica is ready
`startup_seconds` after spec.replicas asks for it (image pull and weight load; it costs from the
start); a scale-down removes starting replicas first, then the newest ready ones, which take no
new requests and finish what they hold before they go (cost runs until then). The metrics a
replica reports are read directly at each interval (the operator's direct scrape).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvpilot.operator import samples
from kvpilot.operator.sim import replica as replica_model
from kvpilot.operator.sim.profile import Profile
from kvpilot.operator.sim.strategies import ControlLoop
from kvpilot.operator.sim.trace import Trace

PENDING, SERVED, DROPPED, TIMED_OUT = 0, 1, 2, 3
_STEP_END, _READY, _TICK = 0, 1, 2
_CHUNK = 1 << 16  # arrivals turned into Python scalars this many at a time
_STARTING, _RUNNING, _DRAINING, _GONE = 0, 1, 2, 3


@dataclass(frozen=True)
class Engine:
    """The engine settings that shape a replica (vLLM's names)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # How long a client waits for its first token before it gives up.
    request_timeout_seconds: float = 60.0
    startup_seconds: float = 120.0


@dataclass
class Series:
    """The fleet at each control interval."""

    time: list[float] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    starting: list[int] = field(default_factory=list)
    draining: list[int] = field(default_factory=list)
    desired: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    in_system: list[int] = field(default_factory=list)
    kv_cache_usage: list[float] = field(default_factory=list)
    priority: list[bool] = field(default_factory=list)


@dataclass
class Run:
    """One strategy's run: every request's fate, and the fleet over time."""

    strategy: str
    trace: Trace
    first_token: np.ndarray
    finish: np.ndarray
    outcome: np.ndarray
    series: Series
    replica_seconds: float = 0.0
    scale_events: int = 0
    preemptions: int = 0
    events: int = 0
    wall_seconds: float = 0.0
    # The process's CPU time: on a shared machine, what the run cost apart from waiting for a core.
    cpu_seconds: float = 0.0


class InvariantError(AssertionError):
    pass


class _Ledger:
    def __init__(self, run: Run) -> None:
        self.first = run.first_token
        self.finish = run.finish
        self.outcome = run.outcome
        self.in_system = 0

    def first_token(self, request: replica_model.Request, now: float) -> None:
        self.first[request.index] = now

    def finished(self, request: replica_model.Request, now: float) -> None:
        self._end(request, now, SERVED)

    def timed_out(self, request: replica_model.Request, now: float) -> None:
        self._end(request, now, TIMED_OUT)

    def _end(self, request: replica_model.Request, now: float, outcome: int) -> None:
        if self.outcome[request.index] != PENDING:
            raise InvariantError(f"request {request.index} ended twice")
        self.outcome[request.index] = outcome
        self.finish[request.index] = now
        self.in_system -= 1


def capacity(profile: Profile, engine: Engine, prompt_tokens: float, output_tokens: float,
             kv_cache_usage: float) -> float:
    """Requests per second one replica sustains with its KV pool at `kv_cache_usage` (or
    max_num_seqs, whichever binds first), by the profile's step cost: the static baselines'
    sizing, and where autoscaled runs start."""
    context = prompt_tokens + output_tokens / 2
    batch = max(1.0, min(engine.max_num_seqs,
                         kv_cache_usage * profile.num_gpu_blocks * profile.block_size / context))
    decode_step = profile.step_seconds(batch, batch, batch * context)
    replica_seconds = output_tokens * decode_step / batch + profile.per_token_s * prompt_tokens + profile.per_sequence_s
    return 1.0 / replica_seconds


class Sizes(NamedTuple):
    capacity: float  # requests/s per replica
    peak: int
    mean: int
    initial: int


# Autoscaled runs start with what the trace's first minutes need, not from a cold fleet.
_INITIAL_WINDOW_S = 300.0


def sizes(trace: Trace, profile: Profile, engine: Engine, kv_cache_usage: float) -> Sizes:
    per_replica = capacity(profile, engine, float(trace.prompt.mean()), float(trace.output.mean()), kv_cache_usage)
    window = min(_INITIAL_WINDOW_S, trace.duration)
    initial_rate = np.count_nonzero(trace.time < window) / window
    return Sizes(per_replica, max(1, math.ceil(trace.peak_rate() / per_replica)),
                 max(1, math.ceil(trace.mean_rate() / per_replica)), max(1, math.ceil(initial_rate / per_replica)))


def simulate(trace: Trace, loop: ControlLoop, profile: Profile, engine: Engine, *,
             priorities: Sequence[int] = (), seed: int = 0, check_invariants: bool = False,
             progress: Callable[[int], None] | None = None) -> Run:
    """Run `loop` over `trace`. `priorities[t]` is tenant t's engine priority (lower first; 0 when
    not given). With `check_invariants`, every interval checks the KV pools and the ledger."""
    return _Simulation(trace, loop, profile, engine, priorities, seed, check_invariants, progress).run()


class _Simulation:
    def __init__(self, trace: Trace, loop: ControlLoop, profile: Profile, engine: Engine,
                 priorities: Sequence[int], seed: int, check_invariants: bool,
                 progress: Callable[[int], None] | None) -> None:
        count = len(trace)
        self.trace = trace
        self.loop = loop
        self.profile = profile
        self.engine = engine
        self.priorities = [priorities[t] if t < len(priorities) else 0 for t in range(len(trace.tenants))]
        self.route = np.random.default_rng(seed).random(count)
        self.check = check_invariants
        self.progress = progress
        self.result = Run(loop.name, trace, np.full(count, math.nan), np.full(count, math.nan),
                          np.zeros(count, np.int8), Series())
        self.ledger = _Ledger(self.result)
        self.events: list[tuple[float, int, int, int]] = []
        self.replicas: list[replica_model.Replica] = []
        self.state: list[int] = []
        self.version: list[int] = []
        self.ready: list[int] = []
        self.starting: list[int] = []
        self.draining: set[int] = set()
        self.policy = replica_model.FCFS
        self.accounted_to = 0.0

    def run(self) -> Run:
        started, cpu = time.perf_counter(), time.process_time()
        result = self.result
        trace = self.trace
        for _ in range(self.loop.replicas):
            self._ready(self._start(0.0))
        heapq.heappush(self.events, (0.0, _TICK, -1, 0))
        events = self.events
        arrivals = len(trace)
        handled = 0
        index = 0  # of the chunk's first arrival
        times: list[float] = []
        position = 0
        while True:
            if position == len(times) and index + position < arrivals:
                # The next arrivals as Python scalars, a chunk at a time.
                index += position
                end = min(arrivals, index + _CHUNK)
                times = trace.time[index:end].tolist()
                prompts = trace.prompt[index:end].tolist()
                outputs = trace.output[index:end].tolist()
                tenants = trace.tenant[index:end].tolist()
                routes = self.route[index:end].tolist()
                position = 0
                if self.progress is not None:
                    self.progress(index)
            arrival = times[position] if position < len(times) else math.inf
            if events and events[0][0] < arrival:
                when, kind, rid, version = heapq.heappop(events)
                handled += 1
                if kind == _STEP_END:
                    if version == self.version[rid]:
                        self._schedule(rid, self.replicas[rid].advance(when))
                        if rid in self.draining and self.replicas[rid].empty():
                            self._gone(rid, when)
                elif kind == _READY:
                    if version == self.version[rid] and self.state[rid] == _STARTING:
                        self._ready(rid)
                else:
                    self._tick(when)
            elif position < len(times):
                self._arrive(index + position, arrival, prompts[position], outputs[position], tenants[position],
                             routes[position])
                position += 1
            else:
                break
        if self.progress is not None:
            self.progress(arrivals)
        self._account(trace.duration)
        if self.check:
            self._check_ledger()
        result.events = handled + arrivals
        result.preemptions = sum(r.preemptions for r in self.replicas)
        result.wall_seconds = time.perf_counter() - started
        result.cpu_seconds = time.process_time() - cpu
        return result

    def _arrive(self, index: int, now: float, prompt: int, output: int, tenant: int, route: float) -> None:
        ready = self.ready
        if not ready:
            self._drop(index, now)
            return
        rid = ready[int(route * len(ready))]
        replica = self.replicas[rid]
        if not replica.fits(prompt, output):
            self._drop(index, now)
            return
        self.ledger.in_system += 1
        request = replica_model.Request(index, now, prompt, output, self.priorities[tenant])
        self._schedule(rid, replica.add(request, now))

    def _drop(self, index: int, now: float) -> None:
        self.result.outcome[index] = DROPPED
        self.result.finish[index] = now

    def _schedule(self, rid: int, when: float | None) -> None:
        if when is not None:
            self.version[rid] += 1
            heapq.heappush(self.events, (when, _STEP_END, rid, self.version[rid]))

    def _tick(self, now: float) -> None:
        loop = self.loop
        ready = self.ready
        pool = self.profile.num_gpu_blocks
        for rid in (*ready, *self.draining):
            self.replicas[rid].expire(now)
            self._schedule(rid, self.replicas[rid].nudge(now))
            if rid in self.draining and self.replicas[rid].empty():
                self._gone(rid, now)
        names = []
        pods = {}
        waiting = 0
        kv_total = 0.0
        for rid in ready:
            replica = self.replicas[rid]
            usage = replica.kv_blocks(now) / pool
            names.append(replica.name)
            pods[replica.name] = samples.PodSample(replica.name, usage, replica.num_waiting, replica.num_running, now,
                                                   replica.finished)
            waiting += replica.num_waiting
            kv_total += usage
        if self.check:
            self._check_pools(now)
        series = self.result.series
        series.time.append(now)
        series.ready.append(len(ready))
        series.starting.append(len(self.starting))
        series.draining.append(len(self.draining))
        series.waiting.append(waiting + sum(self.replicas[rid].num_waiting for rid in self.draining))
        series.in_system.append(self.ledger.in_system)
        series.kv_cache_usage.append(kv_total / len(ready) if ready else 0.0)
        before = loop.replicas
        replicas, policy = loop.decide(names, len(self.starting), samples.Reading(pods), now)
        series.desired.append(replicas)
        series.priority.append(policy == replica_model.PRIORITY)
        if policy != self.policy:
            self.policy = policy
            for rid in (*ready, *self.starting, *self.draining):
                self.replicas[rid].set_policy(policy)
                self._schedule(rid, self.replicas[rid].nudge(now))
        if replicas != before:
            self.result.scale_events += 1
        self._scale(replicas, now)
        upcoming = now + loop.spec["autoscaling"]["intervalSeconds"]
        if upcoming < self.trace.duration:
            heapq.heappush(self.events, (upcoming, _TICK, -1, 0))

    def _scale(self, target: int, now: float) -> None:
        self._account(now)
        current = len(self.ready) + len(self.starting)
        if target > current:
            for _ in range(target - current):
                rid = self._start(now)
                heapq.heappush(self.events, (now + self.engine.startup_seconds, _READY, rid, self.version[rid]))
        excess = current - target
        while excess > 0 and self.starting:
            self._gone(self.starting.pop(), now)
            excess -= 1
        while excess > 0 and self.ready:
            rid = self.ready.pop()
            if self.replicas[rid].empty():
                self._gone(rid, now)
            else:
                self.state[rid] = _DRAINING
                self.draining.add(rid)
            excess -= 1

    def _start(self, now: float) -> int:
        rid = len(self.replicas)
        engine = self.engine
        self.replicas.append(replica_model.Replica(
            f"replica-{rid}", self.profile, max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens, timeout=engine.request_timeout_seconds,
            ledger=self.ledger, policy=self.policy))
        self.state.append(_STARTING)
        self.version.append(0)
        self.starting.append(rid)
        return rid

    def _ready(self, rid: int) -> None:
        if rid in self.starting:
            self.starting.remove(rid)
        self.state[rid] = _RUNNING
        self.replicas[rid].set_policy(self.policy)
        self.ready.append(rid)

    def _gone(self, rid: int, now: float) -> None:
        self._account(now)
        self.state[rid] = _GONE
        self.version[rid] += 1
        self.draining.discard(rid)

    def _account(self, now: float) -> None:
        now = min(now, self.trace.duration)
        alive = len(self.ready) + len(self.starting) + len(self.draining)
        self.result.replica_seconds += alive * max(0.0, now - self.accounted_to)
        self.accounted_to = max(self.accounted_to, now)

    def _check_pools(self, now: float) -> None:
        pool = self.profile.num_gpu_blocks
        for rid in (*self.ready, *self.draining):
            replica = self.replicas[rid]
            exact, bound = replica.exact_kv_blocks(now), replica.kv_blocks(now)
            if not exact <= bound <= pool:
                raise InvariantError(f"{replica.name} at {now:.3f}s holds {exact} blocks (bound {bound}) of {pool}")

    def _check_ledger(self) -> None:
        if (self.result.outcome == PENDING).any() or self.ledger.in_system != 0:
            raise InvariantError(f"{int((self.result.outcome == PENDING).sum())} requests never ended")
