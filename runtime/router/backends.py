"""The replicas the router may send requests to, as its backend sources publish them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """One replica's API server. A source publishes the whole current list each time it changes."""

    url: str
    ready: bool = True
    # Shutting down: it finishes what it runs, and should get nothing new.
    terminating: bool = False
