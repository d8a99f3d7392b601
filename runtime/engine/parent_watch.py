"""Child processes end with their parent, busy or idle, and leave no socket folder behind.

A SIGKILLed API server runs no cleanup, so its children must notice on their own:
- The EngineCore runs a watch thread that polls its parent's pid. The thread runs while the
  main thread is inside a model step (torch releases the GIL), so a busy engine notices as
  quickly as an idle one; it then removes the folders it was given and exits.
- TP workers ask Linux for SIGKILL when their parent dies (PR_SET_PDEATHSIG): they hold no
  folder of their own, and the signal reaches them even inside a blocked collective.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time

logger = logging.getLogger(__name__)

POLL_S = 0.25
_PR_SET_PDEATHSIG = 1
# What the watch removes before exiting.
_orphan_cleanup: list[str] = []


def remove_if_orphaned(folder: str) -> None:
    _orphan_cleanup.append(folder)


def _parent_pid() -> int:
    # The pid multiprocessing started us from: os.getppid() already names a reaper if the
    # parent died before we looked.
    parent = multiprocessing.parent_process()
    return os.getppid() if parent is None else parent.pid


def exit_with_parent(poll_s: float = POLL_S) -> None:
    """Start the watch: once the parent is gone, remove the folders given to remove_if_orphaned and exit 1."""
    parent = _parent_pid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        logger.error("the API-server process is gone: exiting")
        for folder in _orphan_cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def kill_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (elsewhere: nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    # The parent may have died before the request was made: then no signal will come.
    if os.getppid() != _parent_pid():
        os._exit(1)
