"""The names, labels and annotations that the renderer, the status and the handlers share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceEngine"
PLURAL = "inferenceengines"

# The server-side-apply field manager: the owner of every field the operator renders.
FIELD_MANAGER = "kvpilot-operator"

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF_LABEL = "app.kubernetes.io/part-of"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

# On the workload's own metadata (the Deployment's or LeaderWorkerSet's; never its pod templates,
# which would roll the pods):
# the InferenceEngine generation it was rendered from, so that status can tell a finished
# rollout of the current spec from one of an older spec.
GENERATION_ANNOTATION = f"{GROUP}/generation"


def selector_labels(engine_name: str) -> dict[str, str]:
    """The labels that pick one engine's pods; they never change, as Deployment selectors can't."""
    return {
        NAME_LABEL: "kvpilot",
        INSTANCE_LABEL: engine_name,
        COMPONENT_LABEL: "engine",
    }


def worker_labels(engine_name: str) -> dict[str, str]:
    """The labels of the worker pods of an engine that spans several pods: not the engine pods'
    component, so that every selector of engine pods (Services, the control loop's) finds the
    group leaders alone, which serve the API."""
    return {**labels(engine_name), COMPONENT_LABEL: "engine-worker"}


def router_selector_labels(engine_name: str) -> dict[str, str]:
    """The labels that pick one engine's router pods."""
    return {**selector_labels(engine_name), COMPONENT_LABEL: "router"}


def instance_labels(engine_name: str) -> dict[str, str]:
    """The labels shared by an engine's pods and its routers' (a ServiceMonitor scrapes both)."""
    return {NAME_LABEL: "kvpilot", INSTANCE_LABEL: engine_name}


def labels(engine_name: str) -> dict[str, str]:
    return {**selector_labels(engine_name), PART_OF_LABEL: "kvpilot", MANAGED_BY_LABEL: FIELD_MANAGER}


def router_labels(engine_name: str) -> dict[str, str]:
    return {**labels(engine_name), COMPONENT_LABEL: "router"}


def selector_string(engine_name: str) -> str:
    return _selector(selector_labels(engine_name))


def router_selector_string(engine_name: str) -> str:
    return _selector(router_selector_labels(engine_name))


def _selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def config_map_name(engine_name: str) -> str:
    return f"{engine_name}-config"


def tenant_keys_secret_name(engine_name: str) -> str:
    return f"{engine_name}-tenant-keys"


def admin_token_secret_name(engine_name: str) -> str:
    return f"{engine_name}-admin-token"


def scheduling_config_map_name(engine_name: str) -> str:
    return f"{engine_name}-scheduling"


def cache_salt_secret_name(engine_name: str) -> str:
    return f"{engine_name}-cache-salt"


def leader_worker_set_name(engine_name: str) -> str:
    """Not the engine's own name: LeaderWorkerSet makes a headless Service named after itself, for
    its pods' addresses, and the engine's Service has that name."""
    return f"{engine_name}-lws"


def router_name(engine_name: str) -> str:
    """The router's Deployment, PodDisruptionBudget, ServiceAccount, Role and RoleBinding."""
    return f"{engine_name}-router"


def engines_service_name(engine_name: str) -> str:
    """With routing, the Service of the engine pods themselves, which the routers watch; the
    engine's own name stays with the Service that clients call."""
    return f"{engine_name}-engines"


def owner_name(child: Mapping[str, Any]) -> str | None:
    """The InferenceEngine that controls a child object, if any."""
    for ref in child.get("metadata", {}).get("ownerReferences", []):
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return ref.get("name")
    return None
