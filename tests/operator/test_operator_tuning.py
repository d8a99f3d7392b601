"""The policy tuner in the control loop of the real kopf operator, against the emulated API server,
fake pod /metrics pages and fake pod admin endpoints; and the admin calls' edges: slow, dead and
broken pods, a wrong token."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import operator_harness as harness
from fake_metrics import fake_metrics
from fake_pods import FakePod, serving
from kvpilot.operator import control, engine_admin, kube

pytestmark = pytest.mark.timeout(60)


def test_slow_dead_and_broken_pods_fail_alone() -> None:
    async def scenario() -> None:
        good, slow, broken = FakePod(), FakePod(delay=5), FakePod(health_body="<html>")
        async with serving(good=good, slow=slow, broken=broken) as urls:
            urls["dead"] = "http://127.0.0.1:9"  # nothing listens there
            results = await engine_admin.apply_policy(urls, "priority", "right", timeout=0.5)
        assert [(r.pod, r.outcome) for r in results] == [
            ("broken", "failed"), ("dead", "failed"), ("good", "switched"), ("slow", "failed")]
        assert good.switches == ["priority"] and slow.switches == [] and broken.switches == []

    harness.run(scenario())


def test_a_wrong_token_is_refused_and_reported() -> None:
    async def scenario() -> None:
        pod = FakePod()
        async with serving(pod=pod) as urls:
            (result,) = await engine_admin.apply_policy(urls, "priority", "wrong", timeout=5)
        assert result.outcome == "failed" and result.detail.startswith("POST /admin/scheduling answered 401")
        assert pod.policy == "fcfs"

    harness.run(scenario())


def test_a_pod_already_in_line_is_only_read() -> None:
    async def scenario() -> None:
        pod = FakePod("priority")
        async with serving(pod=pod) as urls:
            (result,) = await engine_admin.apply_policy(urls, "priority", "right", timeout=5)
        assert (result.outcome, result.detail, pod.switches) == ("in-line", "priority", [])

    harness.run(scenario())


INTERVAL = 1
SPEC: dict[str, Any] = {
    **harness.SPEC,
    "scheduling": {**harness.SPEC["scheduling"], "policy": "auto", "calmWindowSeconds": 2},
    # At maxReplicas already: only the policy can give.
    "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 4,
                    "intervalSeconds": INTERVAL},
}
PODS = ["qwen-a", "qwen-b"]


def pod_lists(k: harness.Cluster) -> int:
    """The loop's intervals so far: each lists the engine's pods once."""
    return sum(1 for r in k.server if r.resource is not None and r.resource.plural == "pods" and r.method == "GET")


def effective(k: harness.Cluster) -> str | None:
    return k.engine("qwen").get("status", {}).get("effectiveSchedulingPolicy")


@contextlib.asynccontextmanager
async def control_loops(k: harness.Cluster, fake: Any, pod_url: Any, spec: dict[str, Any] = SPEC
                        ) -> AsyncIterator[control.ControlLoops]:
    """The control loops without kopf, for a test that ticks them itself, over the engine `qwen`
    (created with `spec` and reconciled once) and its one ready pod qwen-a."""
    async with harness.reconciler_alone() as reconciler:
        loops = control.ControlLoops(reconciler, pod_metrics_url=fake.pod_url, pod_url=pod_url)
        await k.create_secret("prod-key", {"api-key": harness.key("sk-prod")})
        await k.create_engine("qwen", spec)
        await reconciler.reconcile(k.engine("qwen"))
        await k.create_pod("qwen-a", "qwen", ready=True)
        try:
            yield loops
        finally:
            await loops.close()


@pytest.mark.parametrize("autoscaling", [{}, {"enabled": False}], ids=["at-max-replicas", "autoscaling-off"])
def test_the_loop_switches_every_ready_pod_under_pressure_and_back_when_calm(
    tmp_path: Path, autoscaling: dict[str, Any]
) -> None:
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], **autoscaling}}
    fake_pods = {name: FakePod(token=None) for name in PODS}

    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake, serving(**fake_pods) as urls:
            pod_url = lambda pod: urls[pod["metadata"]["name"]]  # noqa: E731
            async with harness.operator(pod_metrics_url=fake.pod_url, pod_url=pod_url):
                for name in PODS:
                    await k.create_pod(name, "qwen", ready=True)
                fake.set(PODS, waiting=10)
                await harness.created(k, spec)
                await harness.eventually(lambda: harness.child(k, "AdminToken"), "the admin token")
                token = base64.b64decode(harness.child(k, "AdminToken")["data"]["token"]).decode()
                generation = k.deployment("qwen")["metadata"]["generation"]

                await harness.eventually(lambda: effective(k) == "priority", "priority", timeout=20)
                (event,) = await harness.eventually(lambda: k.events("SchedulingPolicyChanged"), "the Event")
                assert event["message"].startswith("fcfs -> priority: 10 waiting requests per replica (target 4)")
                await harness.eventually(lambda: all(p.policy == "priority" for p in fake_pods.values()),
                                         "every pod on priority")
                assert all(p.tokens == {token} for p in fake_pods.values())
                assert harness.child(k, "SchedulingConfig")["data"] == {"policy": "priority"}

                fake.set(PODS, waiting=0)
                await harness.eventually(lambda: effective(k) == "fcfs", "fcfs again", timeout=20)
                await harness.eventually(lambda: all(p.policy == "fcfs" for p in fake_pods.values()),
                                         "every pod on fcfs")
                await harness.eventually(lambda: len(k.events("SchedulingPolicyChanged")) == 2, "the second Event")
                assert sorted(e["message"].split(":")[0] for e in k.events("SchedulingPolicyChanged")) == [
                    "fcfs -> priority", "priority -> fcfs"]
                assert harness.child(k, "SchedulingConfig")["data"] == {"policy": "fcfs"}
                # Neither switch touched the pod template.
                assert k.deployment("qwen")["metadata"]["generation"] == generation
                assert all(p.switches == ["priority", "fcfs"] for p in fake_pods.values())

    harness.run(scenario())


def test_a_pinned_policy_is_never_touched(tmp_path: Path) -> None:
    pinned = {**SPEC, "scheduling": {**SPEC["scheduling"], "policy": "fcfs"}}
    pod = FakePod("priority")  # out of line on purpose: nothing may bring it back

    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake, serving(**{"qwen-a": pod}) as urls:
            async with harness.operator(pod_metrics_url=fake.pod_url, pod_url=lambda _: urls["qwen-a"]):
                await k.create_pod("qwen-a", "qwen", ready=True)
                fake.set(["qwen-a"], waiting=50)
                await harness.created(k, pinned)
                # The loop runs (for the autoscaler) for several intervals.
                await harness.eventually(lambda: pod_lists(k) >= 4, "4 intervals", timeout=20)
                assert effective(k) == "fcfs"
                assert (pod.health_reads, pod.switches) == (0, [])
                assert not k.events("SchedulingPolicyChanged")

    harness.run(scenario())


def test_a_tuner_turned_off_and_on_again_starts_afresh(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake, serving(**{"qwen-a": FakePod(token=None)}) \
                as urls:
            async with control_loops(k, fake, lambda _: urls["qwen-a"]) as loops:
                fake.set(["qwen-a"], waiting=10)

                def pin(policy: str):
                    return k.update_engine("qwen", lambda spec: spec["scheduling"].update(policy=policy))

                await loops.tick(harness.NAMESPACE, "qwen")  # pressure: 1st interval
                await pin("fcfs")
                await loops.tick(harness.NAMESPACE, "qwen")  # the autoscaler's interval only
                await pin("auto")
                await loops.tick(harness.NAMESPACE, "qwen")  # pressure: 1st interval again, not the 2nd
                assert effective(k) == "fcfs"
                await loops.tick(harness.NAMESPACE, "qwen")
                assert effective(k) == "priority"

    harness.run(scenario())


def test_without_autoscaling_an_unusable_reading_is_logged_and_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "enabled": False}}

    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake:
            async with control_loops(k, fake, lambda _: None, spec) as loops:
                fake.raw_pages["qwen-a"] = "<html>busy</html>"
                for _ in range(3):
                    await loops.tick(harness.NAMESPACE, "qwen")
                assert effective(k) == "fcfs"
                # No ready pod (restarting, or scaled to zero) is nothing to read, not a bad reading.
                await k.set_ready("qwen-a", False)
                for _ in range(3):
                    await loops.tick(harness.NAMESPACE, "qwen")
                assert effective(k) == "fcfs"

    with caplog.at_level("WARNING", logger="kvpilot.operator.tuning"):
        harness.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvpilot.operator.tuning"]
    assert len(warnings) == 3
    assert warnings[0].startswith("InferenceEngine ml/qwen: no usable queue reading (pod qwen-a: /metrics is not")
    assert warnings[0].endswith("keeping fcfs")


@pytest.mark.parametrize("damage", ["deleted", "not-a-token"])
def test_a_lost_admin_token_is_made_again_and_used(tmp_path: Path, damage: str) -> None:
    pod = FakePod("priority", token=None)  # out of line: the tuner must call it with the token

    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake, serving(**{"qwen-a": pod}) as urls:
            async with control_loops(k, fake, lambda _: urls["qwen-a"]) as loops:
                fake.set(["qwen-a"], waiting=0)
                url = kube.path_of(harness.child(k, "AdminToken"))
                if damage == "deleted":
                    await k.delete(url)
                else:
                    await k.patch(url, {"data": {"token": "%%%"}})
                await loops.tick(harness.NAMESPACE, "qwen")  # finds the token lost: makes one
                await loops.tick(harness.NAMESPACE, "qwen")  # switches the pod with it
                token = base64.b64decode(harness.child(k, "AdminToken")["data"]["token"], validate=True).decode()
                assert token and pod.switches == ["fcfs"] and pod.tokens == {token}

    harness.run(scenario())
