"""The CRD refuses a GPU count that its pods could not run with: fewer GPUs than the ranks of a
pod (tensor * pipeline / nodes), a fraction of a GPU, or a GPU request other than the limit. Kubernetes itself accepts
the first two and fails only in the pods; it refuses the last only when the ReplicaSet makes them."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import yaml

from crd_validation import REPO, engine_schema, errors as schema_errors, with_defaults
from kvpilot.operator import render

GPU = render.GPU_RESOURCE
LIMIT_AT = f"spec.resources.limits['{GPU}']"
REQUEST_AT = f"spec.resources.requests['{GPU}']"
UNSET = object()
# Read once: the grid below checks a hundred specs.
SCHEMA = engine_schema()
EXAMPLE = yaml.safe_load((REPO / "examples" / "engine.yaml").read_text())


def errors(obj: dict[str, Any]) -> list[str]:
    return schema_errors(obj, SCHEMA)


def engine(tensor: int, *, limit: Any = UNSET, request: Any = UNSET, pipeline: int = 1,
           nodes: int = 1) -> dict[str, Any]:
    obj = copy.deepcopy(EXAMPLE)
    spec = obj["spec"]
    spec["parallelism"].update(tensor=tensor, pipeline=pipeline, nodes=nodes)
    if limit is not UNSET:
        spec["resources"]["limits"][GPU] = limit
    if request is not UNSET:
        spec["resources"]["requests"][GPU] = request
    obj["metadata"].update(namespace="ml", uid="u", generation=1)
    return with_defaults(obj, SCHEMA)


def test_tensor_parallelism_on_fewer_gpus_is_refused_at_apply() -> None:
    assert errors(engine(4, limit=2)) == [
        f"{LIMIT_AT}: the {GPU} limit is 2, but each pod runs 4 ranks (parallelism.tensor * parallelism.pipeline"
        f" / parallelism.nodes), one per GPU: set at least 4 GPUs, or 0 for an engine on CPUs, or leave it out (it"
        f" is that number then)"
    ]


def test_a_pod_of_a_group_needs_the_gpus_of_its_own_ranks_only() -> None:
    # 8 ranks (tensor 4, pipeline 2) over 2 pods: 4 each.
    assert errors(engine(4, pipeline=2, nodes=2, limit=4)) == []
    (found,) = errors(engine(4, pipeline=2, nodes=2, limit=3))
    assert found.startswith(f"{LIMIT_AT}: the {GPU} limit is 3, but each pod runs 4 ranks"), found
    (found,) = errors(engine(4, pipeline=2, limit=4))
    assert found.startswith(f"{LIMIT_AT}: the {GPU} limit is 4, but each pod runs 8 ranks"), found


@pytest.mark.parametrize("limit", [1, "2", 3])
def test_too_few_gpus_are_refused(limit: Any) -> None:
    (found,) = errors(engine(4, limit=limit))
    assert found.startswith(f"{LIMIT_AT}: the {GPU} limit is {limit}, but each pod runs 4 ranks"), found


@pytest.mark.parametrize("limit", ["1.5", "500m", "8.0", "1k", "2e0", "+4"])
def test_a_fraction_of_a_gpu_or_an_odd_spelling_is_refused(limit: Any) -> None:
    assert errors(engine(1, limit=limit)) == [f"{LIMIT_AT}: the {GPU} limit is {limit}, not a whole number of GPUs"]


@pytest.mark.parametrize(("tensor", "limit"), [(4, 4), (4, "4"), (2, 8), (8, 8), (4, 0), (4, "0"), (1, 1)])
def test_enough_gpus_or_none_are_accepted(tensor: int, limit: Any) -> None:
    assert errors(engine(tensor, limit=limit)) == []


def test_without_a_gpu_limit_the_limit_is_the_ranks_of_a_pod() -> None:
    assert errors(engine(8)) == []
    obj = engine(8)
    obj["spec"].pop("resources")
    assert errors(obj) == []


def test_a_gpu_request_other_than_the_limit_is_refused() -> None:
    assert errors(engine(2, request=1)) == [
        f"{REQUEST_AT}: the {GPU} request is 1, but the limit is 2 (the ranks each pod runs): Kubernetes does not"
        f" overcommit GPUs, so the request must equal the limit; leave the request out"
    ]
    (found,) = errors(engine(2, limit=4, request=2))
    assert found.startswith(f"{REQUEST_AT}: the {GPU} request is 2, but the limit is 4 (resources.limits)"), found
    assert errors(engine(2, request=2)) == errors(engine(2, limit=4, request="4")) == []


def test_every_accepted_spec_renders_a_runnable_gpu_count() -> None:
    """What the CRD accepts is exactly what renders containers whose GPUs fit their ranks."""
    layouts = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (4, 2, 1), (4, 2, 2), (8, 2, 2), (2, 2, 4)]
    for (tensor, pipeline, nodes), limit, request in itertools.product(
            layouts, [UNSET, 0, 1, 2, 4, 8, "4", "1.5"], [UNSET, 1, 2, 4]):
        obj = engine(tensor, limit=limit, request=request, pipeline=pipeline, nodes=nodes)
        accepted = errors(obj) == []
        ranks = tensor * pipeline // nodes
        for containers in _engine_containers(obj):
            resources = containers["resources"]
            rendered_limit = str(resources["limits"][GPU])
            rendered_request = resources.get("requests", {}).get(GPU)
            runnable = (rendered_limit.isdigit() and (int(rendered_limit) == 0 or int(rendered_limit) >= ranks)
                        and (rendered_request is None or str(rendered_request) == rendered_limit))
            assert accepted == runnable, (tensor, pipeline, nodes, limit, request, errors(obj))


def _engine_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine container of each kind of pod the engine runs."""
    spec = render.workload(obj)["spec"]
    if "template" in spec:
        templates = [spec["template"]]
    else:
        group = spec["leaderWorkerTemplate"]
        templates = [group["leaderTemplate"], group["workerTemplate"]]
    return [next(c for c in t["spec"]["containers"] if c["name"] == "engine") for t in templates]


def test_other_resources_are_left_alone() -> None:
    obj = engine(4)
    obj["spec"]["resources"] = {"limits": {"memory": "16Gi", "cpu": "500m"},
                                "requests": {"cpu": "250m", "example.com/fpga": 1}}
    assert errors(obj) == []
