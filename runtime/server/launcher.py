"""Run the API server: start the engine, serve HTTP with uvicorn, drain on SIGTERM, exit when the engine dies.

Exit status: 0 after a SIGTERM/SIGINT drain, 1 when the engine died (so Kubernetes restarts the pod).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket

import uvicorn

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.async_llm import AsyncLLM
from kvpilot.runtime.engine.core_process import freeze_startup_heap
from kvpilot.runtime.server.api_server import ServerConfig, build_app
from kvpilot.runtime.server.connections import guarded_protocol
from kvpilot.runtime.server.log_redaction import redact_access_log
from kvpilot.runtime.server.state import ServerState

logger = logging.getLogger(__name__)

# How long aborted requests get to send their 503, and then open connections to close.
CONNECTION_CLOSE_GRACE_S = 1.0
# A dead engine fails every in-flight request at once; this bounds the wait for those error
# responses, and for requests still uploading their bodies, before the process exits.
ENGINE_DEAD_GRACE_S = 3.0


def run_server(engine_config: EngineConfig, config: ServerConfig, *, host: str, port: int,
               shutdown_timeout: float) -> int:
    """RuntimeError when the address cannot be listened on, before the engine starts."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with bound_socket(host, port) as sock:
        # Started before the event loop: in it, asyncio.run would turn a Ctrl-C during the load
        # into a cancellation that lands at the first await, inside uvicorn's startup (a logged
        # traceback); here it is a plain KeyboardInterrupt, which the CLI reports in a line.
        engine = AsyncLLM(engine_config)
        try:
            return asyncio.run(_serve(engine, config, sock, shutdown_timeout))
        finally:
            engine.shutdown()


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not yet listening (a connection is refused until the engine is up).

    Bound before the engine starts, which takes seconds to minutes: a port in use is said at
    once, and never after the engine was loaded for nothing.
    """
    # uvicorn's choice of family, and its SO_REUSEADDR (a restart may reuse a port in TIME_WAIT).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        hint = ": another process is listening there, pick another --port" if err.errno == errno.EADDRINUSE else ""
        raise RuntimeError(f"cannot listen on {host}:{port}: {err.strerror or err}{hint}") from err
    return sock


async def _serve(engine: AsyncLLM, config: ServerConfig, sock: socket.socket, shutdown_timeout: float) -> int:
    state = ServerState()
    app = build_app(engine, config, state)
    limits = config.limits
    uvicorn_config = uvicorn.Config(
        app, timeout_graceful_shutdown=CONNECTION_CLOSE_GRACE_S,
        timeout_keep_alive=limits.timeout_keep_alive_s,
        http=guarded_protocol(limits),
    )
    redact_access_log()
    server = DrainingServer(uvicorn_config, state, shutdown_timeout)
    engine.on_engine_dead(server.engine_died)
    # The app, the tokenizer and the libraries live as long as the process: out of the cyclic
    # GC's way, its collections walk only what requests allocate (~7 % of the API server's CPU
    # under 64 streams went to walking them). vLLM's API server does the same.
    freeze_startup_heap()
    await server.serve(sockets=[sock])
    return 1 if state.dead_reason is not None else 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT drain before exiting.

    While draining, /health and new requests answer 503 and the requests in flight run to their
    end, for up to `shutdown_timeout` seconds; what is left then is cancelled (which aborts it in
    the engine). A second signal exits at once.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit_tasks: set[asyncio.Task] = set()

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # uvicorn says where it listens only on the sockets it binds itself: said here in its words.
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            logging.getLogger("uvicorn.error").info("Uvicorn running on %s (Press CTRL+C to quit)", url)

    def handle_exit(self, sig: int, frame) -> None:
        # Called by signal.signal between two bytecodes of the loop's thread: hand over to the loop.
        self._loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self.state.draining:
            logger.warning("%s again: exiting without waiting for %d request(s)", name, self.state.in_flight)
            self.force_exit = self.should_exit = True
            return
        logger.info("%s: draining %d request(s) in flight (at most %.0f s)", name, self.state.in_flight,
                    self.shutdown_timeout)
        self.state.draining = True
        self._exit_when_idle(self.shutdown_timeout)

    def engine_died(self, reason: str) -> None:
        logger.error("the engine died (%s): exiting", reason)
        self._exit_when_idle(min(self.shutdown_timeout, ENGINE_DEAD_GRACE_S))

    def _exit_when_idle(self, timeout: float) -> None:
        task = asyncio.ensure_future(self._wait_then_exit(timeout))
        self._exit_tasks.add(task)
        task.add_done_callback(self._exit_tasks.discard)

    async def _wait_then_exit(self, timeout: float) -> None:
        if not await self.state.wait_idle(timeout):
            logger.warning("%d request(s) still in flight after %g s: aborting them", self.state.in_flight, timeout)
            self.state.abort_in_flight()
            await self.state.wait_idle(CONNECTION_CLOSE_GRACE_S)
        self.should_exit = True
