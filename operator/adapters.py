"""The LoRA adapters a pod should change: what it answers on GET /v1/models against spec.adapters,
turned into loads and unloads; and what status says of the outcome. Pure.

Invariants of a plan:
- it brings the pod exactly to the desired adapters, each at its desired folder: an adapter
  loaded from another folder (its source changed) is unloaded, then loaded again;
- unloads come before loads, so that host memory (--max-cpu-loras) is freed before it is used;
- a pod whose answer cannot be read gets no plan, only the reason: acting on a guess could
  unload what is in use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LOAD = "load"
UNLOAD = "unload"
CONDITION = "AdaptersLoaded"
# A fleet-wide failure (a bad adapter on every pod) names this many, and counts the rest.
MESSAGE_FAILURES = 10


@dataclass(frozen=True)
class Action:
    kind: str  # LOAD or UNLOAD
    name: str
    path: str = ""  # the folder, for LOAD


@dataclass(frozen=True)
class Unreadable:
    """Why a pod's /v1/models answer says nothing about its adapters."""

    reason: str


def loaded_adapters(body: Any, base_model: str) -> dict[str, str] | Unreadable:
    """The adapters (name -> root folder) in a /v1/models answer: every card but the base model's.
    vLLM's shape: {"data": [{"id", "root", "parent", ...}]}, an adapter's parent being the base."""
    if not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        return Unreadable("GET /v1/models did not answer a model list")
    loaded: dict[str, str] = {}
    for card in body["data"]:
        if not isinstance(card, Mapping) or not isinstance(card.get("id"), str):
            return Unreadable("GET /v1/models listed a model without an id")
        if card["id"] == base_model:
            continue
        if card.get("parent") != base_model:
            return Unreadable(f"GET /v1/models listed {card['id']!r} with parent {card.get('parent')!r},"
                              f" not the base model {base_model!r}")
        loaded[card["id"]] = str(card.get("root", ""))
    return loaded


def plan(desired: Mapping[str, str], loaded: Mapping[str, str]) -> list[Action]:
    """The calls that bring a pod from `loaded` to `desired` (both name -> folder), names sorted."""
    moved = {name for name in desired.keys() & loaded.keys() if desired[name] != loaded[name]}
    unloads = [Action(UNLOAD, name) for name in sorted(loaded.keys() - desired.keys() | moved)]
    loads = [Action(LOAD, name, desired[name]) for name in sorted(desired.keys() - loaded.keys() | moved)]
    return unloads + loads


@dataclass(frozen=True)
class PodOutcome:
    """One ready pod after its plan ran."""

    pod: str
    loaded: tuple[str, ...] | None  # None where the pod could not be read
    failures: tuple[str, ...] = ()  # each: what failed and why, naming the adapter


def status_fields(outcomes: Sequence[PodOutcome]) -> dict[str, Any]:
    """status.adapters: each ready pod read, with what it has loaded, by pod name."""
    return {"adapters": [{"pod": o.pod, "loaded": sorted(o.loaded)}
                         for o in sorted(outcomes, key=lambda o: o.pod) if o.loaded is not None]}


def condition(outcomes: Sequence[PodOutcome], desired: Mapping[str, str]) -> tuple[bool, str, str]:
    """AdaptersLoaded: (true, reason, message). False names every pod and adapter that failed."""
    failed = [f"pod {o.pod}: {failure}" for o in sorted(outcomes, key=lambda o: o.pod) for failure in o.failures]
    if failed:
        shown = failed[:MESSAGE_FAILURES]
        more = f"; and {len(failed) - len(shown)} more" if len(failed) > len(shown) else ""
        return False, "LoadFailed", "; ".join(shown) + more
    if not outcomes:
        return False, "NoReadyPod", "no ready pod to load adapters into"
    return True, "AllLoaded", f"{len(desired)} adapter(s) loaded on {len(outcomes)} ready pod(s)"
