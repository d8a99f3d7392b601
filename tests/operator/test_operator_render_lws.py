"""Rendering an engine over several pods (spec.parallelism.nodes above 1): a LeaderWorkerSet whose
leader and worker pods run what the engine's own CLI accepts, checked against LeaderWorkerSet's
CRD (tests/operator/leaderworkerset-crd.yaml) and Kubernetes' pod schema."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import leader_worker_set_schema
from crd_validation import REPO, errors, with_defaults
from inference_engines import ADMIN_TOKEN, CACHE_SALT, FULL_SPEC, TENANT_KEYS, engine
from kvpilot.operator import naming, render, render_lws
from test_operator_engine_contract import parsed_serve_args
# What LeaderWorkerSet sets in the pods of group 1 of LeaderWorkerSet llama-lws in namespace ml
# (a leader address is <set>-<group>.<subdomain>.<namespace>).
LEADER_ADDRESS = "llama-lws-1.llama-lws.ml"


def over_pods(nodes: int = 2, **parallelism: int) -> dict[str, Any]:
    spec = {**FULL_SPEC, "parallelism": {"tensor": 2, **parallelism, "nodes": nodes}}
    return engine(spec)


def rendered(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The children by kind (the first of each)."""
    found: dict[str, dict[str, Any]] = {}
    for child in render.children(obj, tenant_keys=TENANT_KEYS, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT,
                                 service_monitor=False):
        found.setdefault(child["kind"], child)
    return found


def templates(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    group = rendered(obj)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return group["leaderTemplate"], group["workerTemplate"]


def engine_container(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == "engine")


def as_the_kubelet_expands(args: list[str], worker_index: int) -> list[str]:
    """$(NAME) in container arguments, from the variables LeaderWorkerSet sets in each pod."""
    env = {render_lws.LEADER_ADDRESS_ENV: LEADER_ADDRESS, render_lws.WORKER_INDEX_ENV: str(worker_index),
           "LWS_GROUP_SIZE": "2"}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def parsed(monkeypatch: pytest.MonkeyPatch, template: dict[str, Any], worker_index: int) -> argparse.Namespace:
    container = engine_container(template)
    assert container["command"] == ["kvpilot", "serve"]
    return parsed_serve_args(monkeypatch, as_the_kubelet_expands(container["args"], worker_index))


def test_an_engine_over_several_pods_renders_a_leader_worker_set_instead_of_the_deployment() -> None:
    one_pod, two_pods = rendered(engine()), rendered(over_pods())
    assert "LeaderWorkerSet" not in one_pod and "Deployment" not in two_pods
    lws = two_pods["LeaderWorkerSet"]
    assert (lws["apiVersion"], lws["metadata"]["name"]) == ("leaderworkerset.x-k8s.io/v1", "llama-lws")
    assert lws["metadata"]["annotations"] == {naming.GENERATION_ANNOTATION: "3"}
    assert lws["spec"]["replicas"] == FULL_SPEC["replicas"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (group["size"], group["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert set(one_pod) - {"Deployment"} == set(two_pods) - {"LeaderWorkerSet"}
    assert (one_pod["Service"], one_pod["Secret"]) == (two_pods["Service"], two_pods["Secret"])


def test_the_leader_worker_set_is_valid_against_its_crd_and_its_pods_against_kubernetes() -> None:
    for obj in (over_pods(), over_pods(4, pipeline=2), engine({"model": {"name": "m", "hostPath": "/models/m"},
                                                               "image": "i", "parallelism": {"nodes": 2,
                                                                                             "pipeline": 2}})):
        leader_worker_set_schema.validate(rendered(obj)["LeaderWorkerSet"])


def test_the_leader_runs_node_0_with_the_api_server(monkeypatch: pytest.MonkeyPatch) -> None:
    leader, _ = templates(over_pods())
    args = parsed(monkeypatch, leader, worker_index=0)
    assert (args.nnodes, args.node_rank, args.headless) == (2, 0, False)
    assert (args.master_addr, args.master_port) == (LEADER_ADDRESS, render_lws.MASTER_PORT)
    assert (args.host, args.port, args.tensor_parallel_size) == ("0.0.0.0", 8000, 2)
    assert args.tenants_file == Path("/etc/kvpilot/tenants.yaml")
    assert {"name": "distributed", "containerPort": render_lws.MASTER_PORT, "protocol": "TCP"} in \
        engine_container(leader)["ports"]


def test_each_worker_runs_its_own_node_rank_headless(monkeypatch: pytest.MonkeyPatch) -> None:
    _, worker = templates(over_pods(4, pipeline=2))
    leader_args = parsed(monkeypatch, templates(over_pods(4, pipeline=2))[0], worker_index=0)
    for index in (1, 2, 3):
        args = parsed(monkeypatch, worker, worker_index=index)
        assert (args.nnodes, args.node_rank, args.headless) == (4, index, True)
        assert (args.master_addr, args.master_port) == (LEADER_ADDRESS, render_lws.MASTER_PORT)
        # The same engine as the leader's: every flag that shapes it agrees.
        for setting in ("model_dir", "tensor_parallel_size", "pipeline_parallel_size", "max_num_seqs",
                        "max_num_batched_tokens", "max_model_len", "block_size", "gpu_memory_utilization",
                        "attention_backend", "enable_prefix_caching", "seed"):
            assert getattr(args, setting) == getattr(leader_args, setting), setting
        assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (2, 2)
        # None of the API server's files, which its pod does not mount.
        assert (args.tenants_file, args.admin_token_file) == (None, None)


def test_worker_pods_serve_no_api_and_hold_their_own_ranks_gpus() -> None:
    leader, worker = templates(over_pods(4, pipeline=2, tensor=4))  # 8 ranks over 4 pods
    container = engine_container(worker)
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe"} & set(container)
    assert engine_container(leader)["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"][render.GPU_RESOURCE] == 2
    assert engine_container(leader)["resources"]["limits"][render.GPU_RESOURCE] == 2
    mounted = {mount["name"] for mount in container["volumeMounts"]}
    assert mounted == {"model", "cache", "tmp", "dshm"}
    assert {volume["name"] for volume in worker["spec"]["volumes"]} == mounted


def test_only_the_leaders_are_engine_pods_to_services_and_the_control_loop() -> None:
    leader, worker = templates(over_pods())
    selector = rendered(over_pods())["Service"]["spec"]["selector"]
    assert selector == naming.selector_labels("llama")
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()


def test_the_disruption_budget_covers_every_pod_of_every_group() -> None:
    budget = rendered(over_pods())["PodDisruptionBudget"]
    assert budget["spec"]["selector"] == {"matchLabels": {"leaderworkerset.sigs.k8s.io/name": "llama-lws"}}
    assert budget["spec"]["maxUnavailable"] == 1


def test_the_workers_download_the_model_as_the_leader_does() -> None:
    hub = engine({"model": {"name": "m", "huggingFace": {"repo": "org/m"}}, "image": "i",
                  "parallelism": {"tensor": 2, "nodes": 2}})
    leader, worker = templates(hub)
    assert worker["spec"]["initContainers"] == leader["spec"]["initContainers"]


def test_one_pod_renders_no_flag_of_several() -> None:
    args = render.serve_args(engine())
    assert not {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless",
                "--pipeline-parallel-size"} & set(args)
    assert "--pipeline-parallel-size" in render.serve_args(engine({**FULL_SPEC, "parallelism": {"pipeline": 2}}))


def test_the_multinode_example_runs_one_engine_over_two_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    example = yaml.safe_load((REPO / "examples" / "engine-multinode.yaml").read_text())
    example["metadata"].update(namespace="ml", uid="u", generation=1)
    obj = with_defaults(example)
    assert errors(obj) == []
    leader_worker_set_schema.validate(rendered(obj)["LeaderWorkerSet"])
    leader, worker = templates(obj)
    assert engine_container(leader)["resources"]["limits"][render.GPU_RESOURCE] == 4
    for template, index in ((leader, 0), (worker, 1)):
        args = parsed(monkeypatch, template, worker_index=index)
        assert (args.nnodes, args.node_rank, args.tensor_parallel_size, args.pipeline_parallel_size,
                args.distributed_timeout) == (2, index, 4, 2, 120)
