"""InferenceEngine -> the objects that run it. Pure: no API calls, no clock, no randomness.

The engine is read as the API server serves it, with the CRD's defaults already applied
(`crds/inferenceengines.kvpilot.dev.yaml` is the one place they are declared).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpilot.operator import naming
from kvpilot.operator.serve_flags import spec_args

Manifest = dict[str, Any]

CONTAINER_PORT = 8000
MODEL_DIR = "/var/lib/kvpilot/model"
CONFIG_DIR = "/etc/kvpilot"
TENANTS_FILE = f"{CONFIG_DIR}/tenants.yaml"
TENANT_KEYS_DIR = "/var/run/kvpilot/tenant-keys"
ADMIN_TOKEN_DIR = "/var/run/kvpilot/admin"
ADMIN_TOKEN_KEY = "token"
SCHEDULING_DIR = "/var/run/kvpilot/scheduling"
SCHEDULING_POLICY_KEY = "policy"
CACHE_DIR = "/var/cache/kvpilot"
_DOWNLOAD_SUBDIR = "model"  # inside CACHE_DIR, for models from the Hugging Face Hub
RUN_AS_ID = 1000  # the runtime image's user (see the Dockerfile)
GPU_RESOURCE = "nvidia.com/gpu"

# preStop sleeps this long so that endpoints drop the pod before SIGTERM starts the drain.
PRESTOP_SLEEP_SECONDS = 5
# Room after --shutdown-timeout for the engine processes to exit before the kubelet's SIGKILL.
EXIT_MARGIN_SECONDS = 10

def children(
    engine: Mapping[str, Any], *, tenant_keys: Mapping[str, str], admin_token: str, service_monitor: bool
) -> list[Manifest]:
    """Every object the engine needs, in a safe order: keys before the tenants file that names
    them, and both before the pods that mount them.

    `tenant_keys` maps a tenant name to its API key, base64-encoded as found in the data of the
    Secret that its apiKeySecretRef names; tenants missing from it get no key file. `admin_token`
    is the engine's admin token, base64-encoded: the reconciler makes it once and then keeps it.
    """
    objects = [
        tenant_keys_secret(engine, tenant_keys),
        admin_token_secret(engine, admin_token),
        config_map(engine, tenant_keys),
        scheduling_config_map(engine, effective_scheduling_policy(engine)),
        service(engine),
        deployment(engine),
        pod_disruption_budget(engine),
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
        "--tenants-file", TENANTS_FILE,
        "--admin-token-file", f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}",
        *_start_policy_file(spec),
        *spec["engine"].get("extraArgs", []),
    ]


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
        entries.append(entry)
    return entries


def config_map(engine: Mapping[str, Any], tenant_keys: Mapping[str, str]) -> Manifest:
    name = engine["metadata"]["name"]
    header = (
        f"# Rendered by {naming.FIELD_MANAGER} from InferenceEngine {name}:"
        " edit the InferenceEngine instead.\n"
        "# priority is the engine's own: lower runs first.\n"
    )
    return _owned(engine, "v1", "ConfigMap", naming.config_map_name(name), data={
            # Mounted as a folder (no subPath), so the kubelet refreshes it in running pods.
            "tenants.yaml": header + yaml.safe_dump(tenants(engine["spec"], tenant_keys), sort_keys=False),
            # What the pods run, for people and tools that read the ConfigMap; the Deployment's pod
            # template carries the same arguments, so changing them rolls the pods.
            "engine-args.yaml": yaml.safe_dump(serve_args(engine), sort_keys=False),
        })


def tenant_keys_secret(engine: Mapping[str, Any], tenant_keys: Mapping[str, str]) -> Manifest:
    # One Secret the operator owns, mounted whole: adding or removing a tenant changes its data,
    # never the pod template, so tenant changes reach running pods without a restart.
    return _owned(engine, "v1", "Secret", naming.tenant_keys_secret_name(engine["metadata"]["name"]),
                  type="Opaque", data=dict(sorted(tenant_keys.items())))


def admin_token_secret(engine: Mapping[str, Any], token: str) -> Manifest:
    # Guards the pods' /admin/scheduling, which the policy tuner calls.
    return _owned(engine, "v1", "Secret", naming.admin_token_secret_name(engine["metadata"]["name"]),
                  type="Opaque", data={ADMIN_TOKEN_KEY: token})


def scheduling_config_map(engine: Mapping[str, Any], policy: str) -> Manifest:
    """The policy a starting pod reads (--scheduling-policy-file). Its own object, apart from the
    engine's config, because the policy tuner rewrites it live."""
    return _owned(engine, "v1", "ConfigMap", naming.scheduling_config_map_name(engine["metadata"]["name"]),
                  data={SCHEDULING_POLICY_KEY: policy})


def service(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    settings = engine["spec"]["service"]
    return _owned(engine, "v1", "Service", name, spec={
        "type": settings["type"],
        "selector": naming.selector_labels(name),
        "ports": [{"name": "http", "port": settings["port"], "targetPort": "http", "protocol": "TCP"}],
    })


def endpoint(engine: Mapping[str, Any]) -> str:
    meta = engine["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{engine['spec']['service']['port']}"


def deployment(engine: Mapping[str, Any]) -> Manifest:
    meta = engine["metadata"]
    manifest = _owned(engine, "apps/v1", "Deployment", meta["name"], spec={
        "replicas": engine["spec"]["replicas"],
        "selector": {"matchLabels": naming.selector_labels(meta["name"])},
        # A surge pod would need a spare GPU that may not exist and deadlock the rollout:
        # replace one pod at a time instead.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
        # Loading, or downloading, large weights can outlast the default 10 minutes.
        "progressDeadlineSeconds": 1800,
        "template": pod_template(engine),
    })
    manifest["metadata"]["annotations"] = {naming.GENERATION_ANNOTATION: str(meta["generation"])}
    return manifest


def pod_template(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    spec = engine["spec"]
    overrides = spec.get("podTemplate", {})
    source = _model_source(engine)
    pod_spec: dict[str, Any] = {
        # Service links inject <SERVICE>_PORT-style variables that can collide with engine settings.
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": (
            PRESTOP_SLEEP_SECONDS + spec["engine"]["shutdownTimeoutSeconds"] + EXIT_MARGIN_SECONDS
        ),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_ID,
            "runAsGroup": RUN_AS_ID,
            "fsGroup": RUN_AS_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(engine, source)],
        "volumes": _volumes(name, source),
    }
    if source.init_containers:
        pod_spec["initContainers"] = source.init_containers
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if key in overrides:
            pod_spec[key] = copy.deepcopy(overrides[key])
    metadata: dict[str, Any] = {"labels": naming.labels(name)}
    if overrides.get("annotations"):
        metadata["annotations"] = dict(overrides["annotations"])
    return {"metadata": metadata, "spec": pod_spec}


def pod_disruption_budget(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    return _owned(engine, "policy/v1", "PodDisruptionBudget", name, spec={
        # One pod at a time: with a single replica this still lets a node drain proceed.
        "maxUnavailable": 1,
        "selector": {"matchLabels": naming.selector_labels(name)},
        # A pod that is not serving anyway must not block a drain.
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    })


def service_monitor_for(engine: Mapping[str, Any]) -> Manifest:
    name = engine["metadata"]["name"]
    return _owned(engine, "monitoring.coreos.com/v1", "ServiceMonitor", name, spec={
        "selector": {"matchLabels": naming.selector_labels(name)},
        "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
    })


def owner_reference(engine: Mapping[str, Any]) -> dict[str, Any]:
    meta = engine["metadata"]
    # blockOwnerDeletion stays unset: where OwnerReferencesPermissionEnforcement is on, setting it
    # would need update rights on inferenceengines/finalizers, and garbage collection works without.
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": True}


def _owned(engine: Mapping[str, Any], api_version: str, kind: str, name: str, **fields: Any) -> Manifest:
    """One of the engine's children: in its namespace, with its labels, controlled by it."""
    meta = engine["metadata"]
    metadata = {
        "name": name,
        "namespace": meta["namespace"],
        "labels": naming.labels(meta["name"]),
        "ownerReferences": [owner_reference(engine)],
    }
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}


@dataclass(frozen=True)
class _ModelSource:
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)
    init_containers: list[Manifest] = field(default_factory=list)


def _model_source(engine: Mapping[str, Any]) -> _ModelSource:
    """Where MODEL_DIR comes from: a read-only volume, or a download into the cache volume."""
    model = engine["spec"]["model"]
    if "pvc" in model:
        pvc = model["pvc"]
        mount: Manifest = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        if pvc.get("subPath"):
            mount["subPath"] = pvc["subPath"]
        return _ModelSource(
            volumes=[{"name": "model",
                      "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}],
            mounts=[mount],
        )
    if "hostPath" in model:
        return _ModelSource(
            volumes=[{"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}}],
            mounts=[{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}],
        )
    # The engine serves a folder; an init container (same image, no GPU) fills it from the Hub,
    # so that the download never counts against the engine's startup probe.
    hub = model["huggingFace"]
    env = _cache_env()
    if "tokenSecretRef" in hub:
        ref = hub["tokenSecretRef"]
        secret_key = {"name": ref["name"], "key": ref["key"]}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret_key}})
    download = {
        "name": "download-model",
        "image": engine["spec"]["image"],
        "command": ["hf", "download", hub["repo"], "--revision", hub["revision"],
                    "--local-dir", f"{CACHE_DIR}/{_DOWNLOAD_SUBDIR}"],
        "env": env,
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    return _ModelSource(
        mounts=[{"name": "cache", "mountPath": MODEL_DIR, "subPath": _DOWNLOAD_SUBDIR, "readOnly": True}],
        init_containers=[download],
    )


def _engine_container(engine: Mapping[str, Any], source: _ModelSource) -> Manifest:
    spec = engine["spec"]
    return {
        "name": "engine",
        "image": spec["image"],
        "command": ["kvpilot", "serve"],
        "args": serve_args(engine),
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "env": _cache_env(),
        "resources": _resources(spec),
        # Loading weights can take many minutes; liveness only starts judging once it is done.
        "startupProbe": _health_probe(period=10, failures=180),
        "readinessProbe": _health_probe(period=5, failures=3),
        "livenessProbe": _health_probe(period=10, failures=6),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": _container_security(),
        "volumeMounts": [
            *source.mounts,
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tenant-keys", "mountPath": TENANT_KEYS_DIR, "readOnly": True},
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            {"name": "scheduling", "mountPath": SCHEDULING_DIR, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
            # Tensor-parallel workers exchange tensors through shared memory; a container's
            # default /dev/shm (64 MiB) is far too small.
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }


def _cache_env() -> list[Manifest]:
    # The root filesystem is read-only: every cache goes to the writable cache volume.
    return [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
    ]


def _container_security() -> Manifest:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _health_probe(*, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _volumes(engine_name: str, source: _ModelSource) -> list[Manifest]:
    return [
        *source.volumes,
        {"name": "config", "configMap": {"name": naming.config_map_name(engine_name)}},
        # 0440 with fsGroup: readable by the engine's group, by nobody else.
        {"name": "tenant-keys", "secret": {"secretName": naming.tenant_keys_secret_name(engine_name),
                                           "defaultMode": 0o440}},
        {"name": "admin-token", "secret": {"secretName": naming.admin_token_secret_name(engine_name),
                                           "defaultMode": 0o440}},
        {"name": "scheduling", "configMap": {"name": naming.scheduling_config_map_name(engine_name)}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]


def _resources(spec: Mapping[str, Any]) -> Manifest:
    own = spec.get("resources", {})
    resources: Manifest = {
        "limits": {GPU_RESOURCE: spec["parallelism"]["tensor"], **copy.deepcopy(own.get("limits", {}))},
    }
    if own.get("requests"):
        resources["requests"] = copy.deepcopy(own["requests"])
    return resources
