"""Where the replicas are: URLs given on the command line, a file of URLs re-read when it changes,
or (in Kubernetes) the engines' EndpointSlices (endpointslices.py).

A source publishes the whole list each time it changes; the fleet (replicas.py) works out what
came and went.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

BACKENDS_FILE_POLL_S = 1.0


@dataclass(frozen=True)
class Endpoint:
    url: str
    ready: bool = True
    # Draining: its requests in flight finish there, and it gets no new ones.
    terminating: bool = False


Publish = Callable[[list[Endpoint]], None]


def backend_url(text: str) -> str:
    """`http://host:port` of a replica, normalized; ValueError saying what is wrong."""
    text = text.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as err:
        raise ValueError(f"{text!r} is not a URL: {err}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{text!r} is not an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError(f"{text!r} names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{text!r} has a path or query: give the replica's root, as in http://host:8000")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")


def parse_url_file(text: str, path: Path) -> list[Endpoint]:
    """One URL a line; blank lines and `#` comments are skipped, and so is a bad line, said in the log."""
    endpoints: dict[str, Endpoint] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            url = backend_url(line)
        except ValueError as err:
            logger.error("%s, line %d skipped: %s", path, number, err)
            continue
        endpoints[url] = Endpoint(url)
    return list(endpoints.values())


async def watch_url_file(path: Path, publish: Publish, kind: str = "replica",
                         interval: float = BACKENDS_FILE_POLL_S) -> None:
    """Publishes the file's URLs (of replicas, or of `kind`) now and whenever the file changes; a
    missing or empty file is none at all (for replicas: requests are held until one appears), said
    once until it changes again."""
    stamp: object = ()
    while True:
        try:
            st = os.stat(path)
            current = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError as err:
            current = err.strerror
        if current != stamp:
            stamp = current
            publish(_read(path, kind))
        await asyncio.sleep(interval)


def _read(path: Path, kind: str) -> list[Endpoint]:
    try:
        text = path.read_text()
    except OSError as err:
        logger.error("%s cannot be read (%s): no %s until it can", path, err.strerror, kind)
        return []
    endpoints = parse_url_file(text, path)
    if endpoints:
        logger.info("%s: %d %s(s)", path, len(endpoints), kind)
    else:
        logger.warning("%s names no %s", path, kind)
    return endpoints


def static_backends(urls: list[str]) -> Callable[[Publish], Awaitable[None]]:
    """The source of `--backend` URLs: published once, then never changing."""

    async def source(publish: Publish) -> None:
        publish([Endpoint(url) for url in dict.fromkeys(urls)])
        await asyncio.Event().wait()

    return source
