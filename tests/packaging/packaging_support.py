"""What several packaging tests share: the chart's full values file, the Kubernetes version that
manifests must be valid for, the validation of any manifest, and the Dockerfile's build stages."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

import leader_worker_set_schema
import prometheus_operator_schemas
from crd_validation import REPO, errors, with_defaults
from helm_cli import CHART

# Exercises every option in values.yaml (test_packaging_chart checks that each one matters). It
# watches [ml, serving] and creates an engine in the release namespace, which must be one of them.
FULL_VALUES = CHART / "ci" / "full-values.yaml"
FULL_NAMESPACE = "ml"


def oldest_kubernetes() -> str:
    """The oldest Kubernetes minor version the chart declares it supports (Chart.yaml kubeVersion),
    which is the one its manifests are validated against."""
    declared = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+\.\d+)\.0-0", declared)
    assert match, f"kubeVersion {declared!r} is not of the form >=X.Y.0-0"
    return match.group(1)


KUBERNETES_VERSION = oldest_kubernetes()


def validate(manifest: dict[str, Any]) -> None:
    """Fail unless the API server would accept `manifest`: built-in kinds against the Kubernetes
    schemas (strict: unknown fields are errors), InferenceEngines against the CRD's own schema
    and CEL rules, the Prometheus Operator's kinds against its schemas, LeaderWorkerSets against
    theirs."""
    if manifest["apiVersion"].startswith("kvpilot.dev/"):
        assert errors(with_defaults(manifest)) == [], manifest["metadata"]["name"]
    elif manifest["apiVersion"].startswith("leaderworkerset.x-k8s.io/"):
        leader_worker_set_schema.validate(manifest, KUBERNETES_VERSION)
    elif manifest["apiVersion"].startswith("monitoring.coreos.com/"):
        assert prometheus_operator_schemas.errors([manifest]) == [[]], manifest["metadata"]["name"]
    else:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def dockerfile_stage(target: str) -> dict[str, str]:
    """The last value of each instruction (USER, ENTRYPOINT, ...) in one Dockerfile stage."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split(maxsplit=1)
        if not words or words[0].startswith("#"):
            continue
        instruction, rest = words[0].upper(), words[1] if len(words) > 1 else ""
        if instruction == "FROM":
            current = stages.setdefault(rest.split()[-1] if " AS " in rest.upper() else "", {})
        current[instruction] = rest
    return stages[target]


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
