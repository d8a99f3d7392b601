"""The Helm chart, checked with the real helm binary: it lints, renders valid manifests with the
default values and with a values file that sets every option, and its operator Deployment fits
the image and the `kvpilot operator` command line."""

from __future__ import annotations

import copy
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from crd_validation import REPO
from helm_cli import CHART, Helm
from kvpilot.operator import pod_parts
from kvpilot.operator.leader_election import LeaderElection, LeaseSettings
from kvpilot.runtime import cli
from packaging_support import FULL_NAMESPACE, FULL_VALUES, dockerfile_stage, validate

Manifest = dict[str, Any]


def by_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def the(manifests: list[Manifest], kind: str) -> Manifest:
    (found,) = by_kind(manifests, kind)
    return found


def container(manifests: list[Manifest]) -> Manifest:
    (found,) = the(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return found


@pytest.fixture(scope="module")
def default(helm: Helm) -> list[Manifest]:
    return helm.template(crds=True)


@pytest.fixture(scope="module")
def full(helm: Helm) -> list[Manifest]:
    return helm.template("--values", FULL_VALUES, namespace=FULL_NAMESPACE, crds=True)


@pytest.mark.parametrize("values", [[], ["--values", FULL_VALUES, "--namespace", FULL_NAMESPACE]], ids=["default", "full"])
def test_helm_lint_passes(helm: Helm, values: list[str | Path]) -> None:
    done = helm.run("lint", "--strict", CHART, *values)
    assert done.returncode == 0, done.stdout + done.stderr


def test_default_render(default: list[Manifest]) -> None:
    assert sorted(m["kind"] for m in default) == [
        "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment", "PodDisruptionBudget",
        "Role", "RoleBinding", "ServiceAccount",
    ]
    for manifest in default:
        validate(manifest)


def test_full_render(full: list[Manifest]) -> None:
    assert sorted(m["kind"] for m in full) == [
        "ConfigMap", "CustomResourceDefinition", "Deployment", "InferenceEngine", "PodDisruptionBudget", "PodMonitor",
        "PrometheusRule", "Role", "Role", "Role", "RoleBinding", "RoleBinding", "RoleBinding", "ServiceAccount",
    ]
    for manifest in full:
        validate(manifest)


def options(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every setting that values.schema.json declares; free-form maps are one setting."""
    for name, node in schema["properties"].items():
        if "properties" in node:
            yield from options(node, (*path, name))
        else:
            yield (*path, name)


def test_every_option_has_a_default_and_shows_in_the_full_render(helm: Helm, tmp_path: Path) -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    full_values = yaml.safe_load(FULL_VALUES.read_text())
    rendered = helm.template("--values", FULL_VALUES, namespace=FULL_NAMESPACE)
    declared = list(options(json.loads((CHART / "values.schema.json").read_text())))
    assert len(declared) > 20
    for path in declared:
        reverted = copy.deepcopy(full_values)
        *parents, leaf = path
        default_node, node = defaults, reverted
        for name in parents:
            default_node, node = default_node[name], node[name]
        assert leaf in default_node, f"values.yaml has no default for {'.'.join(path)}"
        assert leaf in node, f"{FULL_VALUES.name} does not set {'.'.join(path)}"
        node[leaf] = default_node[leaf]
        values = tmp_path / "reverted.yaml"
        values.write_text(yaml.safe_dump(reverted))
        assert helm.template("--values", values, namespace=FULL_NAMESPACE) != rendered, \
            f"{'.'.join(path)} in {FULL_VALUES.name} changes nothing: set it to something other than its default"


def test_replicas_roll_one_at_a_time_behind_a_lease_and_a_budget(default: list[Manifest], full: list[Manifest]) -> None:
    for manifests, replicas in ((default, 2), (full, 3)):
        deployment = the(manifests, "Deployment")
        assert deployment["spec"]["replicas"] == replicas
        # The new pod first: there is always one to hold or take the Lease.
        assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                                  "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
        budget = the(manifests, "PodDisruptionBudget")
        assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}


def operator_settings(manifests: list[Manifest], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `kvpilot operator` runs with, parsed by the real command line from the image's
    entrypoint and the Deployment's args."""
    command, *argv = json.loads(dockerfile_stage("operator")["ENTRYPOINT"]) + container(manifests)["args"]
    assert command == "kvpilot"
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr("kvpilot.operator.run.run_operator", lambda **settings: calls.append(settings))
    assert cli.main(argv) == 0
    (settings,) = calls
    return settings


def test_operator_command_line(default: list[Manifest], full: list[Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    assert operator_settings(default, monkeypatch) == {
        "namespaces": [], "clusterwide": True, "liveness_endpoint": "http://0.0.0.0:8080/healthz",
        "metrics_endpoint": "http://0.0.0.0:8081/metrics", "log_level": "info", "log_format": "full",
        "leader_election": LeaderElection("kvpilot", "kvpilot-system", LeaseSettings(15, 10, 2)),
    }
    assert operator_settings(full, monkeypatch) == {
        "namespaces": ["ml", "serving"], "clusterwide": False, "liveness_endpoint": "http://0.0.0.0:9090/healthz",
        "metrics_endpoint": "http://0.0.0.0:9091/metrics", "log_level": "debug", "log_format": "json",
        "leader_election": LeaderElection("llm-operator", FULL_NAMESPACE, LeaseSettings(30, 20, 4)),
    }


def test_the_lease_rights_are_those_of_one_lease_in_the_release_namespace(full: list[Manifest]) -> None:
    role = next(r for r in by_kind(full, "Role") if r["metadata"]["name"] == "llm-operator-leader-election")
    assert role["metadata"]["namespace"] == FULL_NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["llm-operator"],
         "verbs": ["get", "patch"]},
    ]
    binding = next(b for b in by_kind(full, "RoleBinding") if b["metadata"]["name"] == role["metadata"]["name"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == the(full, "ServiceAccount")["metadata"]["name"]


def test_liveness_probe_asks_the_operators_liveness_endpoint(
    default: list[Manifest], full: list[Manifest], monkeypatch: pytest.MonkeyPatch,
) -> None:
    for manifests in (default, full):
        endpoint = urllib.parse.urlsplit(operator_settings(manifests, monkeypatch)["liveness_endpoint"])
        probe = container(manifests)["livenessProbe"]["httpGet"]
        (port,) = [p for p in container(manifests)["ports"] if p["name"] == probe["port"]]
        assert (port["containerPort"], probe["path"]) == (endpoint.port, endpoint.path)


def test_runs_as_the_images_non_root_user_with_a_read_only_root(default: list[Manifest]) -> None:
    pod = the(default, "Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == pod["runAsGroup"] == pod_parts.RUN_AS_ID == int(dockerfile_stage("operator")["USER"])
    security = container(default)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}


def watch_rights(manifests: list[Manifest], kind: str) -> list[Manifest]:
    """The Roles or RoleBindings of the watched namespaces, not the Lease's."""
    return [m for m in by_kind(manifests, kind) if not m["metadata"]["name"].endswith("-leader-election")]


def test_rights_are_bound_cluster_wide_only_to_watch_every_namespace(
    default: list[Manifest], full: list[Manifest],
) -> None:
    def account(manifests: list[Manifest]) -> dict[str, str]:
        account = the(manifests, "ServiceAccount")["metadata"]
        assert the(manifests, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account["name"]
        return {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}

    binding = the(default, "ClusterRoleBinding")
    assert binding["subjects"] == [account(default)]
    assert binding["roleRef"]["name"] == the(default, "ClusterRole")["metadata"]["name"]
    assert watch_rights(default, "Role") == watch_rights(default, "RoleBinding") == []

    assert by_kind(full, "ClusterRole") == by_kind(full, "ClusterRoleBinding") == []
    roles = {role["metadata"]["namespace"]: role["metadata"]["name"] for role in watch_rights(full, "Role")}
    bindings = watch_rights(full, "RoleBinding")
    assert sorted(roles) == sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "serving"]
    for binding in bindings:
        assert binding["subjects"] == [account(full)]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": roles[binding["metadata"]["namespace"]],
        }


def test_example_engine_is_the_example_file_or_the_values(helm: Helm, full: list[Manifest]) -> None:
    example = yaml.safe_load((REPO / "examples" / "engine.yaml").read_text())
    engine = the(helm.template("--set", "exampleEngine.enabled=true"), "InferenceEngine")
    assert (engine["metadata"]["name"], engine["spec"]) == (example["metadata"]["name"], example["spec"])
    validate(engine)

    values = yaml.safe_load(FULL_VALUES.read_text())["exampleEngine"]
    engine = the(full, "InferenceEngine")
    assert (engine["metadata"]["name"], engine["spec"]) == (values["name"], values["spec"])
    assert engine["metadata"]["namespace"] == FULL_NAMESPACE


@pytest.mark.parametrize(("settings", "expected"), [
    (["--set", "logLevel=verbose"], "/logLevel"),
    (["--set", "watchNamespaces={team-*}"], "/watchNamespaces/0"),
    (["--set", "replicaCount=2"], "replicaCount"),
    (["--set", "watchNamespaces={ml}", "--set", "exampleEngine.enabled=true"], "which watchNamespaces leaves out"),
])
def test_bad_values_are_refused(helm: Helm, settings: list[str], expected: str) -> None:
    done = helm.run("template", "kvpilot", CHART, "--namespace", "kvpilot-system", *settings)
    assert done.returncode != 0
    assert expected in done.stderr, done.stderr


def test_notes_give_the_next_steps(helm: Helm) -> None:
    def notes(*args: str | Path) -> str:
        done = helm.run("install", "kvpilot", CHART, "--dry-run=client", *args)
        assert done.returncode == 0, done.stderr
        return done.stdout.partition("NOTES:")[2]

    everywhere = notes("--namespace", "kvpilot-system")
    assert "watching InferenceEngines in every namespace" in everywhere
    assert "kubectl -n kvpilot-system apply -f examples/engine.yaml" in everywhere
    assert "kubectl apply --server-side --force-conflicts -f charts/kvpilot/crds/" in everywhere

    example = notes("--namespace", FULL_NAMESPACE, "--values", FULL_VALUES)
    assert "watching InferenceEngines in the namespaces ml, serving" in example
    assert f"kubectl -n {FULL_NAMESPACE} get inferenceengines demo -w" in example
    assert f"kubectl -n {FULL_NAMESPACE} port-forward svc/demo 8000:80" in example
