"""An engine that spans several pods (spec.parallelism.nodes above 1) -> its LeaderWorkerSet. Pure.

Each replica is one LeaderWorkerSet group of `nodes` pods. The leader (worker index 0) runs
`kvpilot serve` as node 0: the API server, the EngineCore and its share of the ranks. Every other
pod runs `kvpilot serve --headless` as node <its worker index>: its ranks only, which join the
leader over TCP at LWS_LEADER_ADDRESS. LeaderWorkerSet sets that variable, and LWS_WORKER_INDEX,
in every container of its pods, and the kubelet expands `$(NAME)` in the arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.operator import naming
from kvpilot.operator.pod_parts import MODEL_DIR, Manifest, owned, stamped
from kvpilot.operator.serve_flags import spec_args

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
# The release this rendering is checked against (its CRD's schema, in tests/operator). status.py
# reads status.observedGeneration, which LeaderWorkerSet reports from v0.9.0 on.
TESTED_VERSION = "v0.10.0"
OLDEST_VERSION = "v0.9.0"
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
# On every pod of a LeaderWorkerSet: its name, and the pod's index in its group (0 for the leader).
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# Where the other pods of a group join the leader: torch.distributed's usual port.
MASTER_PORT = 29500
# A rank that is lost stops the whole engine: the group starts again as one.
RESTART_POLICY = "RecreateGroupOnPodRestart"


def spans_pods(spec: Mapping[str, Any]) -> bool:
    return spec["parallelism"]["nodes"] > 1


def ranks_per_pod(spec: Mapping[str, Any]) -> int:
    """The ranks, and so the GPUs, of each pod (the CRD refuses a nodes that does not divide them)."""
    parallelism = spec["parallelism"]
    return parallelism["tensor"] * parallelism["pipeline"] // parallelism["nodes"]


def workload(engine: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of what runs the engine's pods: a Deployment, or a LeaderWorkerSet."""
    name = engine["metadata"]["name"]
    if spans_pods(engine["spec"]):
        return API_VERSION, KIND, naming.leader_worker_set_name(name)
    return "apps/v1", "Deployment", name


def retired_workload(engine: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of the other kind, left over where parallelism.nodes changed."""
    name = engine["metadata"]["name"]
    if spans_pods(engine["spec"]):
        return "apps/v1", "Deployment", name
    return API_VERSION, KIND, naming.leader_worker_set_name(name)


def missing_message(engine: Mapping[str, Any]) -> str:
    nodes = engine["spec"]["parallelism"]["nodes"]
    # The operator watches only the kinds served when it starts (kopf's scanning is off), and
    # status follows a LeaderWorkerSet through that watch: hence the restart.
    return (f"parallelism.nodes {nodes} runs each replica as a LeaderWorkerSet ({API_VERSION}), which this cluster"
            f" does not serve: install LeaderWorkerSet {OLDEST_VERSION} or later (tested with {TESTED_VERSION}),"
            " then restart the operator. Nothing of this spec is applied until then.")


def group_args(spec: Mapping[str, Any], node_rank: str) -> list[str]:
    return ["--nnodes", str(spec["parallelism"]["nodes"]), "--node-rank", node_rank,
            "--master-addr", f"$({LEADER_ADDRESS_ENV})", "--master-port", str(MASTER_PORT)]


def worker_args(spec: Mapping[str, Any]) -> list[str]:
    """A worker pod's `kvpilot serve` arguments: the engine's own flags, as the leader's (the ranks
    must build the same engine), without what only the API server reads (its address, tenants,
    tokens, policy file), and its node rank from LeaderWorkerSet."""
    return [MODEL_DIR, *spec_args(spec), *spec["engine"].get("extraArgs", []),
            "--headless", *group_args(spec, f"$({WORKER_INDEX_ENV})")]


def leader_worker_set(engine: Mapping[str, Any], leader: Manifest, worker: Manifest) -> Manifest:
    """The engine's LeaderWorkerSet, from the pod templates of its leaders and its workers."""
    spec = engine["spec"]
    name = naming.leader_worker_set_name(engine["metadata"]["name"])
    return stamped(engine, owned(engine, API_VERSION, KIND, name, spec={
        "replicas": spec["replicas"],
        "leaderWorkerTemplate": {
            "size": spec["parallelism"]["nodes"],
            "restartPolicy": RESTART_POLICY,
            "leaderTemplate": leader,
            "workerTemplate": worker,
        },
        # As the Deployment's: a surge group would need a spare set of GPUs that may not exist.
        "rolloutStrategy": {"type": "RollingUpdate",
                            "rollingUpdateConfiguration": {"maxSurge": 0, "maxUnavailable": 1}},
        # The workers start with the leader, not once it is ready: it is ready only once they joined.
        "startupPolicy": "LeaderCreated",
        # One headless Service, named after the LeaderWorkerSet, gives LWS_LEADER_ADDRESS its DNS name.
        "networkConfig": {"subdomainPolicy": "Shared"},
    }))


def group_selector(engine: Mapping[str, Any]) -> dict[str, str]:
    """Every pod of every group, leaders and workers alike."""
    return {SET_NAME_LABEL: naming.leader_worker_set_name(engine["metadata"]["name"])}
