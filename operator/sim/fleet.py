"""The event loop: arrivals from the trace, replicas' steps, control intervals and start-ups on
one clock, for one strategy.

How it is fast enough for a thousand replicas and ten million requests (exactly, not by
approximation: it gives every request the same first-token and finish times as a loop over one
heap of every replica's step events):
- Only control events (intervals, replicas getting ready) are on a heap. Between two of them the
  ready set is fixed, and routing reads nothing else, so that stretch's arrivals are routed at
  once in arrays and grouped by replica, and each replica then plays its own arrivals and steps
  up to the next control event on its own (`Replica.play`): replicas share nothing but the clock
  at control events. Each replica's next step end sits in one array (`due`), so a replica with
  no arrival and no step ending in a stretch is not visited.
- A replica's scheduler state stays in Python scalars on its object: every event touches one
  replica, where an attribute costs a fifth of a numpy element. Arrays hold what is read or
  written over many replicas or requests at once: routing, `due`, each request's fate.
- Events are steps, and runs of decode-only steps in closed form (replica.py); none per token.

Kubernetes is modelled as far as the control loop sees it: a Service spreads requests uniformly
at random over the ready replicas (none ready: the request is dropped), or `kvpilot router`
places them (routing.py; none ready: it holds them (hold.py) for the first replica to be ready,
and the control loop passes the autoscaler how many it holds, as the operator passes the
routers' count). The router reads the replicas' states as each request arrives, so then the
replicas are played in time order up to each arrival, and only the Service's stretches are
routed in arrays as above. A new replica is ready `startup_seconds` after spec.replicas asks
for it (image pull and weight load; it costs from the start; one woken from zero is new); a
scale-down removes starting replicas first (as a ReplicaSet does; the autoscaler asks for no
scale-down while one starts), then the ready ones the autoscaler marked (the least loaded, as
pod-deletion-cost makes a ReplicaSet do), then the newest ready ones; they take no new requests and
finish what they hold before they go (cost runs until then). The metrics a
replica reports are read directly at each interval (the operator's direct scrape).
"""

from __future__ import annotations

import array
import gc
import heapq
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvpilot.operator import samples
from kvpilot.operator.sim import hold, routing
from kvpilot.operator.sim import replica as replica_model
from kvpilot.operator.sim.profile import Profile
from kvpilot.operator.sim.strategies import ControlLoop
from kvpilot.operator.sim.trace import Trace

# HOLD_TIMED_OUT: held by the router while no replica was ready, past its hold timeout.
PENDING, SERVED, DROPPED, TIMED_OUT, HOLD_TIMED_OUT = 0, 1, 2, 3, 4
_STARTING, _RUNNING, _DRAINING, _GONE = 0, 1, 2, 3
_END = sys.float_info.max  # after the last control event: every replica with work runs until idle


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
    # Which requests arrived while no replica was ready, and waited in the router's hold.
    held: np.ndarray
    replica_seconds: float = 0.0
    scale_events: int = 0
    wakes: int = 0  # scale-ups from 0 replicas
    preemptions: int = 0
    events: int = 0
    wall_seconds: float = 0.0
    # The process's CPU time: on a shared machine, what the run cost apart from waiting for a core.
    cpu_seconds: float = 0.0
    routing: str = routing.SERVICE
    # Over admissions of requests of a conversation, fleet-wide: tokens to prefill, and those cached.
    prompt_tokens: int = 0
    hit_tokens: int = 0


class InvariantError(AssertionError):
    pass


class _Ledger:
    """Each request's fate, written into buffers (array.array: a Python write costs a quarter of a
    numpy one) that the run's arrays view."""

    def __init__(self, count: int) -> None:
        self.first = array.array("d", [math.nan]) * count
        self.finish = array.array("d", [math.nan]) * count
        self.outcome = array.array("b", [PENDING]) * count
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
             progress: Callable[[int], None] | None = None, routing_name: str = routing.SERVICE,
             fresh_counts: bool = False, hold_timeout_seconds: float = 60.0) -> Run:
    """Run `loop` over `trace`, its requests placed by `routing_name` (one of routing.NAMES; a
    router reads the engines' counts at each control interval, or at each request with `fresh_counts`,
    and holds a request up to `hold_timeout_seconds` while no replica is ready).
    `priorities[t]` is tenant t's engine priority (lower first; 0 when not given). With
    `check_invariants`, every interval checks the KV pools and the ledger."""
    router = None if routing_name == routing.SERVICE else routing.Router(routing.RoutingStrategy(routing_name),
                                                                         fresh_counts=fresh_counts)
    router_hold = None if router is None else hold.Hold(hold_timeout_seconds)
    simulation = _Simulation(trace, loop, profile, engine, priorities, seed, check_invariants, progress, router,
                             router_hold)
    # The run makes no reference cycles, and holds hundreds of thousands of live requests and
    # heap entries, which the cyclic collector would walk again and again: a fifth of the run.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return simulation.run()
    finally:
        if collecting:
            gc.enable()


class _Simulation:
    """The loop of the module's docstring: control events on a heap, replicas played between them."""

    def __init__(self, trace: Trace, loop: ControlLoop, profile: Profile, engine: Engine,
                 priorities: Sequence[int], seed: int, check_invariants: bool,
                 progress: Callable[[int], None] | None, router: routing.Router | None,
                 router_hold: hold.Hold | None) -> None:
        count = len(trace)
        self.trace = trace
        self.loop = loop
        self.profile = profile
        self.engine = engine
        self.priorities = np.array([priorities[t] if t < len(priorities) else 0 for t in range(len(trace.tenants))],
                                   np.int64)
        self.rng = np.random.default_rng(seed)  # one draw per arrival, in arrival order: the Service's choice
        self.check = check_invariants
        self.progress = progress
        self.ledger = _Ledger(count)
        self.result = Run(loop.name, trace, np.frombuffer(self.ledger.first), np.frombuffer(self.ledger.finish),
                          np.frombuffer(self.ledger.outcome, np.int8), Series(), np.zeros(count, bool),
                          routing=routing.SERVICE if router is None else router.strategy.value)
        self.readies: list[tuple[float, int]] = []  # heap of (when, replica) start-ups under way
        self.replicas: list[replica_model.Replica] = []
        self.state: list[int] = []
        self.due = np.full(16, math.inf)  # each replica's next step end; inf: idle or gone
        self.born: list[float] = []  # when each replica was asked for, and when it went (inf: not yet)
        self.died: list[float] = []
        self.ready: list[int] = []
        self.starting: list[int] = []
        self.draining: set[int] = set()
        self.policy = replica_model.FCFS
        self.arrived = 0  # arrivals routed so far (the trace is in time order)
        # When each arrival reaches a replica's scheduler (its TTFT still counts from the trace's time).
        self.reaches = trace.time + profile.frontend_s if profile.frontend_s else trace.time
        self.steps = 0  # replica step (or decode run) ends handled, for the events count
        self.router = router
        self.hold = router_hold
        self.conversation = np.zeros(count, np.int64) if trace.conversation is None else trace.conversation
        self.shared_blocks = trace.shared_tokens // profile.block_size

    def run(self) -> Run:
        started, cpu = time.perf_counter(), time.process_time()
        result = self.result
        trace = self.trace
        for _ in range(self.loop.replicas):
            self._ready(self._start(0.0))
        tick: float | None = 0.0
        readies = self.readies
        controls = 0
        while True:
            # Arrivals at an event's time come before it, replicas' step ends at it too; then
            # start-ups (in replica order), then the control interval.
            upcoming = min(_END if tick is None else tick, readies[0][0] if readies else _END)
            self._play_until(upcoming)
            if upcoming == _END:
                break
            while readies and readies[0][0] == upcoming:
                _, rid = heapq.heappop(readies)
                controls += 1
                if self.state[rid] == _STARTING:
                    self._ready(rid)
                    if self.hold:
                        self._release(rid, upcoming)
            if tick == upcoming:
                controls += 1
                self._tick(tick)
                tick += self.loop.spec["autoscaling"]["intervalSeconds"]
                if tick >= trace.duration:
                    tick = None
        if self.hold is not None:
            self._expire_held(math.inf)  # no replica came for them
        if self.check:
            self._check_ledger()
        born, died = np.minimum(self.born, trace.duration), np.minimum(self.died, trace.duration)
        result.replica_seconds = float(np.sum(died - born))
        result.events = self.steps + controls + len(trace)
        result.preemptions = sum(r.preemptions for r in self.replicas)
        result.prompt_tokens = sum(r.prompt_tokens for r in self.replicas)
        result.hit_tokens = sum(r.hit_tokens for r in self.replicas)
        result.wall_seconds = time.perf_counter() - started
        result.cpu_seconds = time.process_time() - cpu
        return result

    def _play_until(self, until: float) -> None:
        """Route the arrivals up to `until` (inclusive) and run every replica that has work to it."""
        low = self.arrived
        high = int(np.searchsorted(self.reaches, until, side="right"))
        self.arrived = high
        visits: dict[int, list[replica_model.Request]] = {}
        if high > low:
            if self.router is None:
                visits = self._route(low, high)
            else:
                for index in range(low, high):
                    self._place(index)
            if self.progress is not None:
                self.progress(high)
        for rid in np.flatnonzero(self.due <= until).tolist():
            self._play(rid, visits.pop(rid, ()), until)
        for rid, arrivals in visits.items():  # with arrivals, and no step ending before `until`
            self._play(rid, arrivals, until)

    def _play(self, rid: int, arrivals: Sequence[replica_model.Request], until: float) -> None:
        replica = self.replicas[rid]
        self.steps += replica.play(arrivals, until)
        self.due[rid] = replica.due
        if self.router is not None:
            self.router.ran(rid)
        if rid in self.draining and replica.empty():
            self._gone(rid, replica.clock)

    def _place(self, index: int) -> None:
        """Arrival `index` through the router: every replica runs up to just before it (a step
        ending at the same time ends after it, as in play()), then the router picks on their states."""
        now = float(self.reaches[index])
        before = math.nextafter(now, -math.inf)
        for rid in np.flatnonzero(self.due <= before).tolist():
            self._play(rid, (), before)
        if not self.ready:
            self.hold.add(index, now)
            self.result.held[index] = True
            return
        request = self._request(index, now)
        if not self.replicas[self.ready[0]].fits(request.prompt, request.output):
            self._drop(index)
            return
        self.ledger.in_system += 1
        self._play(self.router.pick(request, self.replicas, self.ready), (request,), before)

    def _release(self, rid: int, now: float) -> None:
        """The held requests still waiting go to `rid`, the first replica ready since none was;
        a client's request timeout still counts from its arrival."""
        self._expire_held(now)
        replica = self.replicas[rid]
        for index in self.hold.release():
            request = self._request(index, float(self.reaches[index]))
            if not replica.fits(request.prompt, request.output):
                self._drop(index)
                continue
            self.ledger.in_system += 1
            self.router.pick(request, self.replicas, (rid,))  # its bookkeeping, as for any request it places
            replica.add(request, now)
        self.due[rid] = replica.due
        self.router.ran(rid)

    def _expire_held(self, now: float) -> None:
        for index, when in self.hold.expire(now):
            self.result.outcome[index] = HOLD_TIMED_OUT
            self.result.finish[index] = when

    def _request(self, index: int, arrival: float) -> replica_model.Request:
        trace = self.trace
        return replica_model.Request(index, arrival, int(trace.prompt[index]), int(trace.output[index]),
                                     int(self.priorities[trace.tenant[index]]), int(self.conversation[index]),
                                     self.shared_blocks)

    def _drop(self, index: int) -> None:
        self.result.outcome[index] = DROPPED
        self.result.finish[index] = self.trace.time[index]

    def _route(self, low: int, high: int) -> dict[int, list[replica_model.Request]]:
        """Arrivals low..high-1 spread uniformly over the ready replicas, each given its own, in
        time order; those no replica can take are dropped."""
        trace = self.trace
        result = self.result
        draws = self.rng.random(high - low)
        if not self.ready:
            result.outcome[low:high] = DROPPED
            result.finish[low:high] = trace.time[low:high]
            return {}
        prompt, output = trace.prompt[low:high], trace.output[low:high]
        size = self.profile.block_size
        # replica.fits(), for all at once: alone, the request's whole length and one block to spare.
        fits = -(-(prompt + output + 1) // size) + 1 <= self.profile.num_gpu_blocks
        taken = np.flatnonzero(fits)
        if len(taken) < high - low:
            refused = low + np.flatnonzero(~fits)
            result.outcome[refused] = DROPPED
            result.finish[refused] = trace.time[refused]
        if not len(taken):
            return {}
        picks = np.asarray(self.ready)[(draws[taken] * len(self.ready)).astype(np.int64)]
        order = np.argsort(picks, kind="stable")
        taken = taken[order]
        picks = picks[order]
        requests = list(map(replica_model.Request, (low + taken).tolist(), self.reaches[low:high][taken].tolist(),
                            prompt[taken].tolist(), output[taken].tolist(),
                            self.priorities[trace.tenant[low:high][taken]].tolist(),
                            self.conversation[low:high][taken].tolist(),
                            itertools.repeat(self.shared_blocks)))
        self.ledger.in_system += len(requests)
        starts = [0, *(np.flatnonzero(picks[1:] != picks[:-1]) + 1).tolist()]
        ends = [*starts[1:], len(requests)]
        return {rid: requests[start:end] for rid, start, end in zip(picks[starts].tolist(), starts, ends)}

    def _tick(self, now: float) -> None:
        loop = self.loop
        ready = self.ready
        replicas = self.replicas
        pool = self.profile.num_gpu_blocks
        # An idle replica has nothing waiting (whatever waits fits an empty pool), so dropping
        # expired requests never leaves one with work to start here.
        for rid in tuple(self.draining):
            replica = replicas[rid]
            replica.expire(now)
            if replica.empty():
                self._gone(rid, now)
        names = []
        pods = {}
        waiting = 0
        kv_total = 0.0
        pod_sample = samples.PodSample
        for rid in ready:
            replica = replicas[rid]
            replica.expire(now)
            usage = replica.kv_blocks(now) / pool
            name = replica.name
            num_waiting = len(replica.waiting)
            names.append(name)
            pods[name] = pod_sample(name, usage, num_waiting, replica.num_running, now, replica.finished)
            waiting += num_waiting
            kv_total += usage
        if self.router is not None:
            self.router.read(replicas, ready)
        if self.check:
            self._check_pools(now)
        series = self.result.series
        series.time.append(now)
        series.ready.append(len(ready))
        series.starting.append(len(self.starting))
        series.draining.append(len(self.draining))
        series.waiting.append(waiting + sum(replicas[rid].num_waiting for rid in self.draining))
        series.in_system.append(self.ledger.in_system)
        series.kv_cache_usage.append(kv_total / len(ready) if ready else 0.0)
        held = None
        if self.hold is not None:
            self._expire_held(now)
            held = float(len(self.hold))
        before = loop.replicas
        target, policy = loop.decide(names, len(self.starting), samples.Reading(pods), now, held)
        series.desired.append(target)
        series.priority.append(policy == replica_model.PRIORITY)
        if policy != self.policy:
            self.policy = policy
            for rid in (*ready, *self.starting, *self.draining):
                replicas[rid].set_policy(policy)
                self._nudge(rid, now)
        if target != before:
            self.result.scale_events += 1
        if before == 0 and target > 0:
            self.result.wakes += 1
        self._scale(target, now)

    def _nudge(self, rid: int, now: float) -> None:
        when = self.replicas[rid].nudge(now)
        if when is not None:
            self.due[rid] = when

    def _scale(self, target: int, now: float) -> None:
        current = len(self.ready) + len(self.starting)
        if target > current:
            for _ in range(target - current):
                heapq.heappush(self.readies, (now + self.engine.startup_seconds, self._start(now)))
        excess = current - target
        while excess > 0 and self.starting:
            self._gone(self.starting.pop(), now)
            excess -= 1
        # The ready replicas the autoscaler chose (the least loaded) go first, then the newest.
        if excess > 0 and self.loop.remove:
            rank = {int(name.removeprefix("replica-")): i for i, name in enumerate(self.loop.remove)}
            self.ready.sort(key=lambda rid: len(rank) - rank[rid] if rid in rank else -1)  # popped from the end
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
        self.born.append(now)
        self.died.append(math.inf)
        if rid == len(self.due):
            self.due = np.concatenate([self.due, np.full(rid, math.inf)])
        self.starting.append(rid)
        return rid

    def _ready(self, rid: int) -> None:
        if rid in self.starting:
            self.starting.remove(rid)
        self.state[rid] = _RUNNING
        self.replicas[rid].set_policy(self.policy)
        self.ready.append(rid)
        if self.router is not None:
            self.router.ran(rid)

    def _gone(self, rid: int, now: float) -> None:
        self.state[rid] = _GONE
        self.died[rid] = now
        self.draining.discard(rid)

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
