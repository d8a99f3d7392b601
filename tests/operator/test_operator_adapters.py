"""LoRA adapters on the operator's side: the CRD's checks, the rendering that keeps adapters out
of the pod template, the pure plan from a pod's /v1/models to loads and unloads, and the
adapters' controller against the emulated API server and fake engine pods."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import operator_harness as harness
from crd_validation import errors, with_defaults
from fake_metrics import fake_metrics
from fake_pods import BASE_MODEL, FakePod, serving
from inference_engines import ADMIN_TOKEN, CACHE_SALT, TENANT_KEYS, engine, example
from kvpilot.operator import adapter_sources, adapters, control, render

pytestmark = pytest.mark.timeout(60)

ADAPTERS = [
    {"name": "sql", "source": "adapters/sql"},
    {"name": "legal", "source": "pvc://loras/legal/v2"},
    {"name": "chat", "source": "hf://acme/chat-lora@v1"},
]


def with_adapters(spec: dict[str, Any], adapter_list: list[dict[str, str]] = ADAPTERS, **engine_fields: Any
                  ) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["adapters"] = copy.deepcopy(adapter_list)
    spec.setdefault("engine", {}).update(engine_fields)
    return spec


# --- the CRD ---------------------------------------------------------------------------------

def crd_errors(change: dict[str, Any]) -> list[str]:
    obj = example()
    obj["spec"].update(copy.deepcopy(change))
    return errors(with_defaults(obj))


def test_adapters_tenants_and_limits_are_accepted() -> None:
    tenants = [{"name": "prod", "adapters": ["sql", "legal"]}]
    assert crd_errors({"adapters": ADAPTERS, "scheduling": {"tenants": tenants},
                       "engine": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8}}) == []
    assert crd_errors({"adapters": []}) == []


@pytest.mark.parametrize(("change", "expected"), [
    ({"adapters": [{"name": "a", "source": "/abs/path"}]},
     "adapter a: source /abs/path is none of pvc://<claim>/<path>, hf://<org>/<repo>[@<revision>], or a relative path"),
    ({"adapters": [{"name": "a", "source": "s3://bucket/a"}]}, "adapter a: source s3://bucket/a is none of"),
    ({"adapters": [{"name": "a", "source": "pvc://Claim/a"}]}, "adapter a: source pvc://Claim/a is none of"),
    ({"adapters": [{"name": "a", "source": "pvc://loras"}]}, "adapter a: source pvc://loras is none of"),
    ({"adapters": [{"name": "a", "source": "hf://just-a-name"}]}, "adapter a: source hf://just-a-name is none of"),
    ({"adapters": [{"name": "a", "source": "pvc://loras/../etc"}]}, "adapter a: source pvc://loras/../etc climbs out"),
    ({"adapters": [{"name": "a", "source": "../b"}]}, "adapter a: source ../b climbs out of its volume"),
    ({"adapters": [{"name": "a", "source": "x"}, {"name": "a", "source": "y"}]}, "adapter names must be unique"),
    ({"adapters": [{"name": "bad name", "source": "x"}]}, "does not match"),
    ({"adapters": [{"name": "a"}]}, "'source' is a required property"),
    ({"adapters": [{"name": "qwen2.5-0.5b-instruct", "source": "x"}]}, "an adapter's name must differ from model.name"),
    ({"adapters": [{"name": "a", "source": "x"}], "scheduling": {"tenants": [{"name": "t", "adapters": ["b"]}]}},
     "scheduling.tenants[].adapters must name adapters declared in spec.adapters"),
    ({"scheduling": {"tenants": [{"name": "t", "adapters": ["b"]}]}},
     "scheduling.tenants[].adapters must name adapters declared in spec.adapters"),
    ({"engine": {"maxLoras": 4}}, "engine.maxLoras, engine.maxLoraRank and engine.maxCpuLoras need spec.adapters"),
    ({"adapters": [], "engine": {"maxLoras": 4, "maxCpuLoras": 2}},
     "engine.maxCpuLoras must be at least engine.maxLoras"),
    ({"adapters": [], "engine": {"maxLoraRank": 0}}, "0 is less than the minimum of 1"),
    ({"engine": {"extraArgs": ["--lora-modules", "a=/x"]}}, "extraArgs must not repeat a flag"),
    ({"engine": {"extraArgs": ["--enable-lora"]}}, "extraArgs must not repeat a flag"),
])
def test_bad_adapter_specs_are_rejected_with_a_clear_message(change: dict[str, Any], expected: str) -> None:
    found = crd_errors(change)
    assert any(expected in message for message in found), found


# --- rendering -------------------------------------------------------------------------------

def rendered(spec: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    objects = render.children(engine(spec), tenant_keys=TENANT_KEYS, admin_token=ADMIN_TOKEN, cache_salt=CACHE_SALT,
                              service_monitor=False)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_lora_is_rendered_as_flags_volumes_and_a_download_list() -> None:
    base = engine()["spec"]
    children = rendered(with_adapters(base, maxLoras=4, maxLoraRank=32))
    pod = children["Deployment", "llama"]["spec"]["template"]["spec"]
    engine_container, downloader = pod["containers"]
    args = engine_container["args"]
    assert "--enable-lora" in args
    assert args[args.index("--max-loras") + 1] == "4" and args[args.index("--max-lora-rank") + 1] == "32"
    assert not any(a["name"] in " ".join(args) for a in ADAPTERS)
    assert {"name": "adapters-0", "persistentVolumeClaim": {"claimName": "loras", "readOnly": True}} in pod["volumes"]
    assert {"name": "adapters-0", "mountPath": "/var/lib/kvpilot/adapters/loras", "readOnly": True} \
        in engine_container["volumeMounts"]
    assert downloader["name"] == "adapter-download" and downloader["image"] == base["image"]
    config = children["ConfigMap", "llama-config"]["data"]
    assert config[adapter_sources.DOWNLOADS_KEY] == "acme/chat-lora v1\n"
    assert adapter_sources.desired(with_adapters(base)) == {
        "sql": "/var/lib/kvpilot/model/adapters/sql",
        "legal": "/var/lib/kvpilot/adapters/loras/legal/v2",
        "chat": "/var/cache/kvpilot/adapters/acme/chat-lora@v1",
    }


def test_the_children_of_an_engine_with_adapters_are_valid_kubernetes_objects() -> None:
    for child in rendered(with_adapters(engine()["spec"], maxLoras=2)).values():
        kubernetes_validate.validate(child, "1.30", strict=True)


def test_without_adapters_nothing_of_lora_is_rendered() -> None:
    children = rendered(engine()["spec"])
    pod = children["Deployment", "llama"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["engine"]
    assert "--enable-lora" not in pod["containers"][0]["args"]
    assert adapter_sources.DOWNLOADS_KEY not in children["ConfigMap", "llama-config"]["data"]


@pytest.mark.parametrize("change", [
    [],  # the last adapter removed
    ADAPTERS[:1],
    [*ADAPTERS, {"name": "more", "source": "hf://acme/more"}, {"name": "again", "source": "pvc://loras/again"}],
    [{**adapter, "source": adapter["source"] + "-v3"} for adapter in ADAPTERS],
], ids=["none-left", "removed", "added", "sources-changed"])
def test_adding_or_removing_adapters_leaves_the_pod_template_as_it_is(change: list[dict[str, str]]) -> None:
    # Only the claims' volumes may change: `loras` stays mounted where some adapter is still on it.
    before = rendered(with_adapters(engine()["spec"]))["Deployment", "llama"]["spec"]["template"]
    after = rendered(with_adapters(engine()["spec"], change))["Deployment", "llama"]["spec"]["template"]
    claims = adapter_sources.claims({"adapters": change})
    if claims == ["loras"]:
        assert after == before
    else:  # a claim no adapter uses any more is unmounted: the one change that rolls the pods
        strip = lambda t: [c for c in t["spec"]["volumes"] if not c["name"].startswith("adapters-")]  # noqa: E731
        assert strip(after) == strip(before)
        assert after["spec"]["containers"][0]["args"] == before["spec"]["containers"][0]["args"]


def test_the_tenants_file_names_each_tenants_adapters() -> None:
    spec = with_adapters(engine()["spec"])
    spec["scheduling"]["tenants"][0]["adapters"] = ["sql"]
    config = rendered(spec)["ConfigMap", "llama-config"]["data"]
    entries = {t["name"]: t for t in yaml.safe_load(config["tenants.yaml"])}
    assert entries["prod"]["adapters"] == ["sql"] and "adapters" not in entries["batch"]


# --- the plan (pure) -------------------------------------------------------------------------

def models(*cards: dict[str, Any]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": BASE_MODEL, "root": BASE_MODEL, "parent": None}, *cards]}


def test_a_model_list_gives_the_loaded_adapters() -> None:
    body = models({"id": "sql", "root": "/a/sql", "parent": BASE_MODEL})
    assert adapters.loaded_adapters(body, BASE_MODEL) == {"sql": "/a/sql"}
    assert adapters.loaded_adapters(models(), BASE_MODEL) == {}


@pytest.mark.parametrize(("body", "reason"), [
    ("<html>", "GET /v1/models did not answer a model list"),
    ({"data": "x"}, "GET /v1/models did not answer a model list"),
    ({"data": [{"root": "/x"}]}, "GET /v1/models listed a model without an id"),
    (models({"id": "other", "parent": "llama"}), "GET /v1/models listed 'other' with parent 'llama', not the base"),
])
def test_an_unreadable_model_list_is_a_reason_not_a_plan(body: Any, reason: str) -> None:
    unreadable = adapters.loaded_adapters(body, BASE_MODEL)
    assert isinstance(unreadable, adapters.Unreadable) and unreadable.reason.startswith(reason)


def test_the_plan_unloads_first_and_reloads_a_moved_adapter() -> None:
    desired = {"a": "/p/a", "b": "/p/b2", "c": "/p/c"}
    loaded = {"b": "/p/b1", "c": "/p/c", "z": "/p/z"}
    assert adapters.plan(desired, loaded) == [
        adapters.Action("unload", "b"), adapters.Action("unload", "z"),
        adapters.Action("load", "a", "/p/a"), adapters.Action("load", "b", "/p/b2"),
    ]
    assert adapters.plan(desired, desired) == []


def test_the_condition_names_every_failed_pod_and_adapter() -> None:
    outcomes = [adapters.PodOutcome("p2", ("a",), ("load b answered 400: bad rank",)),
                adapters.PodOutcome("p1", None, ("GET /v1/models answered 503",)),
                adapters.PodOutcome("p3", ("a", "b"))]
    assert adapters.condition(outcomes, {"a": "", "b": ""}) == (
        False, "LoadFailed", "pod p1: GET /v1/models answered 503; pod p2: load b answered 400: bad rank")
    assert adapters.status_fields(outcomes) == {"adapters": [{"pod": "p2", "loaded": ["a"]},
                                                             {"pod": "p3", "loaded": ["a", "b"]}]}
    assert adapters.condition(outcomes[2:], {"a": "", "b": ""})[:2] == (True, "AllLoaded")
    assert adapters.condition([], {})[:2] == (False, "NoReadyPod")
    many = [adapters.PodOutcome(f"p{i:02}", (), ("load a answered 400: bad",)) for i in range(12)]
    assert adapters.condition(many, {"a": ""})[2].endswith("pod p09: load a answered 400: bad; and 2 more")


# --- the controller, against the emulated API server and fake engine pods --------------------

INTERVAL = 1
SPEC: dict[str, Any] = with_adapters(
    {**harness.SPEC, "autoscaling": {"intervalSeconds": INTERVAL}},
    [{"name": "sql", "source": "adapters/sql"}, {"name": "legal", "source": "pvc://loras/legal"}],
)
PODS = ["qwen-a", "qwen-b"]


def loaded_status(k: harness.Cluster) -> list[dict[str, Any]] | None:
    return k.engine("qwen").get("status", {}).get("adapters")


def test_adapters_are_loaded_on_every_ready_pod_and_unloaded_when_removed_without_a_restart(tmp_path: Path) -> None:
    fake_pods = {name: FakePod(token=None) for name in PODS}
    starting = FakePod(token=None)

    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake, \
                serving(**fake_pods, **{"qwen-c": starting}) as urls:
            fake.set(PODS, waiting=0)
            async with harness.operator(pod_metrics_url=fake.pod_url, pod_url=lambda p: urls[p["metadata"]["name"]]):
                for name in PODS:
                    await k.create_pod(name, "qwen", ready=True)
                await k.create_pod("qwen-c", "qwen", ready=False)
                await harness.created(k, SPEC)
                generation = k.deployment("qwen")["metadata"]["generation"]
                both = ["legal", "sql"]
                await harness.eventually(
                    lambda: loaded_status(k) == [{"pod": p, "loaded": both} for p in PODS], "both loaded in status")
                assert all(p.adapters == {"sql": "/var/lib/kvpilot/model/adapters/sql",
                                          "legal": "/var/lib/kvpilot/adapters/loras/legal"} for p in fake_pods.values())
                assert starting.lora_calls == []  # not ready: left alone
                assert harness.condition(k.engine("qwen"), "AdaptersLoaded")["reason"] == "AllLoaded"

                await k.update_engine("qwen", lambda spec: spec.update(adapters=[
                    {"name": "legal", "source": "pvc://loras/legal"}, {"name": "chat", "source": "adapters/chat"}]))
                await harness.eventually(
                    lambda: loaded_status(k) == [{"pod": p, "loaded": ["chat", "legal"]} for p in PODS],
                    "sql unloaded, chat loaded")
                assert all(p.lora_calls[-2:] == ["unload sql", "load chat"] for p in fake_pods.values())
                # Neither change touched the pod template: no pod restarted.
                assert k.deployment("qwen")["metadata"]["generation"] == generation

    harness.run(scenario())


@contextlib.asynccontextmanager
async def control_loops(k: harness.Cluster, fake: Any, urls: dict[str, str]) -> AsyncIterator[control.ControlLoops]:
    """The control loops without kopf, ticked by the test, over the engine `qwen` and its ready pods."""
    async with harness.reconciler_alone() as reconciler:
        loops = control.ControlLoops(reconciler, pod_metrics_url=fake.pod_url,
                                     pod_url=lambda p: urls.get(p["metadata"]["name"]))
        await k.create_secret("prod-key", {"api-key": harness.key("sk-prod")})
        await k.create_engine("qwen", SPEC)
        await reconciler.reconcile(k.engine("qwen"))
        for name in urls:
            await k.create_pod(name, "qwen", ready=True)
        try:
            yield loops
        finally:
            await loops.close()


def test_a_failed_load_is_reported_naming_pod_and_adapter_and_blocks_nothing_else(tmp_path: Path) -> None:
    refusing, good = FakePod(token=None), FakePod(token=None)
    refusing.refused["legal"] = "rank 64 is above --max-lora-rank 16"

    async def scenario() -> None:
        async with harness.cluster(tmp_path) as k, fake_metrics() as fake, \
                serving(**{"qwen-a": refusing, "qwen-b": good}) as urls:
            urls["qwen-dead"] = "http://127.0.0.1:9"  # nothing listens there
            async with control_loops(k, fake, urls) as loops:
                await loops.tick(harness.NAMESPACE, "qwen")
                assert (refusing.adapters.keys(), good.adapters.keys()) == ({"sql"}, {"sql", "legal"})
                assert loaded_status(k) == [{"pod": "qwen-a", "loaded": ["sql"]},
                                            {"pod": "qwen-b", "loaded": ["legal", "sql"]}]
                reported = harness.condition(k.engine("qwen"), "AdaptersLoaded")
                assert (reported["status"], reported["reason"]) == ("False", "LoadFailed")
                assert reported["message"].startswith(
                    "pod qwen-a: load legal answered 400: adapter 'legal': rank 64 is above --max-lora-rank 16; "
                    "pod qwen-dead: GET /v1/models failed: ClientConnectorError")

                del refusing.refused["legal"]  # fixed: the next interval loads it
                await loops.tick(harness.NAMESPACE, "qwen")
                assert refusing.adapters.keys() == {"sql", "legal"}
                assert refusing.lora_calls == ["load legal", "load sql", "load legal"]
                assert good.lora_calls == ["load legal", "load sql"]  # already in line: only read

                # LoRA turned off (the pods roll without --enable-lora): nothing keeps the list.
                await k.update_engine("qwen", lambda spec: spec.pop("adapters"))
                await loops.tick(harness.NAMESPACE, "qwen")
                assert "adapters" not in k.engine("qwen")["status"]
                assert harness.condition(k.engine("qwen"), "AdaptersLoaded") == {}

    harness.run(scenario())
