"""The real kopf operator reconciling InferenceEngines against an emulated API server."""

from __future__ import annotations

import asyncio
import copy
import gc
from pathlib import Path
from typing import Any

import kmock
import pytest

from kvpilot.operator import handlers, kube, naming, reconcile, render
from operator_harness import (
    CHILD_NAMES, CHILDREN, NAMESPACE, SPEC, Cluster, child, cluster, condition, created, eventually, key,
    TEST_CLIENT, operator, phase_is, reconciler_alone, run, tenants_file,
)

pytestmark = pytest.mark.timeout(90)

def progress_message(k: Cluster) -> str:
    return condition(k.engine("qwen"), "Progressing").get("message", "")


def test_create_renders_every_child_with_an_owner_reference(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k, operator():
            await created(k)
            for kind in CHILDREN:
                obj = await eventually(lambda kind=kind: child(k, kind), kind)
                assert obj["metadata"]["ownerReferences"] == [{
                    "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceEngine", "name": "qwen",
                    "uid": k.engine("qwen")["metadata"]["uid"], "controller": True,
                }], kind
            engine = k.engine("qwen")
            assert not engine["metadata"].get("finalizers"), "deletion relies on ownerReferences alone"
            assert child(k, "Secret")["data"] == {"prod": key("sk-prod")}
            assert tenants_file(k)[0]["apiKeyFiles"] == ["/var/run/kvpilot/tenant-keys/prod"]
            await eventually(lambda: len(k.events("Created")) == len(CHILDREN), "a Created event per child")
            messages = sorted(e["message"] for e in k.events("Created"))
            assert messages == sorted(f"Created {child(k, role)['kind']} {CHILD_NAMES.get(role, 'qwen')}"
                                      for role in CHILDREN)
            assert all(e["involvedObject"]["name"] == "qwen" for e in k.events("Created"))
            status = await eventually(lambda: k.engine("qwen").get("status"), "a status")
            assert status["phase"] == "Pending"
            assert status["endpoint"] == f"http://qwen.{NAMESPACE}.svc:8000"

    run(scenario())


def test_no_service_monitor_without_its_api(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            await eventually(lambda: child(k, "PodDisruptionBudget"), "the PDB")
            assert not [key for key in k.server.objects if key[0] == CHILDREN["ServiceMonitor"]]

    run(scenario())


def test_status_follows_the_rollout_of_each_generation(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            first = await created(k)

            # A spec change that touches the pods updates the Deployment's template.
            await k.update_engine("qwen", lambda spec: spec.update(image="ghcr.io/kvpilot/kvpilot:0.2.0"))
            updated = await eventually(
                lambda: (d := k.deployment("qwen"))["metadata"]["generation"] > first["metadata"]["generation"] and d,
                "the Deployment to take the new template",
            )
            assert updated["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/kvpilot/kvpilot:0.2.0"
            await eventually(lambda: [e for e in k.events("Updated") if e["message"] == "Updated Deployment qwen"],
                             "an Updated event for the Deployment")

            # Its controller reports the rollout done: the engine is Ready for generation 2.
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 2), "Ready at generation 2")
            engine = k.engine("qwen")
            assert engine["metadata"]["generation"] == 2
            assert condition(engine, "Ready")["status"] == "True"
            assert condition(engine, "Ready")["observedGeneration"] == 2
            assert (engine["status"]["readyReplicas"], engine["status"]["desiredReplicas"]) == (2, 2)

            # Another spec change: Progressing, and still Progressing part-way through the rollout ...
            await k.update_engine("qwen", lambda spec: spec["engine"].update(maxNumSeqs=32))
            await eventually(lambda: phase_is(k, "Progressing", 3), "Progressing at generation 3")
            assert condition(k.engine("qwen"), "Ready")["status"] == "False"
            await k.roll_out("qwen", updated=1, available=1)
            await eventually(lambda: "1/2 replicas run the current pod template" in progress_message(k),
                             "the half-done rollout in the status")
            assert phase_is(k, "Progressing", 3)
            await k.roll_out("qwen", updated=2, available=1)
            await eventually(lambda: "1/2 updated replicas are available" in progress_message(k),
                             "the not-yet-available replica in the status")
            assert phase_is(k, "Progressing", 3)

            # ... until the Deployment reports the new generation available.
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 3), "Ready at generation 3")
            assert condition(k.engine("qwen"), "Progressing")["status"] == "False"

    run(scenario())


def test_tenant_changes_reach_the_config_without_touching_the_pods(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            before = await created(k)
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 1), "Ready")
            await k.create_secret("batch-key", {"token": key("sk-batch")})

            def add_tenant(spec: dict[str, Any]) -> None:
                spec["scheduling"]["tenants"][0]["priority"] = 50
                spec["scheduling"]["tenants"].append(
                    {"name": "batch", "priority": -5, "apiKeySecretRef": {"name": "batch-key", "key": "token"}}
                )

            await k.update_engine("qwen", add_tenant)
            await eventually(lambda: len(tenants_file(k)) == 2, "the new tenant in the tenants file")
            assert [(t["name"], t["priority"]) for t in tenants_file(k)] == [("prod", -50), ("batch", 5)]
            # The keys are applied before the tenants file that names them.
            assert child(k, "Secret")["data"] == {"prod": key("sk-prod"), "batch": key("sk-batch")}
            await eventually(lambda: phase_is(k, "Ready", 2), "Ready at generation 2, with no rollout")
            after = k.deployment("qwen")
            assert after["spec"]["template"] == before["spec"]["template"]
            assert after["metadata"]["generation"] == before["metadata"]["generation"]

    run(scenario())


def test_reconcile_is_idempotent(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k:
            async with operator():
                await created(k)
                await eventually(lambda: child(k, "ServiceMonitor"), "the last child")
                await eventually(lambda: k.engine("qwen").get("status"), "a status")
            versions = {kind: child(k, kind)["metadata"]["resourceVersion"] for kind in CHILDREN}
            engine_version = k.engine("qwen")["metadata"]["resourceVersion"]
            applies = len(_applies(k))
            events = len(k.events())

            # A restarted operator resumes the engine and applies every child again: nothing changes.
            async with operator():
                await eventually(lambda: len(_applies(k)) >= applies + len(CHILDREN), "the resumed reconcile")
                await eventually(lambda: len(_status_reads(k)) >= 1, "the resumed status check")
            assert {kind: child(k, kind)["metadata"]["resourceVersion"] for kind in CHILDREN} == versions
            assert k.engine("qwen")["metadata"]["resourceVersion"] == engine_version
            assert len(k.events()) == events, "no Created or Updated events for a no-op"

    run(scenario())


def test_an_operator_restarted_in_the_middle_of_a_reconcile_converges_without_duplicates(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k:
            async with operator():
                await k.create_secret("prod-key", {"api-key": key("sk-prod")})
                await k.create_engine("qwen", SPEC)
                await eventually(lambda: _applies(k), "the first child applied")
            # Stopped after its first apply: part of the children may exist.
            async with operator():
                await eventually(lambda: all(child(k, kind) for kind in CHILDREN), "every child")
                await k.roll_out("qwen")
                await eventually(lambda: phase_is(k, "Ready", 1), "Ready at generation 1")
            # Exactly the objects the renderer names, once each: nothing made twice under other names.
            rendered = render.children(k.engine("qwen"), tenant_keys={"prod": key("sk-prod")}, admin_token="t", cache_salt="s",
                                       service_monitor=True)
            for resource in set(CHILDREN.values()):
                owned = sorted(address[2] for address, obj in k.server.objects.items()
                               if address[0] == kmock.resource(resource) and not obj.deleted
                               and any(ref["name"] == "qwen" for ref in obj.raw["metadata"].get("ownerReferences", [])))
                plural = resource.rsplit("/", 1)[1]
                expected = sorted(o["metadata"]["name"] for o in rendered if o["kind"].lower() + "s" == plural)
                assert owned == expected and expected, resource

    run(scenario())


def test_a_flaky_api_server_delays_the_reconcile_but_it_converges(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path, service_monitors=True) as k:
            # A third of the operator's own calls fail with a conflict or a server error.
            k.server.fail_share(0.33, (409, 500, 503), user_agent=naming.FIELD_MANAGER, seed=3)
            async with operator():
                await k.create_secret("prod-key", {"api-key": key("sk-prod")})
                await k.create_engine("qwen", SPEC)
                await eventually(lambda: all(child(k, kind) for kind in CHILDREN), "every child, despite failures")
                await k.roll_out("qwen")
                await eventually(lambda: phase_is(k, "Ready", 1), "Ready, despite failures")

    run(scenario())


def _applies(k: Cluster) -> list[Any]:
    return [r for r in k.server if r.method == "PATCH" and "fieldManager=kvpilot-operator" in r.url.query_string]


def applied(k: Cluster, plural: str) -> int:
    """How often the operator applied objects of one kind: PDBs are applied last in a pass."""
    return sum(1 for r in _applies(k) if r.resource.plural == plural)


def _passes(k: Cluster) -> int:
    """Reconcile passes started: each reads the tenant's key Secret first (a pass applies only
    the children that differ from what it left, so applies do not tell)."""
    return sum(1 for r in k.server if r.method == "GET" and r.url.path.endswith("/secrets/prod-key")
               and r.headers.get("User-Agent") != TEST_CLIENT)


def _status_reads(k: Cluster) -> list[Any]:
    # The resume handler's status check GETs nothing; the Deployment follower GETs the engine.
    return [r for r in k.server if r.method == "GET" and r.url.path.endswith("/inferenceengines/qwen")]


def test_a_missing_tenant_secret_warns_and_is_picked_up_when_it_appears(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await k.create_engine("qwen", SPEC)
            await eventually(lambda: k.deployment("qwen"), "the Deployment, keys or not")
            await eventually(lambda: k.events("TenantKeyMissing"), "a warning about the missing key")
            warning = k.events("TenantKeyMissing")[0]
            assert warning["type"] == "Warning"
            assert warning["message"] == "tenant prod: Secret prod-key does not exist"
            assert tenants_file(k)[0]["apiKeyFiles"] == []
            # Not a failure: the engine serves, Degraded says what is missing.
            degraded = await eventually(lambda: condition(k.engine("qwen"), "Degraded"), "a Degraded condition")
            assert (degraded["status"], degraded["reason"]) == ("True", "TenantKeyMissing")
            assert degraded["message"] == "tenant prod: Secret prod-key does not exist"

            await k.create_secret("prod-key", {"api-key": key("sk-prod")})
            await eventually(lambda: (child(k, "Secret") or {}).get("data") == {"prod": key("sk-prod")},
                             "the key, on a retry")
            await eventually(lambda: tenants_file(k)[0]["apiKeyFiles"] == ["/var/run/kvpilot/tenant-keys/prod"],
                             "the key file in the tenants file")
            await eventually(lambda: condition(k.engine("qwen"), "Degraded")["status"] == "False",
                             "Degraded to clear")

    run(scenario())


def test_api_errors_are_reported_and_retried(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            # One more failure than the client retries at once: the pass fails, and kopf retries it.
            for _ in range(len(kube.RETRY_DELAYS_S) + 1):
                k.server.fail_next("PATCH", "deployments", 503)
            await created(k)
            failures = await eventually(lambda: k.events("ReconcileFailed"), "a warning about the failure")
            assert len(failures) == 1 and failures[0]["type"] == "Warning"
            assert "503" in failures[0]["message"]

    run(scenario())


def test_a_rejected_child_fails_the_generation_until_the_spec_changes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            k.server.fail_next("PATCH", "deployments", 422)
            # No tenant key: the key Secret's event would start a pass of its own, which might
            # take the one refusal instead of the engine's first pass (a real refusal repeats).
            await k.create_engine("qwen", {**SPEC, "scheduling": {}})
            await eventually(lambda: phase_is(k, "Failed", 1), "Failed at generation 1")
            assert condition(k.engine("qwen"), "Ready")["reason"] == "ReconcileFailed"
            assert "422" in condition(k.engine("qwen"), "Ready")["message"]
            assert k.deployment("qwen") is None

            await k.update_engine("qwen", lambda spec: spec.update(replicas=1))
            await eventually(lambda: k.deployment("qwen"), "the Deployment, for generation 2")
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 2), "Ready at generation 2")

    run(scenario())


def test_a_refused_generation_is_applied_again_only_once_the_spec_changes(tmp_path: Path) -> None:
    # What a child's or a Secret's event starts (reconcile_current) respects a refusal as kopf's
    # own handler does: the same spec would be refused again, with another Event.
    async def scenario() -> None:
        async with cluster(tmp_path) as k, reconciler_alone() as reconciler:
            await k.create_engine("qwen", {**SPEC, "scheduling": {}})
            k.server.fail_next("PATCH", "deployments", 422)
            with pytest.raises(kube.ApiError):
                await reconciler.reconcile(k.engine("qwen"))
            assert phase_is(k, "Failed", 1)
            applies = len(_applies(k))
            await reconciler.reconcile_current(NAMESPACE, "qwen")
            assert len(_applies(k)) == applies and k.deployment("qwen") is None
            await k.update_engine("qwen", lambda spec: spec.update(replicas=1))
            await reconciler.reconcile_current(NAMESPACE, "qwen")
            assert k.deployment("qwen")["spec"]["replicas"] == 1

    run(scenario())


def test_a_deployment_edited_by_hand_is_put_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            first = await created(k)
            url = kube.path_of(first)
            # kubectl scale deployment qwen --replicas=5, and kubectl set image.
            await k.patch(url, {"spec": {"replicas": 5}})
            await eventually(lambda: k.deployment("qwen")["spec"] == first["spec"], "the rendered spec again")
            await k.patch(url, {"spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "x"}]}}}})
            await eventually(lambda: k.deployment("qwen")["spec"] == first["spec"], "the rendered template again")
            # Its controller's own writes (status) start no pass (the put-back one has started).
            started = _passes(k)
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 1), "Ready")
            assert _passes(k) == started

    run(scenario())


def test_an_edit_put_back_already_starts_no_second_pass(tmp_path: Path) -> None:
    # A child's event waits on its engine's lock while a pass runs, and that pass may put the
    # edit back: the child as it is when the lock is had decides, not the older event.
    async def scenario() -> None:
        async with cluster(tmp_path) as k, reconciler_alone() as reconciler:
            await k.create_secret("prod-key", {"api-key": key("sk-prod")})
            await k.create_engine("qwen", SPEC)
            await reconciler.reconcile(k.engine("qwen"))
            rendered = k.deployment("qwen")["spec"]
            await k.patch(kube.path_of(k.deployment("qwen")), {"spec": {"replicas": 5}})
            edited = k.deployment("qwen")
            applies = len(_applies(k))
            await reconciler.child_changed(edited)
            assert k.deployment("qwen")["spec"] == rendered
            assert len(_applies(k)) > applies
            applies = len(_applies(k))
            await reconciler.child_changed(edited)
            assert len(_applies(k)) == applies

    run(scenario())


@pytest.mark.parametrize(("kind", "edit"), [
    ("ConfigMap", {"data": {"tenants.yaml": "[]\n"}}),  # every tenant dropped by hand
    ("Service", {"spec": {"ports": [{"name": "http", "port": 9999, "targetPort": "http", "protocol": "TCP"}]}}),
    ("PodDisruptionBudget", {"spec": {"maxUnavailable": 0}}),  # would block every node drain
    ("Secret", {"data": {"intruder": key("sk-intruder")}}),  # a key nobody declared
])
def test_a_child_edited_by_hand_is_put_back(tmp_path: Path, kind: str, edit: dict[str, Any]) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            # No keyed tenant: its Secret's event would start a second pass, which would put the
            # edit back whether edits are followed or not.
            await k.create_engine("qwen", {**SPEC, "scheduling": {}})
            await eventually(lambda: applied(k, "poddisruptionbudgets") == 1, "the first pass's end")
            first = child(k, kind)
            await k.patch(kube.path_of(first), edit)
            await eventually(lambda: {key: value for key, value in child(k, kind).items() if key != "metadata"}
                             == {key: value for key, value in first.items() if key != "metadata"},
                             f"the rendered {kind} again")

    run(scenario())


def test_a_deleted_deployment_is_recreated(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            first = await created(k)
            await k.delete(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/qwen")
            again = await eventually(
                lambda: (d := k.deployment("qwen")) and d["metadata"]["uid"] != first["metadata"]["uid"] and d,
                "a new Deployment",
            )
            assert again["spec"] == first["spec"]

    run(scenario())


@pytest.mark.parametrize("kind", ["Service", "ConfigMap", "SchedulingConfig", "PodDisruptionBudget", "Secret",
                                  "AdminToken"])
def test_a_deleted_child_is_recreated(tmp_path: Path, kind: str) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            first = await eventually(lambda: child(k, kind), kind)
            await k.delete(kube.path_of(first))
            again = await eventually(
                lambda: (c := child(k, kind)) and c["metadata"]["uid"] != first["metadata"]["uid"] and c,
                f"a new {kind}",
            )
            # The same object again; a lost admin token cannot be known again, so it is a new one.
            rendered = ("metadata", "data") if kind == "AdminToken" else ("metadata",)
            assert {key: value for key, value in again.items() if key not in rendered} == \
                {key: value for key, value in first.items() if key not in rendered}

    run(scenario())


def test_watches_stream_only_what_the_operator_needs(tmp_path: Path) -> None:
    # The API server filters the children by the operator's label; the Secrets cannot be (a
    # tenant's is the user's), so their listing comes in chunks, never a cluster's worth at once.
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            streams = {plural: [r for r in k.server if r.method == "GET" and r.resource is not None
                                and r.resource.plural == plural and not r.name
                                and r.headers.get("User-Agent") != TEST_CLIENT]
                       for plural in ("deployments", "services", "configmaps", "poddisruptionbudgets", "secrets")}
            assert all(streams.values()), {plural: len(found) for plural, found in streams.items()}
            for plural in ("deployments", "services", "configmaps", "poddisruptionbudgets"):
                assert {r.params.get("labelSelector") for r in streams[plural]} == {
                    "app.kubernetes.io/managed-by=kvpilot-operator"}, plural
            listings = [r for r in streams["secrets"] if r.params.get("watch") != "true"]
            assert listings and all(int(r.params["limit"]) <= 500 for r in listings)

    run(scenario())


def test_a_rotated_tenant_key_reaches_the_engine(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            await eventually(lambda: (child(k, "Secret") or {}).get("data") == {"prod": key("sk-prod")}, "the key")
            # kubectl edit secret prod-key: the old key must stop working, the new one start.
            await k.patch(f"/api/v1/namespaces/{NAMESPACE}/secrets/prod-key", {"data": {"api-key": key("sk-new")}})
            await eventually(lambda: child(k, "Secret")["data"] == {"prod": key("sk-new")}, "the rotated key")
            # kubectl delete secret prod-key: revoked.
            await k.delete(f"/api/v1/namespaces/{NAMESPACE}/secrets/prod-key")
            await eventually(lambda: not child(k, "Secret").get("data"), "the revoked key gone")
            await eventually(lambda: condition(k.engine("qwen"), "Degraded")["reason"] == "TenantKeyMissing",
                             "Degraded, with the missing key")

    run(scenario())


def test_scaled_to_zero_and_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            await created(k)
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 1), "Ready")
            await k.scale("qwen", 0)
            await eventually(lambda: k.deployment("qwen")["spec"]["replicas"] == 0, "no pods")
            await k.roll_out("qwen")
            await eventually(lambda: condition(k.engine("qwen"), "Ready").get("reason") == "ScaledToZero", "parked")
            assert k.engine("qwen")["status"]["phase"] == "Pending"
            await k.scale("qwen", 2)
            await eventually(lambda: k.deployment("qwen")["spec"]["replicas"] == 2, "the pods back")
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 3), "Ready again")

    run(scenario())


def test_other_engines_and_foreign_deployments_are_left_alone(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with cluster(tmp_path) as k, operator():
            other = copy.deepcopy(SPEC)
            other["scheduling"] = {}
            await k.create_engine("other", other)
            await created(k)
            await eventually(lambda: k.deployment("other"), "the other engine's Deployment")
            await k.roll_out("qwen")
            await eventually(lambda: phase_is(k, "Ready", 1), "Ready")
            # Its own pass writes its phase in its own time: qwen's rollout may be done first, and the
            # policy tuner's interval may write status before it.
            phase = await eventually(lambda: k.engine("other").get("status", {}).get("phase"), "the other engine's phase")
            assert phase == "Pending"

    run(scenario())


def test_secrets_are_followed_for_the_engines_whose_tenants_name_them() -> None:
    spec = copy.deepcopy(SPEC)
    spec["scheduling"]["tenants"] += [{"name": "batch", "apiKeySecretRef": {"name": "shared"}},
                                     {"name": "ops", "apiKeySecretRef": {"name": "shared", "key": "ops"}},
                                     {"name": "anonymous"}]
    assert handlers.engines_by_key_secret(namespace="ml", name="qwen", spec=spec) == {
        ("ml", "prod-key"): "qwen", ("ml", "shared"): "qwen"}
    assert handlers.engines_by_key_secret(namespace="ml", name="other", spec={"scheduling": {}}) == {}


def test_retry_delays_double_up_to_a_cap() -> None:
    assert [handlers.retry_delay(retry) for retry in range(4)] == [1, 2, 4, 8]
    assert handlers.retry_delay(30) == handlers.RETRY_MAX_SECONDS == 300


def test_engine_locks_last_only_while_used() -> None:
    async def hold(lock: asyncio.Lock) -> None:
        async with lock:
            pass

    async def scenario() -> None:
        locks = reconcile.EngineLocks()
        async with locks["ml", "a"]:
            assert locks["ml", "a"] is locks["ml", "a"] and len(locks) == 1
            waiter = asyncio.create_task(hold(locks["ml", "a"]))
            await asyncio.sleep(0)
        await waiter
        del waiter
        gc.collect()
        assert len(locks) == 0  # the engine may be long gone: nothing of it is kept

    run(scenario())
