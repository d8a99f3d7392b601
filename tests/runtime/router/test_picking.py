"""The router's picking: a pure function of the request and the replicas' states."""

from collections import Counter

from kvpilot.runtime.router.picking import ReplicaState, RoutingStrategy, over_bound, rank

PREFIX = RoutingStrategy.PREFIX_AWARE


def names(ranked):
    return [r.name for r in ranked]


def test_the_replica_holding_the_most_leading_blocks_wins():
    replicas = [ReplicaState("a", prefix_blocks=2), ReplicaState("b", prefix_blocks=5), ReplicaState("c", prefix_blocks=0)]
    assert names(rank(PREFIX, replicas, b"k"))[0] == "b"


def test_equal_hits_go_to_the_lighter_replica():
    replicas = [ReplicaState("a", prefix_blocks=3, running=2), ReplicaState("b", prefix_blocks=3, running=1)]
    assert names(rank(PREFIX, replicas, b"k"))[0] == "b"


def test_a_replica_above_its_share_gets_no_sticky_request_and_is_tried_last():
    # 'hot' holds the prefix but carries 9 of the fleet's 10 requests: the bound is ceil(1.25 * 11 / 3) = 5.
    replicas = [ReplicaState("hot", prefix_blocks=8, running=9), ReplicaState("x", running=1), ReplicaState("y")]
    assert over_bound(replicas, 1.25) == {"hot"}
    assert names(rank(PREFIX, replicas, b"k"))[-1] == "hot"


def test_at_light_load_a_replica_keeps_its_sticky_requests():
    # Twice the mean, but two requests beside idle replicas is no overload.
    replicas = [ReplicaState("a", prefix_blocks=5, running=2), ReplicaState("b"), ReplicaState("c")]
    assert over_bound(replicas, 2.0) == set()
    assert names(rank(PREFIX, replicas, b"k"))[0] == "a"


def test_an_idle_fleet_bounds_nobody():
    assert over_bound([ReplicaState("a"), ReplicaState("b"), ReplicaState("c")], 1.0) == set()


def test_without_hits_the_same_key_lands_on_the_same_replica_and_keys_spread():
    replicas = [ReplicaState(n) for n in "abcd"]
    picks = {key: rank(PREFIX, replicas, key)[0].name for key in (f"conv-{i}".encode() for i in range(400))}
    # Another router, with the replicas listed in another order, picks alike.
    assert picks == {key: rank(PREFIX, replicas[::-1], key)[0].name for key in picks}
    spread = Counter(picks.values())
    assert set(spread) == set("abcd") and min(spread.values()) > 60


def test_removing_a_replica_moves_only_its_own_keys():
    replicas = [ReplicaState(n) for n in "abcd"]
    keys = [f"conv-{i}".encode() for i in range(200)]
    before = {k: rank(PREFIX, replicas, k)[0].name for k in keys}
    after = {k: rank(PREFIX, replicas[:3], k)[0].name for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "d")


def test_the_load_is_the_larger_of_the_engines_count_and_the_routers_own():
    assert ReplicaState("a", in_flight=3, running=1, waiting=1).load == 3
    assert ReplicaState("a", in_flight=1, running=2, waiting=2).load == 4


def test_least_loaded_and_round_robin():
    replicas = [ReplicaState("a", running=3), ReplicaState("b", running=1), ReplicaState("c", running=2)]
    assert names(rank(RoutingStrategy.LEAST_LOADED, replicas, b"k")) == ["b", "c", "a"]
    turns = [names(rank(RoutingStrategy.ROUND_ROBIN, replicas, b"k", turn=t)) for t in range(4)]
    assert turns == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_no_replica_no_pick():
    for strategy in RoutingStrategy:
        assert rank(strategy, [], b"k") == []


def test_a_replica_holding_the_requests_adapter_beats_a_longer_prefix_elsewhere():
    replicas = [ReplicaState("prefix", prefix_blocks=6), ReplicaState("adapter", adapter_loaded=True, prefix_blocks=1),
                ReplicaState("neither")]
    assert names(rank(PREFIX, replicas, b"k")) == ["adapter", "prefix", "neither"]


def test_the_load_bound_still_applies_to_a_replica_holding_the_adapter():
    replicas = [ReplicaState("hot", adapter_loaded=True, running=9), ReplicaState("x", running=1), ReplicaState("y")]
    assert names(rank(PREFIX, replicas, b"k"))[-1] == "hot"
