"""The CRD file: a structural schema that accepts the example and rejects bad specs with a clear message."""

from __future__ import annotations

import copy
import re
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml

from crd_validation import REPO, engine_schema, errors, load_crd, schema_nodes, with_defaults
from kvpilot.operator import render

EXAMPLE = REPO / "examples" / "engine.yaml"


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def test_crd_is_a_valid_custom_resource_definition() -> None:
    kubernetes_validate.validate(load_crd(), "1.30", strict=True)


def test_crd_names_and_scope() -> None:
    spec = load_crd()["spec"]
    assert spec["group"] == "kvpilot.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceEngine"
    assert spec["names"]["plural"] == "inferenceengines"
    assert spec["names"]["shortNames"] == ["ie"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_every_schema_node_has_a_type() -> None:
    schema = engine_schema()
    assert schema["type"] == "object"
    untyped = [
        path for path, node in schema_nodes(schema)
        if "type" not in node and not node.get("x-kubernetes-int-or-string")
    ]
    assert untyped == []


def test_int_or_string_nodes_are_structural() -> None:
    nodes = [node for _, node in schema_nodes(engine_schema()) if node.get("x-kubernetes-int-or-string")]
    assert nodes, "the resources quantities are int-or-string"
    for node in nodes:
        assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}]


def test_schema_carries_every_design_field() -> None:
    spec = engine_schema()["properties"]["spec"]["properties"]
    assert set(spec) >= {
        "model", "image", "replicas", "resources", "podTemplate", "parallelism", "engine",
        "scheduling", "autoscaling", "service", "routing", "adapters",
    }
    assert set(spec["model"]["properties"]) == {"name", "pvc", "hostPath", "huggingFace"}
    assert set(spec["model"]["properties"]["pvc"]["properties"]) == {"claimName", "subPath"}
    assert set(spec["model"]["properties"]["huggingFace"]["properties"]) == {"repo", "revision", "tokenSecretRef"}
    assert set(spec["podTemplate"]["properties"]) == {
        "nodeSelector", "tolerations", "affinity", "priorityClassName", "annotations",
    }
    assert set(spec["engine"]["properties"]) >= {
        "maxNumSeqs", "maxNumBatchedTokens", "maxModelLen", "blockSize", "enablePrefixCaching",
        "gpuMemoryUtilization", "attentionBackend", "extraArgs",
    }
    assert spec["scheduling"]["properties"]["policy"]["enum"] == ["fcfs", "priority", "auto"]
    assert set(spec["scheduling"]["properties"]["tenants"]["items"]["properties"]) >= {
        "name", "priority", "apiKeySecretRef", "maxConcurrentRequests",
    }
    assert set(spec["autoscaling"]["properties"]) == {
        "enabled", "minReplicas", "maxReplicas", "targetKVCacheUsage", "targetQueueDepth", "prometheus",
        "intervalSeconds", "scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds", "scaleToZeroAfterSeconds",
        "backlogDrainSeconds", "targets",
    }
    assert set(spec["autoscaling"]["properties"]["targets"]["properties"]) == {"ttftSeconds", "itlSeconds"}
    assert set(spec["service"]["properties"]) == {"type", "port"}
    assert set(spec["routing"]["properties"]) == {
        "enabled", "replicas", "resources", "strategy", "boundedLoadFactor", "holdTimeoutSeconds",
    }
    assert spec["routing"]["properties"]["strategy"]["enum"] == ["prefix-aware", "least-loaded", "round-robin"]

    status = engine_schema()["properties"]["status"]["properties"]
    assert set(status) == {
        "phase", "observedGeneration", "replicas", "readyReplicas", "desiredReplicas", "selector",
        "endpoint", "effectiveSchedulingPolicy", "metrics", "lastScaleTime", "controlMemory", "conditions", "adapters",
    }
    assert set(status["metrics"]["properties"]) == {"kvCacheUsage", "queueDepth", "observedAt"}
    assert status["phase"]["enum"] == ["Pending", "Progressing", "Ready", "Degraded", "Failed"]
    condition = status["conditions"]["items"]
    assert set(condition["properties"]) == {
        "type", "status", "observedGeneration", "reason", "message", "lastTransitionTime",
    }


def test_design_defaults() -> None:
    spec = with_defaults({"spec": {}})["spec"]
    assert spec["replicas"] == 1
    assert spec["parallelism"] == {"tensor": 1, "pipeline": 1, "nodes": 1}
    assert spec["scheduling"] == {"policy": "auto", "calmWindowSeconds": 300}
    assert spec["service"] == {"type": "ClusterIP", "port": 8000}
    assert spec["autoscaling"] == {
        "enabled": False, "minReplicas": 1, "targetKVCacheUsage": 0.8, "targetQueueDepth": 5,
        "intervalSeconds": 15, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300,
        "scaleToZeroAfterSeconds": 300, "backlogDrainSeconds": 60,
    }
    assert spec["routing"] == {
        "enabled": True, "replicas": 2, "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "strategy": "prefix-aware", "boundedLoadFactor": 1.25, "holdTimeoutSeconds": 60,
    }
    assert spec["engine"] == {"blockSize": 16, "enablePrefixCaching": True, "shutdownTimeoutSeconds": 30}


def test_every_default_is_valid_for_its_own_node() -> None:
    for path, node in schema_nodes(engine_schema()):
        if "default" in node:
            defaulted = with_defaults(node["default"], node)
            assert errors(defaulted, node) == [], path


def test_subresources_and_printer_columns() -> None:
    (version,) = load_crd()["spec"]["versions"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0}
    assert list(columns) == ["Model", "TP", "Ready", "Router", "Desired", "Policy", "KV%", "Age"]
    assert columns == {
        "Model": ".spec.model.name",
        "TP": ".spec.parallelism.tensor",
        "Ready": ".status.readyReplicas",
        "Router": '.status.conditions[?(@.type=="RouterReady")].status',
        "Desired": ".status.desiredReplicas",
        "Policy": ".status.effectiveSchedulingPolicy",
        "KV%": ".status.metrics.kvCacheUsage",
        "Age": ".metadata.creationTimestamp",
    }


def test_every_cel_rule_compiles() -> None:
    rules = [rule["rule"] for _, node in [("", engine_schema()), *schema_nodes(engine_schema())]
             for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 7
    environment = celpy.Environment()
    for rule in rules:
        environment.compile(rule)


def test_example_is_accepted() -> None:
    assert errors(with_defaults(example())) == []


def test_example_sets_a_complete_engine() -> None:
    spec = example()["spec"]
    assert {"model", "image", "replicas", "parallelism", "resources", "engine", "scheduling", "service"} <= set(spec)
    assert "# " in EXAMPLE.read_text(), "the example explains itself"


def _invalid(change: str) -> dict[str, Any]:
    engine = copy.deepcopy(example())
    spec = engine["spec"]
    if change == "two sources":
        spec["model"]["pvc"] = {"claimName": "models"}
    elif change == "min > max":
        spec["autoscaling"] = {"minReplicas": 3, "maxReplicas": 2}
    elif change == "TP 3":
        spec["parallelism"]["tensor"] = 3
    elif change == "duplicate tenant":
        spec["scheduling"]["tenants"] = [{"name": "team-a"}, {"name": "team-a", "priority": 5}]
    elif change == "negative port":
        spec["service"]["port"] = -1
    return engine


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("two sources", r"spec\.model: exactly one model source must be set"),
        ("min > max", r"spec\.autoscaling: autoscaling\.minReplicas must not exceed autoscaling\.maxReplicas"),
        ("TP 3", r"spec\.parallelism\.tensor: parallelism\.tensor must be 1, 2, 4 or 8"),
        ("duplicate tenant", r"spec\.scheduling\.tenants: tenant names must be unique"),
        ("negative port", r"spec\.service\.port: -1 is less than the minimum of 1"),
    ],
)
def test_invalid_specs_are_rejected_with_a_clear_message(change: str, expected: str) -> None:
    found = errors(with_defaults(_invalid(change)))
    assert len(found) == 1, found
    assert re.fullmatch(expected + ".*", found[0]), found


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"model": {"name": "m"}}, "exactly one model source must be set"),
        ({"autoscaling": {"enabled": True}}, "autoscaling.maxReplicas is required"),
        ({"engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 32}}, "maxNumBatchedTokens must be at least"),
        ({"engine": {"extraArgs": ["--port=9000"]}}, "extraArgs must not repeat a flag"),
        ({"engine": {"extraArgs": ["--no-enable-prefix-caching"]}}, "extraArgs must not repeat a flag"),
        ({"engine": {"blockSize": 12}}, "12 is not one of"),
        ({"scheduling": {"policy": "random"}}, "'random' is not one of"),
        ({"model": {"name": "m", "hostPath": "relative/dir"}}, "does not match"),
        ({"replicas": 1, "unknownField": True}, "unknown field"),
        ({"replicas": -1}, "-1 is less than the minimum of 0"),
        ({"model": {"name": "", "pvc": {"claimName": "models"}}}, "should be non-empty"),
        ({"image": ""}, "should be non-empty"),
        ({"autoscaling": {"minReplicas": 0}, "routing": {"enabled": False}},
         "autoscaling.minReplicas 0 needs routing.enabled"),
        ({"autoscaling": {"minReplicas": -1}}, "-1 is less than the minimum of 0"),
        ({"routing": {"replicas": 1}}, "1 is less than the minimum of 2"),
        ({"routing": {"strategy": "random"}}, "'random' is not one of"),
        ({"routing": {"boundedLoadFactor": 0.5}}, "0.5 is less than the minimum of 1"),
        ({"autoscaling": {"targetKVCacheUsage": 0}}, "less than or equal to the minimum of 0"),
        ({"autoscaling": {"targets": {}}}, "autoscaling.targets names no target: set ttftSeconds, itlSeconds or both"),
        ({"autoscaling": {"targets": {"ttftSeconds": 0}}}, "less than or equal to the minimum of 0"),
        ({"autoscaling": {"targets": {"ttftSeconds": 90}}},
         "autoscaling.targets.ttftSeconds must be below autoscaling.backlogDrainSeconds"),
        ({"autoscaling": {"backlogDrainSeconds": 0}}, "0 is less than the minimum of 1"),
        ({"parallelism": {"tensor": 2, "nodes": 4}},
         "parallelism.nodes 4 does not divide the 2 ranks of parallelism.tensor * parallelism.pipeline"),
        ({"parallelism": {"tensor": 4, "pipeline": 3, "nodes": 8}}, "parallelism.nodes 8 does not divide the 12 ranks"),
        ({"parallelism": {"pipeline": 0}}, "0 is less than the minimum of 1"),
        ({"parallelism": {"nodes": 0}}, "0 is less than the minimum of 1"),
        ({"parallelism": {"nodes": 33}}, "33 is greater than the maximum of 32"),
        ({"parallelism": {"tensor": 2, "nodes": 2}, "adapters": []}, "spec.adapters needs parallelism.nodes 1"),
        ({"engine": {"extraArgs": ["--nnodes", "2"]}}, "extraArgs must not repeat a flag"),
        ({"engine": {"extraArgs": ["--headless"]}}, "extraArgs must not repeat a flag"),
        ({"engine": {"extraArgs": ["--pipeline-parallel-size=2"]}}, "extraArgs must not repeat a flag"),
    ],
)
def test_more_bad_input_is_rejected(change: dict[str, Any], expected: str) -> None:
    engine = example()
    engine["spec"].update(change)
    found = errors(with_defaults(engine))
    assert any(expected in message for message in found), found


@pytest.mark.parametrize("change", [
    # Autoscaling turned on for an engine whose replicas were left at the default (1).
    {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4}},
    # maxReplicas lowered below what the autoscaler had scaled to.
    {"replicas": 9, "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4}},
])
def test_replicas_outside_the_autoscaling_bounds_are_accepted(change: dict[str, Any]) -> None:
    # The autoscaler owns spec.replicas and brings it within the bounds at its next interval, as
    # the HPA does; refusing these would make a user edit the field that the autoscaler writes.
    engine = example()
    engine["spec"].pop("replicas")
    engine["spec"].update(change)
    assert errors(with_defaults(engine)) == []


def test_scale_to_zero_is_accepted_with_routing() -> None:
    engine = example()
    engine["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 4}
    assert errors(with_defaults(engine)) == []


def test_scale_to_zero_without_routing_names_the_field_and_the_reason() -> None:
    engine = example()
    engine["spec"].update(autoscaling={"minReplicas": 0, "maxReplicas": 4}, routing={"enabled": False})
    (found,) = errors(with_defaults(engine))
    assert found.startswith("spec.autoscaling.minReplicas: autoscaling.minReplicas 0 needs routing.enabled"), found


def test_long_or_odd_names_are_rejected() -> None:
    for name in ("a" * 53, "1engine", "my.engine"):
        engine = example()
        engine["metadata"]["name"] = name
        assert any("DNS-1035 label" in m for m in errors(with_defaults(engine))), name


@pytest.mark.parametrize("parallelism", [{"tensor": 8, "nodes": 2}, {"tensor": 4, "pipeline": 2, "nodes": 2},
                                         {"tensor": 1, "pipeline": 4, "nodes": 4}, {"tensor": 2, "pipeline": 3}])
def test_ranks_that_split_evenly_over_the_pods_are_accepted(parallelism: dict[str, int]) -> None:
    engine = example()
    engine["spec"]["parallelism"] = parallelism
    engine["spec"]["resources"].pop("limits", None)
    assert errors(with_defaults(engine)) == []


def test_an_engine_over_several_pods_has_a_shorter_name() -> None:
    # Its LeaderWorkerSet names a StatefulSet per group after it.
    engine = example()
    engine["spec"]["parallelism"] = {"tensor": 2, "nodes": 2}
    engine["spec"]["resources"].pop("limits", None)
    engine["metadata"]["name"] = "a" * 44
    assert errors(with_defaults(engine)) == []
    engine["metadata"]["name"] = "a" * 45
    (found,) = errors(with_defaults(engine))
    assert found.startswith("metadata.name: metadata.name must be at most 44 characters when parallelism.nodes is"
                            " above 1"), found
    engine["spec"]["parallelism"] = {"tensor": 2}
    assert errors(with_defaults(engine)) == []


def test_extra_args_rule_forbids_exactly_the_rendered_flags() -> None:
    """The CEL rule's list and the renderer's flags must not drift apart."""
    (pattern,) = re.findall(r"matches\('(.*?)'\)", _extra_args_rule())
    engine = with_defaults({
        "metadata": {"name": "e", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": {
            "model": {"name": "m", "pvc": {"claimName": "c"}}, "image": "i",
            "engine": {"maxNumSeqs": 1, "maxNumBatchedTokens": 1, "maxModelLen": 1, "gpuMemoryUtilization": 0.5},
        },
    })
    rendered = {arg for arg in render.serve_args(engine) if arg.startswith("--")}
    owned = {"--no-enable-prefix-caching", "--scheduling-policy-file", "--api-key", "--model",
             "--kv-events-config", "--cache-salt-secret-file",  # routing renders these two  # auto renders the file flag
             "--pipeline-parallel-size", "--nnodes", "--node-rank", "--master-addr", "--master-port",
             "--headless"}  # an engine over several pods
    assert all(re.fullmatch(pattern, flag) for flag in rendered | owned)
    for unowned in ("--seed", "--dtype", "--enable-chunked-prefill", "--portable"):
        assert not re.fullmatch(pattern, unowned), unowned


def _extra_args_rule() -> str:
    node = engine_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["extraArgs"]
    (rule,) = node["x-kubernetes-validations"]
    return rule["rule"]
