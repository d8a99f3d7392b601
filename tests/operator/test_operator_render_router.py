"""Rendering with spec.routing on: the routers' objects, and what routing changes for the engines."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate

from inference_engines import ADMIN_TOKEN, CACHE_SALT, FULL_SPEC, TENANT_KEYS, b64, engine
from kvpilot.operator import naming, render, render_router


def routed_spec(**routing: Any) -> dict[str, Any]:
    spec = copy.deepcopy(FULL_SPEC)
    spec["routing"] = {"enabled": True, **routing}
    return spec


def rendered(obj: dict[str, Any] | None = None, *, keys: dict[str, str] | None = None,
             monitor: bool = False) -> dict[tuple[str, str], Any]:
    children = render.children(obj or engine(routed_spec()), tenant_keys=TENANT_KEYS if keys is None else keys,
                               admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT, service_monitor=monitor)
    return {(child["kind"], child["metadata"]["name"]): child for child in children}


def pod(objects: dict[tuple[str, str], Any], name: str) -> dict[str, Any]:
    return objects["Deployment", name]["spec"]["template"]["spec"]


def _flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, args
    return args[args.index(name) + 1]


def test_routing_adds_the_routers_objects_in_a_safe_order() -> None:
    assert list(rendered(monitor=True)) == [
        ("Secret", "llama-tenant-keys"), ("Secret", "llama-admin-token"), ("Secret", "llama-cache-salt"),
        ("ConfigMap", "llama-config"), ("ConfigMap", "llama-scheduling"), ("Service", "llama"),
        ("Service", "llama-engines"), ("ServiceAccount", "llama-router"), ("Role", "llama-router"),
        ("RoleBinding", "llama-router"), ("Deployment", "llama"), ("PodDisruptionBudget", "llama"),
        ("Deployment", "llama-router"), ("PodDisruptionBudget", "llama-router"), ("ServiceMonitor", "llama"),
    ]


def test_routing_off_renders_no_router() -> None:
    kinds = {kind for kind, _ in rendered(engine())}
    assert kinds == {"Secret", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget"}
    assert "--kv-events-config" not in render.serve_args(engine())


def test_every_routed_child_is_owned_and_valid() -> None:
    for (kind, name), child in rendered(monitor=False).items():
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-llama", (kind, name)
        assert child["metadata"]["labels"][naming.MANAGED_BY_LABEL] == naming.FIELD_MANAGER
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_clients_reach_the_routers_and_the_routers_watch_the_engines() -> None:
    objects = rendered()
    front = objects["Service", "llama"]["spec"]
    assert front["selector"] == naming.router_selector_labels("llama")
    assert front["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    engines = objects["Service", "llama-engines"]["spec"]
    assert engines["selector"] == naming.selector_labels("llama")
    assert engines["clusterIP"] == "None"
    args = pod(objects, "llama-router")["containers"][0]["args"]
    assert _flag(args, "--kubernetes-service") == "llama-engines"
    assert _flag(args, "--kubernetes-port-name") == engines["ports"][0]["name"]
    # The engine pods keep their selector: the scale subresource and the autoscaler count them.
    assert objects["Deployment", "llama"]["spec"]["selector"]["matchLabels"] == naming.selector_labels("llama")


def test_the_router_may_only_list_and_watch_endpoint_slices() -> None:
    objects = rendered()
    assert objects["Role", "llama-router"]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]
    binding = objects["RoleBinding", "llama-router"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "ml"}]
    router_pod = pod(objects, "llama-router")
    assert router_pod["serviceAccountName"] == "llama-router"
    assert "automountServiceAccountToken" not in router_pod, "the router logs in with its token"
    assert pod(objects, "llama")["automountServiceAccountToken"] is False


def test_router_deployment_is_active_active_from_the_routing_spec() -> None:
    obj = engine(routed_spec(replicas=3, strategy="least-loaded", boundedLoadFactor=1.5, holdTimeoutSeconds=300,
                             resources={"limits": {"cpu": "2", "memory": "4Gi"}}))
    objects = rendered(obj)
    deployment = objects["Deployment", "llama-router"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert objects["PodDisruptionBudget", "llama-router"]["spec"]["minAvailable"] == 1
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == FULL_SPEC["image"], "the runtime image: no second image"
    assert container["command"] == ["kvpilot", "router"]
    assert container["args"] == [
        "/var/lib/kvpilot/model",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--kubernetes-service", "llama-engines",
        "--kubernetes-port-name", "http",
        "--routing-strategy", "least-loaded",
        "--bounded-load-factor", "1.5",
        "--hold-timeout", "300",
        "--tenants-file", "/etc/kvpilot/tenants.yaml",
        "--kubernetes-peers-service", "llama",
        "--cache-salt-secret-file", "/var/run/kvpilot/cache-salt/salt",
        "--shutdown-timeout", "30",
    ]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    assert container["resources"] == {"limits": {"cpu": "2", "memory": "4Gi"}}
    assert "nvidia.com/gpu" not in json.dumps(container)


def test_engines_publish_kv_events_and_share_the_salt() -> None:
    objects = rendered()
    (container,) = pod(objects, "llama")["containers"]
    assert json.loads(_flag(container["args"], "--kv-events-config")) == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558", "topic": "kv-events",
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    assert objects["Secret", "llama-cache-salt"]["data"] == {"salt": CACHE_SALT}
    for name in ("llama", "llama-router"):
        spec = pod(objects, name)
        (container,) = spec["containers"]
        assert _flag(container["args"], "--cache-salt-secret-file") == "/var/run/kvpilot/cache-salt/salt"
        assert render_router.CACHE_SALT_MOUNT in container["volumeMounts"]
        assert {"name": "cache-salt", "secret": {"secretName": "llama-cache-salt", "defaultMode": 0o440}} \
            in spec["volumes"]
    assert CACHE_SALT not in json.dumps([objects["Deployment", "llama"], objects["Deployment", "llama-router"]])


def test_a_rotated_tenant_key_keeps_every_salt_and_pod_template() -> None:
    # Salts are keyed by tenant name with the fleet's secret: a new API key changes the keys
    # Secret only, so the tenant's prefix cache survives the rotation.
    before = rendered()
    after = rendered(keys={**TENANT_KEYS, "prod": b64("sk-prod-rotated")})
    assert before["Secret", "llama-tenant-keys"] != after["Secret", "llama-tenant-keys"]
    assert before["Secret", "llama-cache-salt"] == after["Secret", "llama-cache-salt"]
    for name in ("llama", "llama-router"):
        assert before["Deployment", name] == after["Deployment", name]


def test_the_router_mounts_a_volume_model_read_only() -> None:
    objects = rendered()
    router_pod = pod(objects, "llama-router")
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} \
        in router_pod["volumes"]
    (container,) = router_pod["containers"]
    assert {"name": "model", "mountPath": "/var/lib/kvpilot/model", "subPath": "llama-3-8b", "readOnly": True} \
        in container["volumeMounts"]
    assert "initContainers" not in router_pod


def test_a_host_path_router_runs_where_the_folder_is() -> None:
    spec = routed_spec()
    spec["model"] = {"name": "m", "hostPath": "/models/m"}
    router_pod = pod(rendered(engine(spec)), "llama-router")
    assert router_pod["nodeSelector"] == FULL_SPEC["podTemplate"]["nodeSelector"]
    assert router_pod["tolerations"] == FULL_SPEC["podTemplate"]["tolerations"]
    assert {"name": "model", "hostPath": {"path": "/models/m", "type": "Directory"}} in router_pod["volumes"]


def test_a_hub_router_downloads_the_tokenizer_only() -> None:
    spec = routed_spec()
    spec["model"] = {"name": "qwen", "huggingFace": {"repo": "Qwen/Qwen2.5-0.5B-Instruct",
                                                     "tokenSecretRef": {"name": "hf"}}}
    objects = rendered(engine(spec))
    (download,) = pod(objects, "llama-router")["initContainers"]
    assert download["name"] == "download-tokenizer"
    command = download["command"]
    included = [command[i + 1] for i, arg in enumerate(command) if arg == "--include"]
    assert included == list(render_router.TOKENIZER_FILES)
    assert not any(pattern.endswith((".safetensors", ".bin", ".gguf")) or pattern == "*" for pattern in included)
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in download["env"]
    # The engines still download the whole repository.
    (engine_download,) = pod(objects, "llama")["initContainers"]
    assert "--include" not in engine_download["command"]


def test_the_service_monitor_scrapes_engines_and_routers() -> None:
    objects = rendered(monitor=True)
    selector = objects["ServiceMonitor", "llama"]["spec"]["selector"]["matchLabels"]
    for service in ("llama", "llama-engines"):
        labels = objects["Service", service]["metadata"]["labels"]
        assert selector.items() <= labels.items(), service


def test_what_routing_off_retires_is_exactly_what_only_routing_renders() -> None:
    only_routed = set(rendered()) - set(rendered(engine()))
    retired = [(child["kind"], child["metadata"]["name"]) for child in render_router.retired(engine())]
    assert set(retired) == only_routed
    assert retired[0] == ("PodDisruptionBudget", "llama-router") and retired[1] == ("Deployment", "llama-router")
