"""The LoRA adapters' controller in the control loop: each interval, every ready pod is read
(GET /v1/models) and brought to spec.adapters (adapters.py plans the calls) through vLLM's admin
routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with the engine's admin token.

Pods are called concurrently, each call under one short timeout; a pod or an adapter that fails
is reported in the AdaptersLoaded condition and tried again next interval, and holds no other
pod or adapter up. So, as with the policy tuner, each interval repairs what the last could not
reach: a pod that restarted, or was not ready when an adapter was added.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from kvpilot.operator import adapter_sources, adapters, metrics, reconcile, status
from kvpilot.operator.controller import Step

if TYPE_CHECKING:
    from kvpilot.operator.controller import Interval, Key

logger = logging.getLogger(__name__)


class AdapterLoading:
    # It keeps nothing between intervals: every interval reads the pods afresh.
    memory = "adapters"
    status_fields = ("adapters",)
    condition_types = (adapters.CONDITION,)

    def __init__(
        self, reconciler: reconcile.Reconciler, *, pod_url: Callable[[Mapping[str, Any]], str | None] = metrics.pod_url
    ) -> None:
        self._reconciler = reconciler
        self._pod_url = pod_url

    def wants(self, spec: Mapping[str, Any]) -> bool:
        return adapter_sources.lora_enabled(spec)

    def forget(self, key: Key) -> None:
        pass

    async def step(self, interval: Interval) -> Step:
        engine = interval.engine
        meta, spec = engine["metadata"], engine["spec"]
        key = (meta["namespace"], meta["name"])
        desired = adapter_sources.desired(spec)
        targets = {metrics.pod_name(pod): url for pod in interval.ready if (url := self._pod_url(pod)) is not None}
        token = await self._reconciler.admin_token_in_use(engine) if targets else None
        if targets and token is None:
            # The reconcile pass makes the Secret; the next interval loads.
            logger.warning(f"InferenceEngine {key[0]}/{key[1]}: no admin token yet; adapters are loaded next interval")
            return Step(lambda fresh: {})
        timeout = aiohttp.ClientTimeout(total=metrics.request_timeout(spec["autoscaling"]["intervalSeconds"]))
        async with aiohttp.ClientSession(timeout=timeout, headers={"Authorization": f"Bearer {token}"}) as session:
            outcomes = list(await asyncio.gather(*(
                bring_in_line(session, pod, url, desired, spec["model"]["name"]) for pod, url in sorted(targets.items())
            )))
        true, reason, message = adapters.condition(outcomes, desired)
        if not true:
            logger.warning(f"InferenceEngine {key[0]}/{key[1]}: {reason}: {message}")
        stamp = status.timestamp(datetime.datetime.fromtimestamp(interval.now, datetime.UTC))

        def recorded(fresh: Mapping[str, Any]) -> dict[str, Any]:
            conditions = status.set_condition(list((fresh.get("status") or {}).get("conditions", [])),
                                              adapters.CONDITION, true, reason, message,
                                              fresh["metadata"].get("generation"), stamp)
            return {**adapters.status_fields(outcomes), "conditions": conditions}

        return Step(recorded)


async def bring_in_line(session: aiohttp.ClientSession, pod: str, url: str, desired: Mapping[str, str],
                         base_model: str) -> adapters.PodOutcome:
    try:
        async with session.get(f"{url}/v1/models") as response:
            body = await response.json(content_type=None) if response.status == 200 else None
            if body is None:
                return adapters.PodOutcome(pod, None, (f"GET /v1/models answered {response.status}",))
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        return adapters.PodOutcome(pod, None, (f"GET /v1/models failed: {type(error).__name__}: {error}",))
    loaded = adapters.loaded_adapters(body, base_model)
    if isinstance(loaded, adapters.Unreadable):
        return adapters.PodOutcome(pod, None, (loaded.reason,))
    now = dict(loaded)
    failures = []
    for action in adapters.plan(desired, loaded):
        failure = await _call(session, url, action)
        if failure is not None:
            failures.append(failure)
        elif action.kind == adapters.LOAD:
            now[action.name] = action.path
        else:
            now.pop(action.name, None)
    return adapters.PodOutcome(pod, tuple(now), tuple(failures))


async def _call(session: aiohttp.ClientSession, url: str, action: adapters.Action) -> str | None:
    """One load or unload; None where it succeeded, else what failed, naming the adapter."""
    body = {"lora_name": action.name}
    if action.kind == adapters.LOAD:
        body["lora_path"] = action.path
    try:
        async with session.post(f"{url}/v1/{action.kind}_lora_adapter", json=body) as response:
            if response.status == 200 or (action.kind == adapters.UNLOAD and response.status == 404):
                return None  # an unload that finds nothing loaded has nothing left to do
            return f"{action.kind} {action.name} answered {response.status}: {_message(await response.text())}"
    except (TimeoutError, aiohttp.ClientError) as error:
        return f"{action.kind} {action.name} failed: {type(error).__name__}: {error}"


def _message(text: str) -> str:
    """The OpenAI-shaped error's message, or the start of whatever else came back."""
    try:
        error = json.loads(text).get("error", {})
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:300]
    except (ValueError, AttributeError):
        pass
    return text[:300].strip()
