"""The control loop's memory in the engine's status (status.controlMemory), so that an operator
that takes over after a failover, or restarts, decides as the one before would have.

What survives: the autoscaler's recommendations inside its stabilization windows, the start of
its memory (the first-window guard), its last reading of each pod (for rates), the capacity it
measured, the headroom it learnt and since when a backlog has stood, and since when the engine has
been idle; the policy tuner's pressured intervals and the
start of its calm window.

The rule that makes the handover safe: the intervals missed between the last operator's last
interval and the next one's first (the leader died, its Lease expired, a standby took it) are
treated as a single operator treats intervals that failed on an unreachable API server: the same
memory, with nothing recorded for them. So the next operator decides as that single operator
would. A memory is taken up while something in it can still count: its last interval lies within
the longest window (stabilization, or calm) plus STALE_INTERVALS intervals. An older one (the
operator was down for longer) is dropped, and the autoscaler starts afresh behind its first-window
guard, as at a first start; so is one that cannot be read (another version's, or edited by hand).
The control loop removes each part once its controller is turned off.

Collections are lists: status is written as a JSON merge patch, which would merge maps with
what the last write left. For the same reason a time that is None is absent once written (a
merge patch deletes what it sets to null).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.operator import autoscaler, samples, tuner

FIELD = "controlMemory"
AUTOSCALER = "autoscaler"
TUNER = "tuner"


def encoded_autoscaler(decision: autoscaler.Decision, now: float) -> dict[str, Any]:
    memory = decision.memory
    return {
        "at": now,
        "recommendations": [[t, r] for t, r in decision.history],
        "since": memory.since,
        "idleSince": memory.idle_since,
        "saturatedFinished": memory.saturated_finished,
        "saturatedSeconds": memory.saturated_seconds,
        "headroom": memory.headroom,
        "backlogSince": memory.backlog_since,
        "pods": [[s.pod, s.kv_cache_usage, s.num_waiting, s.num_running, s.observed_at, s.num_finished]
                 for s in memory.pods.values()],
    }


def restored_autoscaler(
    status: Mapping[str, Any] | None, policy: autoscaler.Policy, *, now: float
) -> tuple[tuple[tuple[float, int], ...], autoscaler.Memory] | None:
    """(history, memory) as the last operator left them, or None (see the module's docstring)."""
    window = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    saved = _taken_up(status, AUTOSCALER, now, window + autoscaler.STALE_INTERVALS * policy.interval_seconds)
    if saved is None:
        return None
    try:
        history = tuple((float(t), int(r)) for t, r in saved["recommendations"])
        pods = {str(pod): samples.PodSample(str(pod), float(kv), float(waiting), float(running), float(at),
                                            None if finished is None else float(finished))
                for pod, kv, waiting, running, at, finished in saved["pods"]}
        memory = autoscaler.Memory(pods, float(saved["saturatedFinished"]), float(saved["saturatedSeconds"]),
                                   _time(saved.get("since")), _time(saved.get("idleSince")),
                                   backlog_since=_time(saved.get("backlogSince")),
                                   # A memory written before the headroom was learnt has none.
                                   headroom=min(autoscaler.HEADROOM_MAX, max(1.0, float(saved.get("headroom", 1.0)))))
    except (KeyError, TypeError, ValueError):
        return None
    return history, memory


def encoded_tuner(state: tuner.TunerState, now: float) -> dict[str, Any]:
    return {"at": now, "policy": state.policy, "pressuredIntervals": state.pressured_intervals,
            "calmSince": state.calm_since}


def restored_tuner(status: Mapping[str, Any] | None, spec: Mapping[str, Any], *, now: float) -> tuner.TunerState | None:
    """The tuner's state as the last operator left it, or None (see the module's docstring)."""
    window = spec["scheduling"]["calmWindowSeconds"]
    saved = _taken_up(status, TUNER, now, window + autoscaler.STALE_INTERVALS * spec["autoscaling"]["intervalSeconds"])
    if saved is None or saved.get("policy") not in (tuner.CALM_POLICY, tuner.PRESSURE_POLICY):
        return None
    try:
        return tuner.TunerState(saved["policy"], int(saved["pressuredIntervals"]), _time(saved.get("calmSince")))
    except (KeyError, TypeError, ValueError):
        return None


def forgotten(status: Mapping[str, Any] | None, parts: Iterable[str]) -> dict[str, Any] | None:
    """The status merge patch that removes these parts of the memory (their controllers were
    turned off: turned on again, they start afresh); None where status holds none of them."""
    saved = (status or {}).get(FIELD) or {}
    gone = {part: None for part in parts if part in saved}
    return {FIELD: gone} if gone else None


def _taken_up(status: Mapping[str, Any] | None, part: str, now: float, keep_seconds: float) -> Any:
    saved = ((status or {}).get(FIELD) or {}).get(part)
    if not isinstance(saved, Mapping):
        return None
    at = saved.get("at")
    if not isinstance(at, int | float) or not 0 <= now - at <= keep_seconds:
        return None
    return saved


def _time(value: Any) -> float | None:
    return None if value is None else float(value)
