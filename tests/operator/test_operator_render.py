"""Rendering: InferenceEngine -> Deployment, Service, ConfigMap, Secret, PDB, ServiceMonitor."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from inference_engines import ADMIN_TOKEN, BATCH_KEY, CACHE_SALT, FULL_SPEC, PROD_KEY, TENANT_KEYS, engine, example
from kvpilot.operator import naming, render, tuner

GOLDEN = Path(__file__).parent / "golden"
# Set to rewrite the golden files from the renderer; review the diff before committing it.
UPDATE_GOLDEN = os.environ.get("KVPILOT_UPDATE_GOLDEN") == "1"


class _GoldenDumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's files) as literal blocks, so that the golden files read well."""


_GoldenDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def children(obj: dict[str, Any], *, keys: dict[str, str] | None = None, monitor: bool = False) -> dict[str, Any]:
    """The rendered objects by name, and by kind for the first of each kind (for the two Secrets
    and the two ConfigMaps, the kind names the tenant keys and the engine config)."""
    rendered = render.children(obj, tenant_keys=TENANT_KEYS if keys is None else keys, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT,
                               service_monitor=monitor)
    found: dict[str, Any] = {}
    for child in rendered:
        found.setdefault(child["kind"], child)
        found[child["metadata"]["name"]] = child
    return found


def template_hash(obj: dict[str, Any]) -> str:
    template = children(obj)["Deployment"]["spec"]["template"]
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()


def with_spec(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(FULL_SPEC)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = spec
        for part in parents:
            node = node[part]
        node[leaf] = value
    return engine(spec)


@pytest.mark.parametrize("kind", ["Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "Secret",
                                  "llama-admin-token", "llama-scheduling"])
def test_golden(kind: str) -> None:
    rendered = children(engine())[kind]
    golden = GOLDEN / f"full-{kind.removeprefix('llama-').lower()}.yaml"
    if UPDATE_GOLDEN:
        golden.write_text(yaml.dump(rendered, Dumper=_GoldenDumper, sort_keys=False))
    assert rendered == yaml.safe_load(golden.read_text())


def test_children_in_creation_order() -> None:
    rendered = render.children(engine(), tenant_keys={}, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT, service_monitor=True)
    assert [(c["kind"], c["metadata"]["name"]) for c in rendered] == [
        ("Secret", "llama-tenant-keys"), ("Secret", "llama-admin-token"), ("ConfigMap", "llama-config"),
        ("ConfigMap", "llama-scheduling"), ("Service", "llama"), ("Deployment", "llama"),
        ("PodDisruptionBudget", "llama"), ("ServiceMonitor", "llama"),
    ]


def test_service_monitor_only_where_its_api_exists() -> None:
    assert "ServiceMonitor" not in children(engine(), monitor=False)
    monitor = children(engine(), monitor=True)["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"] == naming.selector_labels("llama")
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s", "relabelings": [
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"], "targetLabel": "engine"},
        {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"], "targetLabel": "component"},
    ]}]


def test_every_child_is_owned_and_labelled() -> None:
    for child in render.children(engine(), tenant_keys=TENANT_KEYS, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT, service_monitor=True):
        meta = child["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["ownerReferences"] == [{
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceEngine", "name": "llama",
            "uid": "uid-llama", "controller": True,
        }]
        assert meta["labels"] == {
            "app.kubernetes.io/name": "kvpilot",
            "app.kubernetes.io/instance": "llama",
            "app.kubernetes.io/component": "engine",
            "app.kubernetes.io/part-of": "kvpilot",
            "app.kubernetes.io/managed-by": "kvpilot-operator",
        }


def test_rendered_children_are_valid_kubernetes_objects() -> None:
    for obj in (engine(), example(), engine({"model": {"name": "m", "hostPath": "/models/m"}, "image": "i"})):
        for child in render.children(obj, tenant_keys=TENANT_KEYS, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT, service_monitor=False):
            kubernetes_validate.validate(child, "1.30", strict=True)


@pytest.mark.parametrize("change", [
    {"scheduling__tenants": []},
    {"scheduling__tenants": [{"name": "new", "priority": 7, "apiKeySecretRef": {"name": "new-key"}}]},
    {"scheduling__tenants": [{"name": "prod", "priority": 1, "maxConcurrentRequests": 2}]},
])
def test_tenant_changes_leave_the_pod_template_alone(change: dict[str, Any]) -> None:
    before, after = engine(), with_spec(**change)
    assert template_hash(before) == template_hash(after)
    assert children(before)["Deployment"] == children(after)["Deployment"]
    assert children(before)["ConfigMap"] != children(after)["ConfigMap"]


def test_new_tenant_keys_leave_the_pod_template_alone() -> None:
    assert template_hash(engine()) == hashlib.sha256(
        json.dumps(children(engine(), keys={})["Deployment"]["spec"]["template"], sort_keys=True).encode()
    ).hexdigest()


@pytest.mark.parametrize("change", [
    {"model__pvc": {"claimName": "other-models"}},
    {"model__name": "llama-3.1-8b"},
    {"image": "ghcr.io/kvpilot/kvpilot:0.2.0"},
    {"engine__maxNumSeqs": 64},
    {"engine__extraArgs": []},
    {"parallelism__tensor": 4},
    {"scheduling__policy": "fcfs"},
])
def test_pod_changes_change_the_pod_template(change: dict[str, Any]) -> None:
    assert template_hash(engine()) != template_hash(with_spec(**change))


def test_scaling_and_service_changes_do_not_restart_pods() -> None:
    assert template_hash(engine()) == template_hash(with_spec(replicas=5))
    assert template_hash(engine()) == template_hash(with_spec(service={"type": "LoadBalancer", "port": 443}))


def test_generation_is_recorded_outside_the_pod_template() -> None:
    older, newer = engine(generation=3), engine(generation=4)
    assert children(newer)["Deployment"]["metadata"]["annotations"] == {"kvpilot.dev/generation": "4"}
    assert template_hash(older) == template_hash(newer)


def test_security_context() -> None:
    pod = children(engine())["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    # A read-only root needs writable places for caches and scratch files.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/var/cache/kvpilot", "/tmp"):
        assert "emptyDir" in volumes[mounts[path]]


@pytest.mark.parametrize("tensor", [1, 2, 4, 8])
def test_gpu_limit_equals_tensor_parallelism(tensor: int) -> None:
    obj = with_spec(parallelism={"tensor": tensor})
    (container,) = children(obj)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tensor
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(tensor)


def test_resources_override_the_gpu_limit() -> None:
    # No GPU: an engine on CPUs (the CRD refuses fewer GPUs than parallelism.tensor, but not 0).
    obj = with_spec(resources={"limits": {"nvidia.com/gpu": 0, "memory": "8Gi"}})
    (container,) = children(obj)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 0, "memory": "8Gi"}}


def test_drain_outlasts_the_shutdown_timeout() -> None:
    for timeout in (0, 30, 600):
        obj = with_spec(engine={"shutdownTimeoutSeconds": timeout})
        pod = children(obj)["Deployment"]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["args"][container["args"].index("--shutdown-timeout") + 1] == str(timeout)
        sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > sleep + timeout


def test_rollout_never_needs_a_spare_gpu() -> None:
    strategy = children(engine())["Deployment"]["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_probes_use_health() -> None:
    (container,) = children(engine())["Deployment"]["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_serve_flags_follow_the_engine_spec() -> None:
    assert render.serve_args(engine()) == [
        "/var/lib/kvpilot/model",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--served-model-name", "llama-3-8b",
        "--tensor-parallel-size", "2",
        "--max-num-seqs", "128",
        "--max-num-batched-tokens", "8192",
        "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.85",
        "--attention-backend", "triton",
        "--block-size", "16",
        "--no-enable-prefix-caching",
        "--scheduling-policy", "priority",
        "--shutdown-timeout", "30",
        "--tenants-file", "/etc/kvpilot/tenants.yaml",
        "--admin-token-file", "/var/run/kvpilot/admin/token",
        "--seed", "7",
    ]


def test_hugging_face_source() -> None:
    obj = engine({"model": {"name": "qwen", "huggingFace": {"repo": "Qwen/Qwen2.5-0.5B-Instruct",
                                                          "tokenSecretRef": {"name": "hf"}}}, "image": "i"})
    pod = children(obj)["Deployment"]["spec"]["template"]["spec"]
    (download,) = pod["initContainers"]
    assert download["command"] == [
        "hf", "download", "Qwen/Qwen2.5-0.5B-Instruct", "--revision", "main", "--local-dir", "/var/cache/kvpilot/model",
    ]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in download["env"]
    assert download["securityContext"]["readOnlyRootFilesystem"] is True
    assert "resources" not in download, "downloading needs no GPU"
    (engine_container,) = pod["containers"]
    # The engine serves the downloaded folder, read-only, and never sees the Hub token.
    assert engine_container["args"][0] == "/var/lib/kvpilot/model"
    assert {"name": "cache", "mountPath": "/var/lib/kvpilot/model", "subPath": "model", "readOnly": True} in (
        engine_container["volumeMounts"]
    )
    assert all(env["name"] != "HF_TOKEN" for env in engine_container["env"])
    assert "model" not in {v["name"] for v in pod["volumes"]}


def test_local_sources_need_no_init_container() -> None:
    assert "initContainers" not in children(engine())["Deployment"]["spec"]["template"]["spec"]


def test_host_path_source() -> None:
    obj = engine({"model": {"name": "m", "hostPath": "/models/m"}, "image": "i"})
    pod = children(obj)["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/models/m", "type": "Directory"}} in pod["volumes"]
    mount = {"name": "model", "mountPath": "/var/lib/kvpilot/model", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]


def test_tenants_file_maps_priorities_and_references_key_files() -> None:
    config = children(engine())["ConfigMap"]
    assert yaml.safe_load(config["data"]["tenants.yaml"]) == [
        {"name": "prod", "priority": -100, "allowRequestPriority": False,
         "apiKeyFiles": ["/var/run/kvpilot/tenant-keys/prod"], "maxConcurrentRequests": 32},
        {"name": "batch", "priority": 10, "allowRequestPriority": True,
         "apiKeyFiles": ["/var/run/kvpilot/tenant-keys/batch"]},
    ]
    assert yaml.safe_load(config["data"]["engine-args.yaml"]) == render.serve_args(engine())


def test_tenant_without_a_key_gets_no_key_file() -> None:
    config = children(engine(), keys={"batch": TENANT_KEYS["batch"]})["ConfigMap"]
    prod, _ = yaml.safe_load(config["data"]["tenants.yaml"])
    assert prod["apiKeyFiles"] == []


def test_api_keys_go_to_the_secret_and_never_to_the_config_map() -> None:
    rendered = children(engine())
    text = json.dumps(rendered["ConfigMap"])
    for key in (PROD_KEY, BATCH_KEY, *TENANT_KEYS.values()):
        assert key not in text
    assert rendered["Secret"]["data"] == TENANT_KEYS
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    keys_volume = next(v for v in pod["volumes"] if v["name"] == "tenant-keys")
    assert keys_volume["secret"]["secretName"] == "llama-tenant-keys"
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tenant-keys")
    assert mount == {"name": "tenant-keys", "mountPath": "/var/run/kvpilot/tenant-keys", "readOnly": True}


def test_service_port_and_pdb() -> None:
    rendered = children(engine())
    assert rendered["Service"]["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
    ]
    assert rendered["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    assert render.endpoint(engine()) == "http://llama.ml.svc:80"


AUTO = {"scheduling__policy": "auto"}


def test_admin_token_secret_is_mounted_and_passed_to_the_engine() -> None:
    rendered = children(with_spec(**AUTO))
    assert rendered["llama-admin-token"]["data"] == {"token": ADMIN_TOKEN}
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "admin-token")
    assert volume == {"name": "admin-token", "secret": {"secretName": "llama-admin-token", "defaultMode": 0o440}}
    (container,) = pod["containers"]
    assert {"name": "admin-token", "mountPath": "/var/run/kvpilot/admin", "readOnly": True} in container["volumeMounts"]
    assert _flag(container["args"], "--admin-token-file") == "/var/run/kvpilot/admin/token"
    # The token is an input: rendering never makes one up, so a reconcile cannot rotate it.
    assert ADMIN_TOKEN not in json.dumps(rendered["Deployment"])


def test_auto_pods_start_with_the_policy_of_the_scheduling_config_map() -> None:
    rendered = children(with_spec(**AUTO))
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    # The file overrides the flag, which names where `auto` starts before the tuner first decides.
    assert _flag(container["args"], "--scheduling-policy") == "fcfs"
    assert _flag(container["args"], "--scheduling-policy-file") == "/var/run/kvpilot/scheduling/policy"
    assert {"name": "scheduling", "mountPath": "/var/run/kvpilot/scheduling", "readOnly": True} \
        in container["volumeMounts"]
    assert rendered["llama-scheduling"]["data"] == {"policy": "fcfs"}


def test_an_engine_without_scheduling_is_left_to_the_policy_tuner() -> None:
    bare = {key: value for key, value in FULL_SPEC.items() if key != "scheduling"}
    obj = engine(bare)
    (container,) = children(obj)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert _flag(container["args"], "--scheduling-policy-file") == "/var/run/kvpilot/scheduling/policy"
    # A queue above target with no replica to add: the tuner, not a pinned policy, switches it.
    state = tuner.initial_state(obj)
    for interval in range(tuner.PRESSURE_INTERVALS):
        decision = tuner.decide_policy(obj["spec"], can_scale=False, queue_depths=[50.0, 50.0], previous=state,
                                       now=15.0 * interval)
        state = decision.state
    assert decision.policy == "priority"


@pytest.mark.parametrize("pinned", ["fcfs", "priority"])
def test_a_pinned_policy_is_a_flag(pinned: str) -> None:
    rendered = children(with_spec(scheduling__policy=pinned))
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert _flag(container["args"], "--scheduling-policy") == pinned
    assert "--scheduling-policy-file" not in container["args"]
    assert rendered["llama-scheduling"]["data"] == {"policy": pinned}


def test_policy_flips_change_the_scheduling_config_map_and_never_the_pod_template() -> None:
    calm = with_spec(**AUTO)
    pressured = {**calm, "status": {"effectiveSchedulingPolicy": "priority"}}
    assert render.effective_scheduling_policy(calm) == "fcfs"
    assert render.effective_scheduling_policy(pressured) == "priority"
    assert children(pressured)["llama-scheduling"]["data"] == {"policy": "priority"}
    assert template_hash(calm) == template_hash(pressured)
    assert children(calm)["Deployment"] == children(pressured)["Deployment"]
    # A pinned policy ignores what status says.
    pinned = {**with_spec(scheduling__policy="fcfs"), "status": {"effectiveSchedulingPolicy": "priority"}}
    assert render.effective_scheduling_policy(pinned) == "fcfs"


def _flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, args
    return args[args.index(name) + 1]
