"""The control loop in the real kopf operator against the emulated API server, reading fake pod
/metrics pages or a fake Prometheus API that each test drives."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from fake_metrics import FakeMetrics, fake_metrics
from operator_harness import NAMESPACE, SPEC, Cluster, cluster, condition, created, eventually, key, operator, run

pytestmark = pytest.mark.timeout(90)

INTERVAL = 1
AUTOSCALING = {
    "enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetKVCacheUsage": 0.5, "targetQueueDepth": 4,
    "intervalSeconds": INTERVAL, "scaleDownStabilizationSeconds": 4,
}


def spec_with(replicas: int, **autoscaling: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SPEC)
    spec["replicas"] = replicas
    spec["autoscaling"] = {**AUTOSCALING, **autoscaling}
    return spec


def replicas(k: Cluster) -> int:
    return k.engine("qwen")["spec"]["replicas"]


def writes(k: Cluster, subresource: str) -> list[Any]:
    """The operator's writes to one of the engine's subresources, in order."""
    return [r for r in k.server if r.resource is not None and r.resource.plural == "inferenceengines"
            and r.subresource == subresource and r.method == "PATCH" and r.headers.get("User-Agent") != "kvpilot-tests"]


def scale_writes(k: Cluster) -> list[Any]:
    return writes(k, "scale")


def reads(k: Cluster) -> int:
    """How often the operator has listed pods: one per interval of the loop."""
    return sum(1 for r in k.server if r.resource is not None and r.resource.plural == "pods" and r.method == "GET")


async def intervals(k: Cluster, count: int) -> None:
    """Wait until the loop has run `count` more intervals."""
    start = reads(k)
    await eventually(lambda: reads(k) >= start + count, f"{count} intervals", timeout=count * INTERVAL + 10)


async def pods(k: Cluster, fake: FakeMetrics, names: list[str], **gauges: Any) -> None:
    for name in names:
        await k.create_pod(name, "qwen", ready=True)
    fake.set(names, **gauges)


def metrics_condition(k: Cluster) -> dict[str, Any]:
    return condition(k.engine("qwen"), "MetricsAvailable")


def of_type(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return condition({"status": status}, kind)


def test_high_kv_usage_scales_up_once_through_the_scale_subresource(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await pods(k, fake, ["qwen-a", "qwen-b"], kv=0.9)
            await created(k, spec_with(2))
            # 0.9 / 0.5 = 1.8 on each of 2 replicas: ceil(3.6) = 4.
            await eventually(lambda: replicas(k) == 4, "spec.replicas 4")
            (event,) = await eventually(lambda: k.events("ScaledUp"), "a ScaledUp event")
            assert event["message"].startswith("2 -> 4 replicas: KV-cache usage 0.90 (target 0.5)")
            assert event["involvedObject"]["name"] == "qwen"
            (write,) = scale_writes(k)
            assert write.data["spec"] == {"replicas": 4}
            await eventually(lambda: k.deployment("qwen")["spec"]["replicas"] == 4, "the Deployment to follow")
            # The status the scale-up's interval wrote: a later interval may already have written
            # its own (a read timed out on a loaded machine is MetricsAvailable=False, rightly).
            (status, *_) = await eventually(
                lambda: [w.data["status"] for w in writes(k, "status") if "lastScaleTime" in w.data["status"]],
                "lastScaleTime")
            assert k.engine("qwen")["status"]["lastScaleTime"] == status["lastScaleTime"]
            assert status["desiredReplicas"] == 4
            assert status["metrics"]["kvCacheUsage"] == 0.9 and status["metrics"]["queueDepth"] == 0
            assert of_type(status, "MetricsAvailable")["status"] == "True", status
            assert of_type(status, "ScalingLimited")["status"] == "False"

            # The two new pods start; the old ones still carry the burst: no second scale-up.
            for name in ("qwen-c", "qwen-d"):
                await k.create_pod(name, "qwen", ready=False)
            await intervals(k, 3)
            assert replicas(k) == 4 and len(scale_writes(k)) == 1 and len(k.events("ScaledUp")) == 1

    run(scenario())


def test_a_brief_dip_holds_and_sustained_low_load_scales_down_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            names = ["qwen-a", "qwen-b", "qwen-c"]
            await pods(k, fake, names, kv=0.5, waiting=4)  # at target: in the band
            await created(k, spec_with(3, scaleDownStabilizationSeconds=6))
            await eventually(lambda: metrics_condition(k).get("status") == "True", "a first reading")
            fake.set(names, kv=0.0)
            await intervals(k, 2)  # well inside the 6 s window
            fake.set(names, kv=0.5)
            await intervals(k, 4)
            assert replicas(k) == 3 and not k.events("ScaledDown")

            fake.set(names, kv=0.05)
            await eventually(lambda: replicas(k) == 1, "one scale-down", timeout=20)
            await intervals(k, 2)
            assert replicas(k) == 1 and len(k.events("ScaledDown")) == 1 and len(scale_writes(k)) == 1
            assert k.events("ScaledDown")[0]["message"].startswith("3 -> 1 replicas")

    run(scenario())


def test_a_scale_down_marks_the_least_loaded_pods_with_a_deletion_cost_before_it_writes_the_count(
        tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await pods(k, fake, ["qwen-a"], kv=0.05, running=6)
            await pods(k, fake, ["qwen-b"], kv=0.05, running=0)
            await pods(k, fake, ["qwen-c"], kv=0.05, running=1)
            await created(k, spec_with(3, scaleDownStabilizationSeconds=2))
            await eventually(lambda: replicas(k) == 1, "a scale-down", timeout=20)
            costs = {name: (k.object("v1/pods", name)["metadata"].get("annotations") or {}).get(
                "controller.kubernetes.io/pod-deletion-cost") for name in ("qwen-a", "qwen-b", "qwen-c")}
            # The two with the fewest requests go first: a ReplicaSet deletes the lowest cost first.
            assert costs == {"qwen-a": None, "qwen-b": "-1000", "qwen-c": "-1000"}
            operator_writes = [r for r in k.server if r.method == "PATCH" and r.resource is not None
                               and r.headers.get("User-Agent") != "kvpilot-tests"]
            order = [(r.resource.plural, r.subresource) for r in operator_writes
                     if r.resource.plural == "pods" or r.subresource == "scale"]
            assert order == [("pods", None), ("pods", None), ("inferenceengines", "scale")]

    run(scenario())


def test_latency_targets_read_the_pods_histograms(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await pods(k, fake, ["qwen-a"], kv=0.5, waiting=4)
            await created(k, spec_with(1, targets={"ttftSeconds": 2, "itlSeconds": 0.1}))
            # The engine's page has both histograms: read, so no LatencyMissing.
            await eventually(lambda: metrics_condition(k).get("status") == "True", "a first reading")
            assert metrics_condition(k)["reason"] == "MetricsRead"

    run(scenario())


def test_bad_or_missing_pod_metrics_hold_the_count_and_say_why(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await pods(k, fake, ["qwen-a", "qwen-b"], kv=0.5)
            await created(k, spec_with(2))
            await eventually(lambda: metrics_condition(k).get("status") == "True", "a first reading")

            # On a loaded machine a read can time out (MetricsMissing, with its Warning) before this.
            warned = len(k.events("MetricsMissing"))
            fake.set(["qwen-a", "qwen-b"], kv=1.0, waiting=40)  # would scale up ...
            fake.down = True  # ... but neither page answers
            missing = await eventually(lambda: (c := metrics_condition(k)).get("reason") == "MetricsMissing"
                                       and "answered 503" in c["message"] and c, "MetricsMissing, for the 503s")
            assert "pod qwen-a: GET /metrics answered 503" in missing["message"]
            assert missing["status"] == "False"
            (warning,) = await eventually(lambda: k.events("MetricsMissing")[warned:], "a Warning event")
            assert warning["type"] == "Warning"

            fake.down = False
            fake.raw_pages["qwen-b"] = "<html>Bad Gateway</html>"
            invalid = await eventually(lambda: (c := metrics_condition(k)).get("reason") == "MetricsInvalid" and c,
                                       "MetricsInvalid")
            assert "qwen-b: /metrics is not Prometheus text" in invalid["message"]
            fake.raw_pages["qwen-b"] = 'vllm:kv_cache_usage_perc{model_name="qwen"} NaN\n' \
                'vllm:num_requests_waiting{model_name="qwen"} 0\nvllm:num_requests_running{model_name="qwen"} 0\n'
            await eventually(lambda: "vllm:kv_cache_usage_perc = nan" in metrics_condition(k)["message"], "NaN")
            await intervals(k, 2)
            assert replicas(k) == 2 and not scale_writes(k)

            del fake.raw_pages["qwen-b"]
            await eventually(lambda: metrics_condition(k).get("status") == "True", "MetricsAvailable again")
            await eventually(lambda: replicas(k) == 6, "the scale-up the metrics ask for (at most 2 + 4)")

    run(scenario())


def test_prometheus_down_holds_the_count_until_it_returns(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator():
            await k.create_secret("prom-auth", {"token": key("s3cret\n")})
            await pods(k, fake, ["qwen-a"], kv=0.5)
            await created(k, spec_with(1, prometheus={
                "url": fake.url, "bearerTokenSecretRef": {"name": "prom-auth", "key": "token"}}))
            await eventually(lambda: metrics_condition(k).get("status") == "True", "a first reading")
            assert set(fake.authorizations) == {"Bearer s3cret"}
            assert any('namespace="ml",pod=~"qwen\\\\-a"' in query for query in fake.queries)

            fake.down = True
            fake.set(["qwen-a"], kv=1.0)
            await eventually(lambda: metrics_condition(k).get("reason") == "PrometheusUnreachable", "unreachable")
            assert "answered 503" in metrics_condition(k)["message"]
            await intervals(k, 2)
            assert replicas(k) == 1

            # Prometheus answers again, but its last scrape of the pod is old: stale, still held.
            fake.down = False
            fake.pods["qwen-a"].scraped_at = 1.0
            await eventually(lambda: metrics_condition(k).get("reason") == "MetricsStale", "MetricsStale")
            assert replicas(k) == 1

            fake.pods["qwen-a"].scraped_at = None
            await eventually(lambda: replicas(k) == 2, "the scale-up once the metrics are back")
            await eventually(lambda: metrics_condition(k).get("status") == "True", "MetricsAvailable again")

    run(scenario())


def test_saturated_at_max_replicas_is_scaling_limited(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            # 0.95 / 0.5 = 1.9; the 16 waiting beyond the target of 4 are one batch of the 16
            # each runs: 1 + 16/16 = 2 (read as a rate, 20 / 4 = 5). 2 x 2 = 4 replicas.
            await pods(k, fake, ["qwen-a", "qwen-b"], kv=0.95, waiting=20, running=16)
            await created(k, spec_with(2, maxReplicas=2))
            limited = await eventually(
                lambda: condition(k.engine("qwen"), "ScalingLimited").get("status") == "True"
                and condition(k.engine("qwen"), "ScalingLimited"), "ScalingLimited")
            assert limited["reason"] == "TooManyReplicas"
            assert "the load asks for 4 replicas; maxReplicas is 2" in limited["message"]
            assert replicas(k) == 2 and not scale_writes(k)

    run(scenario())


def test_without_autoscaling_a_scale_write_is_left_alone(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await pods(k, fake, ["qwen-a", "qwen-b"], kv=1.0, waiting=50)
            # fcfs pinned: under auto, the default, the policy tuner reads the pods with autoscaling off too.
            pinned = {**spec_with(2, enabled=False), "scheduling": {**SPEC["scheduling"], "policy": "fcfs"}}
            await created(k, pinned)
            await k.scale("qwen", 3)
            await eventually(lambda: k.deployment("qwen")["spec"]["replicas"] == 3, "the Deployment to follow")
            await asyncio.sleep(3 * INTERVAL)
            assert replicas(k) == 3 and not scale_writes(k) and reads(k) == 0

            # Turned on, the loop takes over; turned off again, it stops.
            await k.update_engine("qwen", lambda spec: spec["autoscaling"].update(enabled=True))
            await eventually(lambda: replicas(k) == 6, "the autoscaler's write")
            await k.update_engine("qwen", lambda spec: spec["autoscaling"].update(enabled=False))
            await asyncio.sleep(INTERVAL)
            await k.scale("qwen", 1)
            count = reads(k)
            await asyncio.sleep(3 * INTERVAL)
            assert replicas(k) == 1 and reads(k) == count

    run(scenario())


def test_deleting_the_engine_ends_its_loop(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, fake_metrics() as fake, operator(pod_metrics_url=fake.pod_url):
            await pods(k, fake, ["qwen-a"], kv=0.5)
            await created(k, spec_with(1))
            await intervals(k, 1)
            assert not k.engine("qwen")["metadata"].get("finalizers")
            await k.delete(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferenceengines/qwen")
            await asyncio.sleep(INTERVAL)
            count = reads(k)
            await asyncio.sleep(3 * INTERVAL)
            assert reads(k) == count

    run(scenario())
