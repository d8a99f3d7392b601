"""The policy tuner's calls to an engine's pods: each pod's live policy (GET /health) and the
switch (POST /admin/scheduling, with the engine's admin token).

Pods are called concurrently, each under one short timeout, so that a slow or dead pod costs the
loop at most that timeout and never holds the others up. A pod that fails is reported, not
retried: the next interval finds it out of line and tries again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

IN_LINE = "in-line"
SWITCHED = "switched"
FAILED = "failed"


@dataclass(frozen=True)
class PodResult:
    pod: str
    outcome: str  # IN_LINE, SWITCHED or FAILED
    detail: str  # the policy found, or what went wrong


async def apply_policy(pods: Mapping[str, str], policy: str, token: str, *, timeout: float) -> list[PodResult]:
    """Bring every pod (name -> base URL) to `policy`; a pod that already runs it is left alone."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        return list(await asyncio.gather(
            *(_bring_in_line(session, name, url, policy, token) for name, url in sorted(pods.items()))
        ))


async def _bring_in_line(session: aiohttp.ClientSession, name: str, url: str, policy: str, token: str) -> PodResult:
    try:
        async with session.get(f"{url}/health") as response:
            # A draining pod answers 503 with the same body; it is switched all the same, since
            # its queue still drains under the policy it runs.
            body = await response.json(content_type=None)
        current = body.get("scheduling_policy") if isinstance(body, dict) else None
        if current == policy:
            return PodResult(name, IN_LINE, policy)
        async with session.post(f"{url}/admin/scheduling", json={"policy": policy},
                                headers={"Authorization": f"Bearer {token}"}) as response:
            if response.status != 200:
                return PodResult(name, FAILED, f"POST /admin/scheduling answered {response.status}: "
                                               f"{_message(await response.text())}")
        return PodResult(name, SWITCHED, f"{current} -> {policy}")
    except (TimeoutError, aiohttp.ClientError, ValueError) as error:
        return PodResult(name, FAILED, f"{type(error).__name__}: {error}")


def _message(text: str) -> str:
    return text[:300].strip()
