"""The one table from an InferenceEngine's spec to the `kvpilot serve` flags its pods run with.

Each spec field that becomes a flag is listed once, in `SPEC_FLAGS`, in the order the flags are
rendered. Where the CRD's name is not the flag's name in camelCase, the entry says why.
`RESERVED_FLAGS` are the flags the operator sets from its own pod layout (or keeps out of pod
arguments). The CRD's extraArgs rule refuses both kinds. Tests check this table against the CRD
schema, against `kvpilot serve`'s own flags, and against that extraArgs rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def initial_scheduling_policy(policy: str) -> str:
    # `auto` starts calm, unless the policy tuner's file (--scheduling-policy-file, which overrides
    # this flag) says otherwise.
    return "fcfs" if policy == "auto" else policy


@dataclass(frozen=True)
class SpecFlag:
    path: tuple[str, ...]  # under spec
    flag: str
    # Why the field is not named after the flag; empty where it is.
    renamed_because: str = ""
    # The flag's value from the field's; a bool field renders as --flag / --no-flag instead.
    convert: Callable[[Any], str] = str
    # A value rendered as no flag at all (the engine's default), so that a field added after
    # engines existed leaves their pod templates, and so their pods, as they were.
    left_out_at: Any = None

    def args(self, spec: Mapping[str, Any]) -> list[str]:
        value: Any = spec
        for key in self.path:
            if key not in value:
                return []  # unset: the engine's own default applies
            value = value[key]
        if self.left_out_at is not None and value == self.left_out_at:
            return []
        if isinstance(value, bool):
            return [self.flag if value else "--no-" + self.flag.removeprefix("--")]
        return [self.flag, self.convert(value)]


SPEC_FLAGS: tuple[SpecFlag, ...] = (
    SpecFlag(("model", "name"), "--served-model-name",
             "the model block names the model once; vLLM calls that name the served model name"),
    SpecFlag(("parallelism", "tensor"), "--tensor-parallel-size",
             "parallelism groups the ways a replica splits the model (tensor, pipeline, over nodes pods)"),
    SpecFlag(("parallelism", "pipeline"), "--pipeline-parallel-size",
             "parallelism groups the ways a replica splits the model (tensor, pipeline, over nodes pods)",
             left_out_at=1),
    SpecFlag(("engine", "maxNumSeqs"), "--max-num-seqs"),
    SpecFlag(("engine", "maxNumBatchedTokens"), "--max-num-batched-tokens"),
    SpecFlag(("engine", "maxModelLen"), "--max-model-len"),
    SpecFlag(("engine", "gpuMemoryUtilization"), "--gpu-memory-utilization"),
    SpecFlag(("engine", "attentionBackend"), "--attention-backend"),
    SpecFlag(("engine", "quantization"), "--quantization"),
    SpecFlag(("engine", "blockSize"), "--block-size"),
    SpecFlag(("engine", "enablePrefixCaching"), "--enable-prefix-caching"),
    SpecFlag(("scheduling", "policy"), "--scheduling-policy",
             "scheduling groups the policy with the tenants it orders; `auto` starts engines at fcfs",
             convert=initial_scheduling_policy),
    SpecFlag(("engine", "maxLoras"), "--max-loras"),
    SpecFlag(("engine", "maxLoraRank"), "--max-lora-rank"),
    SpecFlag(("engine", "maxCpuLoras"), "--max-cpu-loras"),
    SpecFlag(("engine", "shutdownTimeoutSeconds"), "--shutdown-timeout",
             "Kubernetes API conventions put a duration's unit in the field name"),
)

# Flag -> why no spec field (or extraArgs entry) sets it.
RESERVED_FLAGS: dict[str, str] = {
    "--host": "the pod listens on all addresses",
    "--port": "the container port, which the Service and the probes use",
    "--tenants-file": "rendered from scheduling.tenants into the ConfigMap",
    "--admin-token-file": "the operator's own token, for the policy tuner",
    "--scheduling-policy-file": "under `auto`, the policy tuner's ConfigMap, which a starting pod reads its policy from",
    "--api-key": "a key in the pod's arguments would be readable by anyone who can read the Deployment; "
                 "use scheduling.tenants with apiKeySecretRef",
    "--model": "vLLM's spelling of the model argument; the operator passes the mounted model folder itself",
    "--kv-events-config": "with routing, the operator's own publisher and replay sockets, which the routers subscribe to",
    "--cache-salt-secret-file": "with routing, the operator's salt Secret, which engines and routers must share",
    "--enable-lora": "on while spec.adapters is set",
    # parallelism.nodes above 1: from the LeaderWorkerSet's pod layout (render_lws.py).
    "--nnodes": "parallelism.nodes, on every pod of a replica",
    "--node-rank": "each pod's index in its LeaderWorkerSet group",
    "--master-addr": "the group's leader pod, as LeaderWorkerSet names it",
    "--master-port": "the leader's port for the other pods of its group",
    "--headless": "on every pod of a group but the leader",
    "--lora-modules": "the operator loads spec.adapters into running pods through the admin routes, so that "
                      "adapter changes never restart a pod",
}


def spec_args(spec: Mapping[str, Any]) -> list[str]:
    """The flags SPEC_FLAGS renders from `spec`, in table order."""
    return [arg for spec_flag in SPEC_FLAGS for arg in spec_flag.args(spec)]
