"""What the control loop (control.py) hands each of its controllers every interval, and what a
controller hands back: the shape that the autoscaler and the policy tuner share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.operator import samples

Key = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Interval:
    """What one interval read, shared by every controller of the engine."""

    engine: Mapping[str, Any]  # read at the start of the interval
    ready: Sequence[Mapping[str, Any]]  # the ready pods
    starting: int  # pods that exist, are not terminating, and are not ready yet
    reading: samples.Reading
    now: float  # seconds since the epoch
    # What the ready routers hold, summed, or why that is unknown; None without routing.
    held: float | samples.Problem | None = None


# What a controller records in status, derived from a fresh read of the engine (the status lock
# held): its top-level status fields, and its part of status.controlMemory.
StatusChange = Callable[[Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Step:
    """One controller's interval: what to record, and what to do once it is recorded."""

    record: StatusChange
    then: Callable[[], Awaitable[None]] | None = None


class Controller(Protocol):
    memory: str  # its part of status.controlMemory (control_memory.py)
    # What else of status it alone keeps up to date (fields, condition types): removed when it is
    # turned off, so that status never shows what nothing maintains.
    status_fields: tuple[str, ...]
    condition_types: tuple[str, ...]

    def wants(self, spec: Mapping[str, Any]) -> bool:
        """Whether the engine needs this controller's step every interval."""
        ...

    async def step(self, interval: Interval) -> Step: ...

    def forget(self, key: Key) -> None:
        """Drop what is remembered about an engine whose loop ended."""
        ...
