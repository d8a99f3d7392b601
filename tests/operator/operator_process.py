"""`kvpilot operator` as a process of its own, for the tests that kill, cut off or restart it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from operator_harness import NAMESPACE

KVPILOT = Path(sys.executable).parent / "kvpilot"


async def start(log: Path, *flags: str, env: Mapping[str, str] | None = None) -> asyncio.subprocess.Process:
    """`kvpilot operator --namespace ml FLAGS...`, its output to `log`; without a liveness
    endpoint unless FLAGS give one."""
    with log.open("wb") as output:
        return await asyncio.create_subprocess_exec(
            str(KVPILOT), "operator", "--namespace", NAMESPACE, "--liveness-endpoint", "", *flags,
            stdout=output, stderr=output, env=env,
        )


async def leads(port: int) -> float | None:
    """The operator's `kvpilot:operator_leader` on its metrics endpoint on `port`; None: no answer."""
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
            page = await response.text()
    except aiohttp.ClientError:
        return None
    values = [float(line.split()[-1]) for line in page.splitlines() if line.startswith("kvpilot:operator_leader ")]
    return values[0] if values else None


async def healthy(port: int) -> bool:
    """Whether the liveness endpoint on `port` answers 200."""
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as response:
            return response.status == 200
    except aiohttp.ClientError:
        return False
