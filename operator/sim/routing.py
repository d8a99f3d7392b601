"""`kvpilot router` in front of the simulated replicas: each request placed by the router's own
picking (`picking.rank`), on the replicas' states as one router sees them:
- `in_flight`: the requests it sent there that have not ended, fresh;
- `running`, `waiting`: the engine's counts as of the last control interval's reading (the
  router scrapes the engines as the operator does), or as of the request (`fresh_counts`: a
  router that reads them continuously);
- `prefix_blocks`: the leading blocks of the request's prompt the replica's prefix cache holds
  (the engine's KV events, without their delay).

At a thousand replicas a state per replica per request costs more than the rest of the fleet's
work, so each replica's state is kept and rebuilt only when it may have changed: the replica ran
since (its counts and cache), a reading came, or it holds (or held) blocks of the request's
conversation, or of the previous request's. Every other replica holds at most the shared
blocks, which do not depend on the conversation.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.operator.sim import replica as replica_model
from kvpilot.operator.sim.cache import block_id
from kvpilot.runtime.router.picking import ReplicaState, RoutingStrategy, rank

# No router: the Service spreads requests uniformly at random (fleet.py routes those itself).
SERVICE = "service"
NAMES = (SERVICE, *(strategy.value for strategy in RoutingStrategy))


class Router:
    def __init__(self, strategy: RoutingStrategy, *, fresh_counts: bool = False) -> None:
        self.strategy = strategy
        self.fresh_counts = fresh_counts
        self.turn = 0  # round-robin's counter: one per request placed
        self.states: dict[int, ReplicaState] = {}
        self.stale: set[int] = set()
        self.readings: dict[int, tuple[int, int]] = {}  # replica -> (running, waiting)
        self.rids: dict[str, int] = {}
        # Conversation -> the replicas it was sent to: the only ones that may hold its own blocks.
        self.visited: dict[int, set[int]] = {}
        self.previous: set[int] = set()

    def read(self, replicas: Sequence[replica_model.Replica], ready: Sequence[int]) -> None:
        """A control interval's reading of the engines' counts."""
        for rid in ready:
            replica = replicas[rid]
            self.readings[rid] = (replica.num_running, replica.num_waiting)
        self.stale.update(ready)

    def ran(self, rid: int) -> None:
        self.stale.add(rid)

    def pick(self, request: replica_model.Request, replicas: Sequence[replica_model.Replica],
             ready: Sequence[int]) -> int:
        """The replica `request` goes to, among `ready` (not empty)."""
        visited = self.visited.setdefault(request.conversation, set()) if request.conversation else set()
        states = self.states
        for rid in self.stale | self.previous | visited:
            states[rid] = self._state(rid, replicas[rid], request)
        self.stale = set()
        self.previous = visited
        if request.conversation:
            key = block_id(request.conversation, request.shared_blocks, 0)
        else:
            key = -request.index - 1  # shares nothing: its own key
        ranked = rank(self.strategy, [states[rid] for rid in ready], key.to_bytes(8, "big", signed=True),
                      turn=self.turn)
        self.turn += 1
        rid = self.rids[ranked[0].name]
        if request.conversation:
            visited.add(rid)
        self.stale.add(rid)
        return rid

    def _state(self, rid: int, replica: replica_model.Replica, request: replica_model.Request) -> ReplicaState:
        self.rids[replica.name] = rid
        if self.fresh_counts:
            running, waiting = replica.num_running, replica.num_waiting
        else:
            running, waiting = self.readings.get(rid, (0, 0))
        return ReplicaState(replica.name, in_flight=replica.num_running + replica.num_waiting, running=running,
                            waiting=waiting, prefix_blocks=replica.held_blocks(request))
