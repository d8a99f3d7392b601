"""The operator's own metrics (exported_metrics.py): each engine's gauges from the engine as the API
serves it, gone with the engine; reconcile passes counted by how they ended, a failed API call
included (the emulated API server refuses one apply)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator import exported_metrics, kube
from operator_harness import SPEC, cluster, reconciler_alone, run

pytestmark = pytest.mark.timeout(60)


def engine(spec: dict[str, Any], status: dict[str, Any] | None = None, generation: int = 3) -> dict[str, Any]:
    found = {"metadata": {"namespace": "ml", "name": "qwen", "generation": generation}, "spec": spec}
    return found if status is None else {**found, "status": status}


def samples(metrics: exported_metrics.OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def test_an_autoscaled_engine_shows_the_autoscalers_decision_against_its_pods_and_maximum() -> None:
    autoscaled = engine({"replicas": 2, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6}},
                        {"desiredReplicas": 4, "replicas": 3, "readyReplicas": 2, "observedGeneration": 2})
    assert exported_metrics.engine_values(autoscaled) == {
        "kvpilot:engine_desired_replicas": 4, "kvpilot:engine_replicas": 3, "kvpilot:engine_ready_replicas": 2,
        "kvpilot:engine_max_replicas": 6, "kvpilot:engine_generation": 3, "kvpilot:engine_observed_generation": 2,
    }


def test_an_engine_without_autoscaling_or_status_is_at_its_maximum_with_nothing_reconciled() -> None:
    fixed = engine({"replicas": 2, "autoscaling": {"enabled": False, "minReplicas": 1, "maxReplicas": 6}})
    assert exported_metrics.engine_values(fixed) == {
        "kvpilot:engine_desired_replicas": 2, "kvpilot:engine_replicas": 0, "kvpilot:engine_ready_replicas": 0,
        "kvpilot:engine_max_replicas": 2, "kvpilot:engine_generation": 3, "kvpilot:engine_observed_generation": 0,
    }


def test_an_engines_series_follow_its_events_and_go_with_it() -> None:
    metrics = exported_metrics.OperatorMetrics()
    labels = (("engine", "qwen"), ("namespace", "ml"))
    metrics.observe(engine({"replicas": 2}, {"readyReplicas": 1}))
    metrics.observe(engine({"replicas": 2}, {"readyReplicas": 2}))
    assert samples(metrics)[("kvpilot:engine_ready_replicas", labels)] == 2
    metrics.forget("ml", "qwen")
    metrics.forget("ml", "qwen")  # a second DELETED event, or one for an engine never seen
    assert not [name for name, found in samples(metrics) if name.startswith("kvpilot:engine_")]


def test_passes_are_counted_by_result_and_a_success_is_timed() -> None:
    metrics = exported_metrics.OperatorMetrics(clock=lambda: 1_700_000_000.0)
    found = samples(metrics)
    # Both results exist from the start, so that a rate over them is never missing.
    assert found[("kvpilot:operator_reconciles_total", (("result", "success"),))] == 0
    assert found[("kvpilot:operator_reconciles_total", (("result", "error"),))] == 0
    assert found[("kvpilot:operator_last_successful_reconcile_timestamp_seconds", ())] == 0
    metrics.reconciled(False)
    metrics.reconciled(True)
    metrics.reconciled(True)
    found = samples(metrics)
    assert found[("kvpilot:operator_reconciles_total", (("result", "success"),))] == 2
    assert found[("kvpilot:operator_reconciles_total", (("result", "error"),))] == 1
    assert found[("kvpilot:operator_last_successful_reconcile_timestamp_seconds", ())] == 1_700_000_000.0


def test_the_replica_that_reconciles_leads_and_a_standby_says_it_does_not() -> None:
    assert samples(exported_metrics.OperatorMetrics())[("kvpilot:operator_leader", ())] == 1
    standby = [(s.name, s.value) for family in text_string_to_metric_families(exported_metrics.standby_page().decode())
               for s in family.samples]
    assert standby == [("kvpilot:operator_leader", 0)]


def test_the_reconciler_reports_a_pass_that_an_api_call_failed_and_one_that_went_through(tmp_path: Path) -> None:
    passes: list[bool] = []

    async def scenario() -> None:
        async with cluster(tmp_path) as k, reconciler_alone(on_pass=passes.append) as reconciler:
            await k.create_engine("qwen", {**SPEC, "scheduling": {}})
            k.server.fail_next("PATCH", "deployments", 422)
            with pytest.raises(kube.ApiError):
                await reconciler.reconcile(k.engine("qwen"))
            await reconciler.reconcile(k.engine("qwen"))

    run(scenario())
    assert passes == [False, True]
