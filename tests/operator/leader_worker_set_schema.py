"""What the API server would accept as a LeaderWorkerSet: its CRD's schema (leaderworkerset-crd.yaml,
a trimmed copy of LeaderWorkerSet v0.10.0's, its source noted there) for the object, and
Kubernetes' own schema for its pod templates, which the copy leaves open."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from crd_validation import errors, with_defaults

CRD = yaml.safe_load((Path(__file__).parent / "leaderworkerset-crd.yaml").read_text())
(_VERSION,) = CRD["spec"]["versions"]
SCHEMA = _VERSION["schema"]["openAPIV3Schema"]


def validate(lws: dict[str, Any], kubernetes_version: str = "1.30") -> None:
    """Fail, saying why, unless the API server would accept `lws`."""
    assert errors(with_defaults(lws, SCHEMA), SCHEMA) == [], lws["metadata"]["name"]
    group = lws["spec"]["leaderWorkerTemplate"]
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": lws["metadata"]["name"],
                                                   "namespace": lws["metadata"]["namespace"]},
                                      "template": template}, kubernetes_version, strict=True)
