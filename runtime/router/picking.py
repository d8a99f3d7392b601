"""Which replica gets a request: a pure function of the request's block hashes and the replicas' states.

Every strategy returns the replicas in the order to try them: the pick first, then the failover
order. Nothing here keeps state between calls except round-robin's counter, which the caller owns,
so two routers that see the same engines pick alike; they differ only in the requests each has
in flight and has not yet seen in an engine's own counts.

prefix-aware (the default) is consistent hashing with bounded loads, where the engines' KV-cache
events say who holds what:
- A replica whose load is above `bounded_load_factor` times the fleet's mean (counting the request
  being placed), and more than BOUNDED_LOAD_SLACK requests above the lightest replica's, is put
  last: one hot prefix cannot herd the fleet onto one replica, and a light load is not taken for
  an overload.
- Among the rest, a replica that has the request's LoRA adapter loaded comes first: another must
  load it (from host memory, or from disk where it was evicted) and give it a batch slot before
  the first token. This goes before the prefix, which costs no accuracy: blocks are keyed by
  adapter, so only a replica that served this adapter can hold this request's prefix.
- Then the most leading blocks of the prompt held wins; then the lighter load.
- Ties, and replicas that publish no events, fall to rendezvous hashing on the request's affinity
  key (its first block), so a conversation keeps its replica even where nothing is known of
  the caches.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass


class RoutingStrategy(enum.StrEnum):
    PREFIX_AWARE = "prefix-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


# The bound of consistent hashing with bounded loads as caches use it. At 2, the 1,000-replica
# simulation's prefill-heavy agents herded: TTFT p99 13.5 s against 1.8 s (BENCHMARKS.md).
DEFAULT_BOUNDED_LOAD_FACTOR = 1.25
# At light loads the factor alone calls 2 running requests beside idle replicas an overload (an
# engine steps a batch of 2 as fast as one of 1): six conversations over three replicas lost a
# fifth of their prefix hits to it (tests/runtime/router/test_router_fleet.py).
BOUNDED_LOAD_SLACK = 3


@dataclass(frozen=True)
class ReplicaState:
    """One ready replica as the router sees it when a request arrives."""

    name: str
    # Requests this router sent there that have not finished.
    in_flight: int = 0
    # The engine's own counts at its last reading (vllm:num_requests_running, _waiting): every
    # router's requests, a reading old.
    running: int = 0
    waiting: int = 0
    # Leading blocks of this request's prompt in the replica's prefix cache; None: the replica
    # publishes no KV events (or its index is resyncing), so nothing is known.
    prefix_blocks: int | None = None
    # The request names a LoRA adapter and the replica's /metrics says it is loaded there.
    adapter_loaded: bool = False

    @property
    def load(self) -> int:
        # The engine's count covers every router but lags; this router's own count is fresh but
        # partial. The larger is the better estimate of each.
        return max(self.running + self.waiting, self.in_flight)


def rendezvous_weight(affinity_key: bytes, replica: str) -> int:
    """Highest random weight hashing: adding or removing a replica moves only its own keys."""
    digest = hashlib.blake2b(affinity_key + b"\x00" + replica.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def over_bound(replicas: Sequence[ReplicaState], factor: float) -> set[str]:
    """The replicas that may take no prefix-sticky request: those the request would take past
    `factor` x the mean load (the request counted in, rounded up) and past the lightest replica's
    load by more than BOUNDED_LOAD_SLACK."""
    if not replicas:
        return set()
    capacity = math.ceil(factor * (sum(r.load for r in replicas) + 1) / len(replicas))
    lightest = min(r.load for r in replicas)
    return {r.name for r in replicas if r.load + 1 > max(capacity, lightest + BOUNDED_LOAD_SLACK)}


def rank(strategy: RoutingStrategy, replicas: Sequence[ReplicaState], affinity_key: bytes, *,
         bounded_load_factor: float = DEFAULT_BOUNDED_LOAD_FACTOR, turn: int = 0) -> list[ReplicaState]:
    """`replicas` in the order to try them for one request, the pick first.

    `affinity_key` places requests that no cache tells apart (the prompt's first block hash);
    `turn` is round-robin's position, a counter the caller advances once per request.
    """
    if strategy is RoutingStrategy.ROUND_ROBIN:
        ordered = sorted(replicas, key=lambda r: r.name)
        start = turn % len(ordered) if ordered else 0
        return ordered[start:] + ordered[:start]
    if strategy is RoutingStrategy.LEAST_LOADED:
        return sorted(replicas, key=lambda r: (r.load, -rendezvous_weight(affinity_key, r.name)))
    bounded = over_bound(replicas, bounded_load_factor)
    return sorted(replicas, key=lambda r: (
        r.name in bounded,
        not r.adapter_loaded,
        -(r.prefix_blocks or 0),
        r.load if r.prefix_blocks else 0,
        -rendezvous_weight(affinity_key, r.name),
    ))
