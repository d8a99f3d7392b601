"""InferenceEngine -> the fleet router's objects (spec.routing). Pure, like render.py.

Clients keep calling the Service named after the engine, which now leads to the routers; the
engines get a headless Service of their own, whose EndpointSlices the routers watch (hence the
ServiceAccount, Role and RoleBinding). The routers run the engine's own image, `kvpilot router`,
with the command line of notes/ROUTER_CONTRACTS.md section 5.

A router reads the model's tokenizer and chat template, never its weights: a PVC or hostPath
model is mounted read-only as the engines mount it; a Hugging Face model is downloaded by the
router's own init container limited to TOKENIZER_FILES (megabytes, not gigabytes). So a router
serves, and holds requests, before any engine was ever ready: an engine deployed at 0 replicas
starts on its first request.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvpilot.operator import naming, pod_parts
from kvpilot.operator.pod_parts import Manifest

# What a tokenizer and its chat template are made of, in the layouts transformers reads (fast
# and slow tokenizers, the template inline or in its own file); weights match none of them.
TOKENIZER_FILES = (
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "chat_template.json", "*.jinja", "vocab.*", "merges.txt",
)
CACHE_SALT_MOUNT: Manifest = {"name": "cache-salt", "mountPath": pod_parts.CACHE_SALT_DIR, "readOnly": True}


def routed(engine: Mapping[str, Any]) -> bool:
    return bool(engine["spec"]["routing"]["enabled"])


def cache_salt_secret(engine: Mapping[str, Any], salt: str) -> Manifest:
    # Keys every tenant's cache salt, in the engines and the routers alike: their block hashes
    # must agree for prefix-aware routing, and differ from any other fleet's. Salts follow tenant
    # names, so a rotated API key keeps its tenant's cache.
    return pod_parts.owned(engine, "v1", "Secret", naming.cache_salt_secret_name(engine["metadata"]["name"]),
                           type="Opaque", data={pod_parts.CACHE_SALT_KEY: salt})


def cache_salt_volume(engine: Mapping[str, Any]) -> Manifest:
    return pod_parts.secret_volume("cache-salt", naming.cache_salt_secret_name(engine["metadata"]["name"]))


def engines_and_access(engine: Mapping[str, Any]) -> list[Manifest]:
    """The engines' own Service, and the routers' right to watch its EndpointSlices."""
    name = engine["metadata"]["name"]
    router = naming.router_name(name)
    router_labels = naming.router_labels(name)
    return [
        pod_parts.owned(engine, "v1", "Service", naming.engines_service_name(name), spec={
            # Headless: the routers pick a pod themselves; a virtual IP would pick for them.
            "clusterIP": "None",
            "selector": naming.selector_labels(name),
            "ports": [{"name": "http", "port": pod_parts.CONTAINER_PORT, "targetPort": "http", "protocol": "TCP"}],
        }),
        pod_parts.owned(engine, "v1", "ServiceAccount", router, labels=router_labels),
        pod_parts.owned(engine, "rbac.authorization.k8s.io/v1", "Role", router, labels=router_labels, rules=[
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        ]),
        pod_parts.owned(engine, "rbac.authorization.k8s.io/v1", "RoleBinding", router, labels=router_labels,
                        roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router},
                        subjects=[{"kind": "ServiceAccount", "name": router,
                                   "namespace": engine["metadata"]["namespace"]}]),
    ]


def router_workload(engine: Mapping[str, Any]) -> list[Manifest]:
    """The routers' Deployment and PodDisruptionBudget."""
    name = engine["metadata"]["name"]
    router = naming.router_name(name)
    labels = naming.router_labels(name)
    selector = naming.router_selector_labels(name)
    return [
        pod_parts.owned(engine, "apps/v1", "Deployment", router, labels=labels, spec={
            "replicas": engine["spec"]["routing"]["replicas"],
            "selector": {"matchLabels": selector},
            # Routers need no GPU: a surge pod first, so that a rollout never serves with fewer.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": _pod_template(engine),
        }),
        pod_parts.owned(engine, "policy/v1", "PodDisruptionBudget", router, labels=labels, spec={
            # Active-active: a drain may take all routers but one.
            "minAvailable": 1,
            "selector": {"matchLabels": selector},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        }),
    ]


def retired(engine: Mapping[str, Any]) -> list[Manifest]:
    """Every object only routing renders, the routers first: what turning routing off leaves
    behind (the engine's Service leads to the engines again)."""
    return [*reversed(router_workload(engine)), *reversed(engines_and_access(engine)), cache_salt_secret(engine, "")]


def router_args(engine: Mapping[str, Any]) -> list[str]:
    """The `kvpilot router` arguments."""
    spec = engine["spec"]
    routing = spec["routing"]
    return [
        pod_parts.MODEL_DIR,
        "--host", "0.0.0.0",
        "--port", str(pod_parts.CONTAINER_PORT),
        "--kubernetes-service", naming.engines_service_name(engine["metadata"]["name"]),
        "--kubernetes-port-name", "http",
        "--routing-strategy", routing["strategy"],
        "--bounded-load-factor", str(routing["boundedLoadFactor"]),
        "--hold-timeout", str(routing["holdTimeoutSeconds"]),
        "--tenants-file", pod_parts.TENANTS_FILE,
        # The engine's Service leads to the routers: its EndpointSlices are the fleet's routers,
        # among which each tenant's limit is shared out (this router is http://$POD_IP:port).
        "--kubernetes-peers-service", engine["metadata"]["name"],
        "--cache-salt-secret-file", f"{pod_parts.CACHE_SALT_DIR}/{pod_parts.CACHE_SALT_KEY}",
        # A stream passes through the router: it drains as long as the engines do.
        "--shutdown-timeout", str(spec["engine"]["shutdownTimeoutSeconds"]),
    ]


def _pod_template(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    spec = engine["spec"]
    source = pod_parts.model_source(engine, only=TOKENIZER_FILES)
    mounts = [
        *source.mounts,
        {"name": "config", "mountPath": pod_parts.CONFIG_DIR, "readOnly": True},
        {"name": "tenant-keys", "mountPath": pod_parts.TENANT_KEYS_DIR, "readOnly": True},
        CACHE_SALT_MOUNT,
        {"name": "cache", "mountPath": pod_parts.CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    # No startup probe: /health answers as soon as the router runs, also with no engine ready
    # (it holds requests then).
    container = pod_parts.server_container(
        "router", spec["image"], ["kvpilot", "router"], router_args(engine),
        ports=[{"name": "http", "containerPort": pod_parts.CONTAINER_PORT, "protocol": "TCP"}],
        resources=copy.deepcopy(spec["routing"].get("resources", {})), mounts=mounts)
    # The router's own address among its peers' (--kubernetes-peers-service).
    container["env"].append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    pod_spec: Manifest = {
        "serviceAccountName": naming.router_name(name),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": pod_parts.termination_grace_seconds(spec),
        "securityContext": pod_parts.pod_security(),
        "containers": [container],
        "volumes": [
            *source.volumes,
            {"name": "config", "configMap": {"name": naming.config_map_name(name)}},
            pod_parts.secret_volume("tenant-keys", naming.tenant_keys_secret_name(name)),
            cache_salt_volume(engine),
            {"name": "cache", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
        ],
        # Routers on different nodes where they can be: one node lost leaves one serving.
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": naming.router_selector_labels(name)}},
        }]}},
    }
    if source.init_containers:
        pod_spec["initContainers"] = source.init_containers
    if "hostPath" in spec["model"]:
        # The folder exists on the nodes the engines are placed on.
        overrides = spec.get("podTemplate", {})
        for key in ("nodeSelector", "tolerations"):
            if key in overrides:
                pod_spec[key] = copy.deepcopy(overrides[key])
    return {"metadata": {"labels": naming.router_labels(name)}, "spec": pod_spec}
