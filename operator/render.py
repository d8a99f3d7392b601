"""InferenceEngine -> the objects that run it. Pure: no API calls, no clock, no randomness.

The engine is read as the API server serves it, with the CRD's defaults already applied
(`crds/inferenceengines.kvpilot.dev.yaml` is the one place they are declared).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

import yaml

from kvpilot.operator import adapter_sources, naming, render_lws, render_router
from kvpilot.operator.pod_parts import (
    CACHE_DIR,
    CACHE_SALT_DIR,
    CACHE_SALT_KEY,
    CONFIG_DIR,
    CONTAINER_PORT,
    MODEL_DIR,
    TENANT_KEYS_DIR,
    TENANTS_FILE,
    Manifest,
    ModelSource,
    cache_env,
    container_security,
    health_probe,
    model_source,
    owned,
    pod_security,
    secret_volume,
    server_container,
    stamped,
    termination_grace_seconds,
)
from kvpilot.operator.render_router import routed
from kvpilot.operator.serve_flags import spec_args

ADMIN_TOKEN_DIR = "/var/run/kvpilot/admin"
ADMIN_TOKEN_KEY = "token"
SCHEDULING_DIR = "/var/run/kvpilot/scheduling"
SCHEDULING_POLICY_KEY = "policy"
GPU_RESOURCE = "nvidia.com/gpu"
# The KV-cache event sockets the routers subscribe to (ROUTER_CONTRACTS.md section 1).
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558


def children(
    engine: Mapping[str, Any], *, tenant_keys: Mapping[str, str], admin_token: str, cache_salt: str,
    service_monitor: bool,
) -> list[Manifest]:
    """Every object the engine needs, in a safe order: keys before the tenants file that names
    them, both before the pods that mount them, and a router's rights before the router.

    `tenant_keys` maps a tenant name to its API key, base64-encoded as found in the data of the
    Secret that its apiKeySecretRef names; tenants missing from it get no key file. `admin_token`
    and `cache_salt` are the engine's admin token and the fleet's salt secret, base64-encoded: the
    reconciler makes each once and then keeps it. Without routing the salt is not rendered.
    """
    routing = routed(engine)
    objects = [
        tenant_keys_secret(engine, tenant_keys),
        admin_token_secret(engine, admin_token),
        *([render_router.cache_salt_secret(engine, cache_salt)] if routing else []),
        config_map(engine, tenant_keys),
        scheduling_config_map(engine, effective_scheduling_policy(engine)),
        service(engine),
        *(render_router.engines_and_access(engine) if routing else []),
        workload(engine),
        pod_disruption_budget(engine),
        *(render_router.router_workload(engine) if routing else []),
    ]
    if service_monitor:
        objects.append(service_monitor_for(engine))
    return objects


def serve_args(engine: Mapping[str, Any]) -> list[str]:
    """The `kvpilot serve` arguments, named as vLLM's flags (the table is in serve_flags.py)."""
    spec = engine["spec"]
    return [
        MODEL_DIR,
        "--host", "0.0.0.0",
        "--port", str(CONTAINER_PORT),
        *spec_args(spec),
        *(render_lws.group_args(spec, "0") if render_lws.spans_pods(spec) else []),
        "--tenants-file", TENANTS_FILE,
        "--admin-token-file", f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
        *_start_policy_file(spec),
        *_routed_engine_args(engine),
        # The adapters themselves are loaded live (adapter_loading.py), never named here.
        *(["--enable-lora"] if adapter_sources.lora_enabled(spec) else []),
        *spec["engine"].get("extraArgs", []),
    ]


def _routed_engine_args(engine: Mapping[str, Any]) -> list[str]:
    # The routers learn what each replica caches from these events, and hash prompts with the
    # same salts as the engines, so that the two sides' block hashes agree.
    if not routed(engine):
        return []
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": "kv-events"}
    return ["--kv-events-config", json.dumps(events, separators=(",", ":")),
            "--cache-salt-secret-file", f"{CACHE_SALT_DIR}/{CACHE_SALT_KEY}"]


def _start_policy_file(spec: Mapping[str, Any]) -> list[str]:
    # Under `auto` the policy tuner keeps this file current, and it overrides --scheduling-policy:
    # a restarting pod starts with the effective policy, while the pod template stays as it is.
    if spec["scheduling"]["policy"] != "auto":
        return []
    return ["--scheduling-policy-file", f"{SCHEDULING_DIR}/{SCHEDULING_POLICY_KEY}"]


def effective_scheduling_policy(engine: Mapping[str, Any]) -> str:
    """The policy the engine's pods run: a pinned one, or under `auto` the one the policy tuner
    recorded in status (`fcfs` until it first decides)."""
    policy = engine["spec"]["scheduling"]["policy"]
    if policy != "auto":
        return policy
    recorded = (engine.get("status") or {}).get("effectiveSchedulingPolicy")
    return recorded if recorded in ("fcfs", "priority") else "fcfs"


def tenants(spec: Mapping[str, Any], tenant_keys: Mapping[str, str]) -> list[dict[str, Any]]:
    """The engine's tenants file: CRD priority (higher = more important) becomes the engine's
    lower-runs-first priority by negation; keys are referenced as files, never inlined."""
    entries = []
    for tenant in spec["scheduling"].get("tenants", []):
        entry: dict[str, Any] = {
            "name": tenant["name"],
            "priority": -tenant["priority"],
            "allowRequestPriority": tenant["allowRequestPriority"],
            "apiKeyFiles": [f"{TENANT_KEYS_DIR}/{tenant['name']}"] if tenant["name"] in tenant_keys else [],
        }
        if "maxConcurrentRequests" in tenant:
            entry["maxConcurrentRequests"] = tenant["maxConcurrentRequests"]
        if tenant.get("adapters"):
            entry["adapters"] = list(tenant["adapters"])
        entries.append(entry)
    return entries


def config_map(engine: Mapping[str, Any], tenant_keys: Mapping[str, str]) -> Manifest:
    name = engine["metadata"]["name"]
    header = (
        f"# Rendered by {naming.FIELD_MANAGER} from InferenceEngine {name}:"
        " edit the InferenceEngine instead.\n"
        "# priority is the engine's own: lower runs first.\n"
    )
    data = {
        # Mounted as a folder (no subPath), so the kubelet refreshes it in running pods.
        "tenants.yaml": header + yaml.safe_dump(tenants(engine["spec"], tenant_keys), sort_keys=False),
        # What the pods run, for people and tools that read the ConfigMap; the Deployment's pod
        # template carries the same arguments, so changing them rolls the pods.
        "engine-args.yaml": yaml.safe_dump(serve_args(engine), sort_keys=False),
    }
    if adapter_sources.lora_enabled(engine["spec"]):
        data[adapter_sources.DOWNLOADS_KEY] = adapter_sources.downloads(engine["spec"])
    return owned(engine, "v1", "ConfigMap", naming.config_map_name(name), data=data)


def tenant_keys_secret(engine: Mapping[str, Any], tenant_keys: Mapping[str, str]) -> Manifest:
    # One Secret the operator owns, mounted whole: adding or removing a tenant changes its data,
    # never the pod template, so tenant changes reach running pods without a restart.
    return owned(engine, "v1", "Secret", naming.tenant_keys_secret_name(engine["metadata"]["name"]),
                  type="Opaque", data=dict(sorted(tenant_keys.items())))


def admin_token_secret(engine: Mapping[str, Any], token: str) -> Manifest:
    # Guards the pods' /admin/scheduling, which the policy tuner calls.
    return owned(engine, "v1", "Secret", naming.admin_token_secret_name(engine["metadata"]["name"]),
                  type="Opaque", data={ADMIN_TOKEN_KEY: token})


def scheduling_config_map(engine: Mapping[str, Any], policy: str) -> Manifest:
    """The policy a starting pod reads (--scheduling-policy-file). Its own object, apart from the
    engine's config, because the policy tuner rewrites it live."""
    return owned(engine, "v1", "ConfigMap", naming.scheduling_config_map_name(engine["metadata"]["name"]),
                  data={SCHEDULING_POLICY_KEY: policy})


def service(engine: Mapping[str, Any]) -> Manifest:
    """What clients call, by the engine's name: the engine pods, or with routing the routers."""
    name = engine["metadata"]["name"]
    settings = engine["spec"]["service"]
    if routed(engine):
        labels, selector = naming.router_labels(name), naming.router_selector_labels(name)
    else:
        labels, selector = naming.labels(name), naming.selector_labels(name)
    return owned(engine, "v1", "Service", name, labels=labels, spec={
        "type": settings["type"],
        "selector": selector,
        "ports": [{"name": "http", "port": settings["port"], "targetPort": "http", "protocol": "TCP"}],
    })


def endpoint(engine: Mapping[str, Any]) -> str:
    meta = engine["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{engine['spec']['service']['port']}"


def workload(engine: Mapping[str, Any]) -> Manifest:
    """What runs the engine's pods: a Deployment, or where one engine spans several pods, a
    LeaderWorkerSet of groups."""
    if render_lws.spans_pods(engine["spec"]):
        return render_lws.leader_worker_set(engine, pod_template(engine), worker_pod_template(engine))
    return deployment(engine)


def deployment(engine: Mapping[str, Any]) -> Manifest:
    meta = engine["metadata"]
    return stamped(engine, owned(engine, "apps/v1", "Deployment", meta["name"], spec={
        "replicas": engine["spec"]["replicas"],
        "selector": {"matchLabels": naming.selector_labels(meta["name"])},
        # A surge pod would need a spare GPU that may not exist and deadlock the rollout:
        # replace one pod at a time instead.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        # Loading, or downloading, large weights can outlast the default 10 minutes.
        "progressDeadlineSeconds": 1800,
        "template": pod_template(engine),
    }))


def pod_template(engine: Mapping[str, Any]) -> Manifest:
    """The pods that serve the API: each one of the Deployment, or each group's leader."""
    spec = engine["spec"]
    source = model_source(engine)
    containers = [_engine_container(engine, source),
                  *([adapter_sources.download_container(engine)] if adapter_sources.lora_enabled(spec) else [])]
    return _pod(engine, naming.labels(engine["metadata"]["name"]), source, containers, _volumes(engine, source))


def worker_pod_template(engine: Mapping[str, Any]) -> Manifest:
    """The other pods of a group: the engine's ranks, with the model and no API to serve, so no
    probe (the leader's readiness waits for them) and none of the API server's files."""
    spec = engine["spec"]
    source = model_source(engine)
    container = {
        "name": "engine",
        "image": spec["image"],
        "command": ["kvpilot", "serve"],
        "args": render_lws.worker_args(spec),
        "env": cache_env(),
        "resources": _resources(spec),
        "securityContext": container_security(),
        "volumeMounts": [*source.mounts, *_scratch_mounts()],
    }
    return _pod(engine, naming.worker_labels(engine["metadata"]["name"]), source, [container],
                [*source.volumes, *_scratch_volumes()])


def _pod(engine: Mapping[str, Any], labels: Mapping[str, str], source: ModelSource, containers: list[Manifest],
         volumes: list[Manifest]) -> Manifest:
    spec = engine["spec"]
    overrides = spec.get("podTemplate", {})
    pod_spec: dict[str, Any] = {
        # Service links inject <SERVICE>_PORT-style variables that can collide with engine settings.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": pod_security(),
        "containers": containers,
        "volumes": volumes,
    }
    if source.init_containers:
        pod_spec["initContainers"] = source.init_containers
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if key in overrides:
            pod_spec[key] = copy.deepcopy(overrides[key])
    metadata: dict[str, Any] = {"labels": dict(labels)}
    if overrides.get("annotations"):
        metadata["annotations"] = dict(overrides["annotations"])
    return {"metadata": metadata, "spec": pod_spec}


def pod_disruption_budget(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    # Over a LeaderWorkerSet, every pod of every group: a group stops whichever of its pods goes.
    selector = (render_lws.group_selector(engine) if render_lws.spans_pods(engine["spec"])
                else naming.selector_labels(name))
    return owned(engine, "policy/v1", "PodDisruptionBudget", name, spec={
        # One pod at a time: with a single replica this still lets a node drain proceed.
        "maxUnavailable": 1,
        "selector": {"matchLabels": selector},
        # A pod that is not serving anyway must not block a drain.
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    })


# Every series of an engine's pods and routers gets `engine` and `component` (engine or router)
# from the pod's labels: the chart's dashboard and alerts select and group by them.
SCRAPE_RELABELINGS = [
    {"sourceLabels": [f"__meta_kubernetes_pod_label_{label.replace('.', '_').replace('/', '_')}"],
     "targetLabel": target}
    for label, target in ((naming.INSTANCE_LABEL, "engine"), (naming.COMPONENT_LABEL, "component"))
]


def service_monitor_for(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    # With routing, the engines' Service and the routers': the control loop reads both.
    selector = naming.instance_labels(name) if routed(engine) else naming.selector_labels(name)
    return owned(engine, "monitoring.coreos.com/v1", "ServiceMonitor", name, spec={
        "selector": {"matchLabels": selector},
        "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s", "relabelings": copy.deepcopy(SCRAPE_RELABELINGS)}],
    })


def _engine_container(engine: Mapping[str, Any], source: ModelSource) -> Manifest:
    spec = engine["spec"]
    ports = [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}]
    if render_lws.spans_pods(spec):
        ports.append({"name": "distributed", "containerPort": render_lws.MASTER_PORT, "protocol": "TCP"})
    if routed(engine):
        ports += [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                  {"name": "kv-replay", "containerPort": KV_REPLAY_PORT, "protocol": "TCP"}]
    mounts = [
        *source.mounts,
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tenant-keys", "mountPath": TENANT_KEYS_DIR, "readOnly": True},
        {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
        {"name": "scheduling", "mountPath": SCHEDULING_DIR, "readOnly": True},
        *_scratch_mounts(),
        *_cache_salt_mounts(engine),
        *adapter_sources.mounts(spec),
    ]
    container = server_container("engine", spec["image"], ["kvpilot", "serve"], serve_args(engine), ports=ports,
                                 resources=_resources(spec), mounts=mounts)
    # Loading weights can take many minutes; liveness only starts judging once it is done.
    container["startupProbe"] = health_probe(period=10, failures=180)
    return container


def _cache_salt_mounts(engine: Mapping[str, Any]) -> list[Manifest]:
    return [render_router.CACHE_SALT_MOUNT] if routed(engine) else []


def _volumes(engine: Mapping[str, Any], source: ModelSource) -> list[Manifest]:
    engine_name = engine["metadata"]["name"]
    return [
        *source.volumes,
        {"name": "config", "configMap": {"name": naming.config_map_name(engine_name)}},
        secret_volume("tenant-keys", naming.tenant_keys_secret_name(engine_name)),
        secret_volume("admin-token", naming.admin_token_secret_name(engine_name)),
        {"name": "scheduling", "configMap": {"name": naming.scheduling_config_map_name(engine_name)}},
        *_scratch_volumes(),
        *([render_router.cache_salt_volume(engine)] if routed(engine) else []),
        *adapter_sources.volumes(engine["spec"]),
    ]


def _scratch_mounts() -> list[Manifest]:
    return [
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        # Tensor-parallel workers exchange tensors through shared memory; a container's
        # default /dev/shm (64 MiB) is far too small.
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]


def _scratch_volumes() -> list[Manifest]:
    return [
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]


def _resources(spec: Mapping[str, Any]) -> Manifest:
    own = spec.get("resources", {})
    resources: Manifest = {
        # One GPU per rank of the pod.
        "limits": {GPU_RESOURCE: render_lws.ranks_per_pod(spec), **copy.deepcopy(own.get("limits", {}))},
    }
    if own.get("requests"):
        resources["requests"] = copy.deepcopy(own["requests"])
    return resources
