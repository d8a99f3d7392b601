"""The control loop's memory in status: what one operator writes, the next decides from exactly as
the first would have; stale, foreign or unreadable memories are dropped."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from emulated_apiserver import merge_patched
from kvpilot.operator import autoscaler, control, control_memory, samples, tuner
from test_operator_autoscaler import POLICY, reading

DOWN = POLICY.scale_down_stabilization_seconds


def status_after(patches: list[dict[str, Any]]) -> dict[str, Any]:
    """Status as the API server keeps it after these merge patches (nulls delete)."""
    status: dict[str, Any] = {}
    for patch in patches:
        status = merge_patched(status, json.loads(json.dumps(patch)))
    return status


def timeline(start: float, loads: list[float]) -> list[tuple[float, samples.Reading]]:
    return [(start + 15 * i, reading(start + 15 * i, (kv, 0), (kv, 0))) for i, kv in enumerate(loads)]


def test_an_operator_that_takes_over_decides_as_the_single_operator_would() -> None:
    # Busy, then quiet: the scale-down waits for the quiet to fill the stabilization window,
    # wherever the failover falls in it.
    steps = timeline(1000.0, [0.9] * 4 + [0.1] * 30)
    single: list[autoscaler.Decision] = []
    history: tuple[tuple[float, int], ...] = ()
    memory = None
    replicas = 2
    for now, read in steps:
        decision = autoscaler.decide(POLICY, replicas, ["p0", "p1"], 0, read, history, now, memory)
        single.append(decision)
        history, memory, replicas = decision.history, decision.memory, decision.replicas
    assert any(d.reason == autoscaler.SCALED_DOWN for d in single)

    for failover in range(1, len(steps)):
        patches: list[dict[str, Any]] = []
        history, memory, replicas = (), None, 2
        for i, (now, read) in enumerate(steps):
            if i == failover:
                # The next operator: nothing in memory but what status holds.
                restored = control_memory.restored_autoscaler(status_after(patches), POLICY, now=now)
                assert restored is not None
                history, memory = restored
            decision = autoscaler.decide(POLICY, replicas, ["p0", "p1"], 0, read, history, now, memory)
            assert (decision.replicas, decision.reason) == (single[i].replicas, single[i].reason), (failover, i)
            history, memory, replicas = decision.history, decision.memory, decision.replicas
            patches.append({control_memory.FIELD: {"autoscaler": control_memory.encoded_autoscaler(decision, now)}})


def test_the_headroom_learnt_survives_and_one_written_before_it_or_by_hand_stays_in_bounds() -> None:
    decision = autoscaler.decide(POLICY, 2, ["p0", "p1"], 0, reading(1000.0, (0.5, 0), (0.5, 0)), (), 1000.0,
                                 autoscaler.Memory(headroom=1.3, backlog_since=700.0))
    decision = dataclasses.replace(decision, memory=dataclasses.replace(decision.memory, backlog_since=700.0))
    part = control_memory.encoded_autoscaler(decision, 1000.0)
    restored = control_memory.restored_autoscaler(status_after([{control_memory.FIELD: {"autoscaler": part}}]),
                                                  POLICY, now=1015.0)
    assert restored is not None and (restored[1].headroom, restored[1].backlog_since) == (decision.memory.headroom, 700.0)
    for written, taken in ((None, 1.0), (0.2, 1.0), (9.0, autoscaler.HEADROOM_MAX)):
        edited = {**part, "headroom": written} if written is not None else {k: v for k, v in part.items() if k != "headroom"}
        restored = control_memory.restored_autoscaler({control_memory.FIELD: {"autoscaler": edited}}, POLICY, now=1015.0)
        assert restored is not None and restored[1].headroom == taken


def saved(at: float) -> dict[str, Any]:
    decision = autoscaler.decide(POLICY, 2, ["p0", "p1"], 0, reading(at, (0.5, 0), (0.5, 0)), (), at)
    return status_after([{control_memory.FIELD: {"autoscaler": control_memory.encoded_autoscaler(decision, at)}}])


def test_a_memory_is_taken_up_while_any_of_it_can_still_count() -> None:
    keep = DOWN + autoscaler.STALE_INTERVALS * POLICY.interval_seconds
    assert control_memory.restored_autoscaler(saved(1000.0), POLICY, now=1000.0 + keep) is not None
    assert control_memory.restored_autoscaler(saved(1000.0), POLICY, now=1000.0 + keep + 1) is None
    # A clock that went back is not trusted either.
    assert control_memory.restored_autoscaler(saved(1000.0), POLICY, now=999.0) is None


@pytest.mark.parametrize("broken", [
    {"at": 1000.0},
    {"at": 1000.0, "recommendations": [["x", 1]], "pods": [], "saturatedFinished": 0, "saturatedSeconds": 0},
    {"at": "yesterday"},
    "a string",
])
def test_an_unreadable_memory_is_dropped(broken: Any) -> None:
    status = {control_memory.FIELD: {"autoscaler": broken}}
    assert control_memory.restored_autoscaler(status, POLICY, now=1000.0) is None


def test_the_tuners_calm_window_survives() -> None:
    spec = {"scheduling": {"calmWindowSeconds": 300}, "autoscaling": {"intervalSeconds": 15}}
    state = tuner.TunerState(tuner.PRESSURE_POLICY, 0, calm_since=900.0)
    status = status_after([{control_memory.FIELD: {"tuner": control_memory.encoded_tuner(state, 1000.0)}}])
    assert control_memory.restored_tuner(status, spec, now=1030.0) == state
    assert control_memory.restored_tuner(status, spec, now=1000.0 + 300 + 46) is None
    pressured = tuner.TunerState(tuner.CALM_POLICY, 1)
    status = status_after([{control_memory.FIELD: {"tuner": control_memory.encoded_tuner(pressured, 1000.0)}}])
    assert control_memory.restored_tuner(status, spec, now=1015.0) == pressured


def test_a_controller_turned_off_forgets_its_part() -> None:
    status = {control_memory.FIELD: {"autoscaler": {"at": 1.0}, "tuner": {"at": 1.0}}}
    assert control_memory.forgotten(status, []) is None
    assert control_memory.forgotten(status, ["autoscaler"]) == {control_memory.FIELD: {"autoscaler": None}}
    assert control_memory.forgotten({}, ["autoscaler", "tuner"]) is None


def test_the_controllers_records_go_in_one_status_write_side_by_side() -> None:
    autoscaler_part = {"desiredReplicas": 2, control_memory.FIELD: {control_memory.AUTOSCALER: {"since": 1.0}}}
    tuner_part = {"effectiveSchedulingPolicy": "priority", control_memory.FIELD: {control_memory.TUNER: {"calm": 3}}}
    assert control.merged([autoscaler_part, {}, tuner_part]) == {
        "desiredReplicas": 2, "effectiveSchedulingPolicy": "priority",
        control_memory.FIELD: {control_memory.AUTOSCALER: {"since": 1.0}, control_memory.TUNER: {"calm": 3}},
    }


def test_two_controllers_that_set_conditions_keep_both() -> None:
    def setting(kind: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        def record(fresh: Mapping[str, Any]) -> dict[str, Any]:
            kept = [c for c in fresh["status"]["conditions"] if c["type"] != kind]
            return {"conditions": [*kept, {"type": kind, "status": "True"}]}
        return record

    fresh = {"status": {"conditions": [{"type": "MetricsAvailable", "status": "False"}], "replicas": 1}}
    written = control.recorded_in_turn([setting("MetricsAvailable"), setting("AdaptersLoaded")], fresh)
    assert written == {"conditions": [{"type": "MetricsAvailable", "status": "True"},
                                      {"type": "AdaptersLoaded", "status": "True"}]}
