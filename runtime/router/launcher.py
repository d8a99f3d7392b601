"""Run the router: serve HTTP with uvicorn, guarded as `kvpilot serve` is, and drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
import uvloop

from kvpilot.runtime.router.app import RouterConfig, build_app
from kvpilot.runtime.server.connections import guarded_protocol
from kvpilot.runtime.server.launcher import CONNECTION_CLOSE_GRACE_S, DrainingServer, bound_socket
from kvpilot.runtime.server.log_redaction import redact_access_log
from kvpilot.runtime.server.state import ServerState


def run_router(config: RouterConfig, *, host: str, port: int, shutdown_timeout: float, log_level: str) -> int:
    """RuntimeError when the address cannot be listened on."""
    logging.basicConfig(level=getattr(logging, log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with bound_socket(host, port) as sock:
        # uvloop: a relayed token costs the loop a read, a task's wake-up and a write, which plain
        # asyncio runs in Python (bench/router_overhead.py measures the router's CPU per token).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(config, sock, shutdown_timeout))


async def _serve(config: RouterConfig, sock: socket.socket, shutdown_timeout: float) -> int:
    state = ServerState()
    limits = config.settings.limits
    uvicorn_config = uvicorn.Config(build_app(config, state), timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE_S,
                                    timeout_keep_alive=limits.timeout_keep_alive_s, http=guarded_protocol(limits))
    redact_access_log()
    await DrainingServer(uvicorn_config, state, shutdown_timeout).serve(sockets=[sock])
    return 0
