"""A run's figures: cost, latency, SLO attainment, what was lost, how often it scaled, and how
much of the prompts the replicas' prefix caches held; with scale to zero, how often it woke and
how long the requests that arrived at zero waited for their first token."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpilot.operator.sim.fleet import DROPPED, HOLD_TIMED_OUT, SERVED, TIMED_OUT, Run
from kvpilot.operator.sim.routing import SERVICE


def _percentile(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summary(run: Run, ttft_slo: float) -> dict[str, Any]:
    trace = run.trace
    ttft = run.first_token - trace.time
    served = run.outcome == SERVED
    started = ~np.isnan(ttft)
    e2e = (run.finish - trace.time)[served]
    # A request dropped, timed out or late misses its SLO.
    met = started & (ttft <= ttft_slo)
    within = np.count_nonzero(met)
    tenants = [(name, trace.tenant == code) for code, name in enumerate(trace.tenants)]
    per_tenant = {name: _percentile(ttft[started & ours], 99) for name, ours in tenants}
    slo_by_tenant = {name: np.count_nonzero(met & ours) / max(1, np.count_nonzero(ours)) for name, ours in tenants}
    duration = trace.duration
    held_ttft = ttft[started & run.held]
    return {
        "strategy": run.strategy,
        "routing": run.routing,
        "requests": len(trace),
        "served": int(served.sum()),
        "dropped": int((run.outcome == DROPPED).sum()),
        "timed_out": int((run.outcome == TIMED_OUT).sum()),
        "replica_hours": run.replica_seconds / 3600,
        "ttft_p50_s": _percentile(ttft[started], 50),
        "ttft_p99_s": _percentile(ttft[started], 99),
        "e2e_p99_s": _percentile(e2e, 99),
        "ttft_slo_s": ttft_slo,
        "slo_attainment": within / len(trace) if len(trace) else math.nan,
        "scale_events": run.scale_events,
        "wakes": run.wakes,
        "held": int(run.held.sum()),
        "hold_timeouts": int((run.outcome == HOLD_TIMED_OUT).sum()),
        "held_ttft_p50_s": _percentile(held_ttft, 50),
        "held_ttft_p99_s": _percentile(held_ttft, 99),
        "held_ttft_max_s": float(held_ttft.max()) if len(held_ttft) else None,
        "max_replicas": max(r + s for r, s in zip(run.series.ready, run.series.starting)) if run.series.time else 0,
        "preemptions": run.preemptions,
        # Of the prompt tokens admitted (prefills recomputed after a preemption included).
        "prefix_hit_rate": run.hit_tokens / run.prompt_tokens if run.prompt_tokens else None,
        "ttft_p99_s_by_tenant": per_tenant,
        "slo_attainment_by_tenant": slo_by_tenant,
        "mean_in_system": float(np.mean(run.series.in_system)) if run.series.time else 0.0,
        "arrival_rate": len(trace) / duration,
        "events": run.events,
        "wall_seconds": run.wall_seconds,
        "cpu_seconds": run.cpu_seconds,
        "events_per_second": run.events / run.wall_seconds if run.wall_seconds else None,
        "events_per_cpu_second": run.events / run.cpu_seconds if run.cpu_seconds else None,
    }


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(summaries: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per strategy (and routing, where any run had a router or prefixes
    to share)."""
    tenants = sorted({name for s in summaries for name in s["ttft_p99_s_by_tenant"]})
    routed = any(s["routing"] != SERVICE or s["prefix_hit_rate"] is not None for s in summaries)
    woke = any(s["wakes"] or s["held"] for s in summaries)
    header = ["strategy", *(["routing", "prefix hits"] if routed else []), "replica-h", "TTFT p50 s", "TTFT p99 s",
              "e2e p99 s", "SLO", "dropped", "timed out", "scale events", "max replicas"]
    if len(tenants) > 1:
        header += [f"TTFT p99 s {name}" for name in tenants] + [f"SLO {name}" for name in tenants]
    if woke:
        header += ["wakes", "held", "hold timeouts", "held TTFT p50 s", "held TTFT p99 s", "held TTFT max s"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        hits = "-" if s["prefix_hit_rate"] is None else f"{100 * s['prefix_hit_rate']:.1f} %"
        cells = [s["strategy"], *([s["routing"], hits] if routed else []), _cell(s["replica_hours"], 4),
                 _cell(s["ttft_p50_s"]), _cell(s["ttft_p99_s"]),
                 _cell(s["e2e_p99_s"]), f"{100 * s['slo_attainment']:.1f} %", str(s["dropped"]), str(s["timed_out"]),
                 str(s["scale_events"]), str(s["max_replicas"])]
        if len(tenants) > 1:
            cells += [_cell(s["ttft_p99_s_by_tenant"].get(name)) for name in tenants]
            cells += [f"{100 * s['slo_attainment_by_tenant'][name]:.1f} %" for name in tenants]
        if woke:
            cells += [str(s["wakes"]), str(s["held"]), str(s["hold_timeouts"]), _cell(s["held_ttft_p50_s"]),
                      _cell(s["held_ttft_p99_s"]), _cell(s["held_ttft_max_s"])]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def series(run: Run) -> dict[str, list]:
    s = run.series
    return {"time": s.time, "ready": s.ready, "starting": s.starting, "draining": s.draining, "desired": s.desired,
            "waiting": s.waiting, "in_system": s.in_system, "kv_cache_usage": s.kv_cache_usage,
            "priority": s.priority}
