"""InferenceEngine objects for the operator tests, as the API server would serve them (defaulted)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import yaml

from crd_validation import REPO, errors, with_defaults

# A spec that sets nearly every field, for the golden rendering checks.
FULL_SPEC: dict[str, Any] = {
    "model": {"name": "llama-3-8b", "pvc": {"claimName": "models", "subPath": "llama-3-8b"}},
    "image": "ghcr.io/kvpilot/kvpilot:0.1.0",
    "replicas": 2,
    "resources": {"requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"memory": "64Gi"}},
    "podTemplate": {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llama"}}},
        }]}},
        "priorityClassName": "inference",
        "annotations": {"team": "ml"},
    },
    "parallelism": {"tensor": 2},
    "engine": {
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 8192,
        "maxModelLen": 8192,
        "enablePrefixCaching": False,
        "gpuMemoryUtilization": 0.85,
        "attentionBackend": "triton",
        "extraArgs": ["--seed", "7"],
    },
    "scheduling": {
        "policy": "priority",
        "tenants": [
            {"name": "prod", "priority": 100, "apiKeySecretRef": {"name": "prod-key"}, "maxConcurrentRequests": 32},
            {"name": "batch", "priority": -10, "allowRequestPriority": True,
             "apiKeySecretRef": {"name": "batch-key", "key": "token"}},
        ],
    },
    "service": {"port": 80},
    # The golden files are the engine without a router, as rendered before routing existed;
    # test_operator_render_router.py renders this spec with routing on.
    "routing": {"enabled": False},
}

PROD_KEY = "sk-prod-0123456789"
BATCH_KEY = "sk-batch-9876543210"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


TENANT_KEYS = {"prod": b64(PROD_KEY), "batch": b64(BATCH_KEY)}
ADMIN_TOKEN = b64("admin-token-0123456789")
CACHE_SALT = b64("cache-salt-0123456789")


def engine(spec: dict[str, Any] | None = None, *, name: str = "llama", namespace: str = "ml",
           generation: int = 3) -> dict[str, Any]:
    """A defaulted engine that the CRD accepts, with the metadata an API server would add."""
    obj = with_defaults({
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceEngine",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": generation},
        "spec": copy.deepcopy(spec if spec is not None else FULL_SPEC),
    })
    assert errors(obj) == []
    return obj


def example() -> dict[str, Any]:
    obj = yaml.safe_load((REPO / "examples" / "engine.yaml").read_text())
    obj["metadata"].update(namespace="default", uid="uid-example", generation=1)
    obj = with_defaults(obj)
    assert errors(obj) == []
    return obj
