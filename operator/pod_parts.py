"""What the engine pods (render.py) and the router pods (render_router.py) are both made of: the
ownership of a child, where the model folder comes from, the container hardening, the probes
and the paths they share. Pure, like the renderers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator import naming

Manifest = dict[str, Any]

CONTAINER_PORT = 8000
MODEL_DIR = "/var/lib/kvpilot/model"
CONFIG_DIR = "/etc/kvpilot"
TENANTS_FILE = f"{CONFIG_DIR}/tenants.yaml"
TENANT_KEYS_DIR = "/var/run/kvpilot/tenant-keys"
CACHE_SALT_DIR = "/var/run/kvpilot/cache-salt"
CACHE_SALT_KEY = "salt"
CACHE_DIR = "/var/cache/kvpilot"
_DOWNLOAD_SUBDIR = "model"  # inside CACHE_DIR, for models from the Hugging Face Hub
RUN_AS_ID = 1000  # the runtime image's user (see the Dockerfile)

# preStop sleeps this long so that endpoints drop the pod before SIGTERM starts the drain.
PRESTOP_SLEEP_SECONDS = 5
# Room after --shutdown-timeout for the processes to exit before the kubelet's SIGKILL.
EXIT_MARGIN_SECONDS = 10


def owner_reference(engine: Mapping[str, Any]) -> dict[str, Any]:
    meta = engine["metadata"]
    # blockOwnerDeletion stays unset: where OwnerReferencesPermissionEnforcement is on, setting it
    # would need update rights on inferenceengines/finalizers, and garbage collection works without.
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": True}


def owned(engine: Mapping[str, Any], api_version: str, kind: str, name: str, *,
          labels: Mapping[str, str] | None = None, **fields: Any) -> Manifest:
    """One of the engine's children: in its namespace, with its labels (or `labels`), controlled by it."""
    meta = engine["metadata"]
    metadata = {
        "name": name,
        "namespace": meta["namespace"],
        "labels": dict(labels) if labels is not None else naming.labels(meta["name"]),
        "ownerReferences": [owner_reference(engine)],
    }
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}


def stamped(engine: Mapping[str, Any], workload: Manifest) -> Manifest:
    """The workload (Deployment or LeaderWorkerSet) with naming.GENERATION_ANNOTATION set."""
    workload["metadata"]["annotations"] = {naming.GENERATION_ANNOTATION: str(engine["metadata"]["generation"])}
    return workload


@dataclass(frozen=True)
class ModelSource:
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)
    init_containers: list[Manifest] = field(default_factory=list)


def model_source(engine: Mapping[str, Any], *, only: Sequence[str] = ()) -> ModelSource:
    """Where MODEL_DIR comes from: a read-only volume, or a download into the cache volume.
    `only`: the file patterns a download is limited to (all files when empty)."""
    model = engine["spec"]["model"]
    if "pvc" in model:
        pvc = model["pvc"]
        mount: Manifest = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
        if pvc.get("subPath"):
            mount["subPath"] = pvc["subPath"]
        return ModelSource(
            volumes=[{"name": "model",
                      "persistentVolumeClaim": {"claimName": pvc["claimName"], "readOnly": True}}],
            mounts=[mount],
        )
    if "hostPath" in model:
        return ModelSource(
            volumes=[{"name": "model", "hostPath": {"path": model["hostPath"], "type": "Directory"}}],
            mounts=[{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}],
        )
    # The pod serves a folder; an init container (same image, no GPU) fills it from the Hub,
    # so that the download never counts against the startup probe.
    hub = model["huggingFace"]
    env = cache_env()
    if "tokenSecretRef" in hub:
        ref = hub["tokenSecretRef"]
        secret_key = {"name": ref["name"], "key": ref["key"]}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret_key}})
    download = {
        "name": "download-tokenizer" if only else "download-model",
        "image": engine["spec"]["image"],
        "command": ["hf", "download", hub["repo"], "--revision", hub["revision"],
                    *(arg for pattern in only for arg in ("--include", pattern)),
                    "--local-dir", f"{CACHE_DIR}/{_DOWNLOAD_SUBDIR}"],
        "env": env,
        "securityContext": container_security(),
        "volumeMounts": [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    return ModelSource(
        mounts=[{"name": "cache", "mountPath": MODEL_DIR, "subPath": _DOWNLOAD_SUBDIR, "readOnly": True}],
        init_containers=[download],
    )


def server_container(name: str, image: str, command: list[str], args: list[str], *, ports: list[Manifest],
                     resources: Manifest, mounts: list[Manifest]) -> Manifest:
    """A container that serves the OpenAI API on its port `http`: probed on /health, drained on
    the way out, hardened, its caches on the cache volume."""
    return {
        "name": name,
        "image": image,
        "command": command,
        "args": args,
        "ports": ports,
        "env": cache_env(),
        "resources": resources,
        "readinessProbe": health_probe(period=5, failures=3),
        "livenessProbe": health_probe(period=10, failures=6),
        "lifecycle": pre_stop(),
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }


def cache_env() -> list[Manifest]:
    # The root filesystem is read-only: every cache goes to the writable cache volume.
    return [
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
    ]


def pod_security() -> Manifest:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_ID,
        "runAsGroup": RUN_AS_ID,
        "fsGroup": RUN_AS_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Manifest:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def termination_grace_seconds(spec: Mapping[str, Any]) -> int:
    """Long enough for the preStop sleep and the drain of --shutdown-timeout."""
    return PRESTOP_SLEEP_SECONDS + spec["engine"]["shutdownTimeoutSeconds"] + EXIT_MARGIN_SECONDS


def pre_stop() -> Manifest:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}}


def health_probe(*, period: int, failures: int) -> Manifest:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def secret_volume(name: str, secret_name: str) -> Manifest:
    # 0440 with fsGroup: readable by the pod's group, by nobody else.
    return {"name": name, "secret": {"secretName": secret_name, "defaultMode": 0o440}}
