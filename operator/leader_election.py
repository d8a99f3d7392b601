"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection package (and so
controller-runtime) does it. Pure: the Lease goes in as the API server served it, the clocks are
parameters, and what to write comes out; leader.py makes the calls.

Invariants (with `LeaseSettings.problems()` empty, and every replica on the same settings):
- A candidate writes itself into a Lease only where the Lease names no holder, names it already,
  or has run out on the candidate's own clock, counted from when it saw the record change
  (`Observation`): another operator's clock is never compared with ours, so clock skew cannot
  shorten a lease.
- Every write carries the resourceVersion read before it, so of two candidates that saw the same
  expired Lease, the API server lets one write (the other gets 409 Conflict and stays standby).
- The holder stops acting `renew_deadline` after the last renewal it sent successfully (by its
  monotonic clock, counted from before the request left). A candidate lets a record it saw change
  expire no sooner than `renew_deadline` after the read that showed the change returned: the old
  holder has stopped before anyone else may start, so two operators never write at once.
- Within that margin, the count starts at the candidate's previous read, the earliest moment the
  change can have landed: a standby that wakes when the count ends takes over within one lease
  duration of the holder's last renewal, not a polling period later.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

API_VERSION = "coordination.k8s.io/v1"
KIND = "Lease"
# client-go's: retries are jittered up to this factor, and must all fit in the renew deadline.
JITTER_FACTOR = 1.2


@dataclass(frozen=True)
class LeaseSettings:
    """controller-runtime's defaults (its LeaseDuration, RenewDeadline and RetryPeriod)."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problems(self) -> list[str]:
        """Why these settings cannot keep two leaders apart; empty when they can."""
        found = []
        if self.renew_deadline >= self.lease_duration:
            found.append(f"the renew deadline ({self.renew_deadline:g}s) must be shorter than the lease"
                         f" duration ({self.lease_duration:g}s): the leader must stop before its lease expires")
        if self.retry_period * JITTER_FACTOR >= self.renew_deadline:
            found.append(f"the renew deadline ({self.renew_deadline:g}s) must exceed {JITTER_FACTOR:g} x the retry"
                         f" period ({self.retry_period:g}s), to try renewing more than once before it")
        if self.retry_period <= 0:
            found.append("the retry period must be positive")
        return found


@dataclass(frozen=True)
class LeaderElection:
    """Which Lease the operator's replicas share, and how they hold it."""

    name: str
    namespace: str
    settings: LeaseSettings


@dataclass(frozen=True)
class Observation:
    """A Lease's record as a candidate last saw it. `since`: when (its monotonic clock) the record
    counts as written, whatever the holder's clock says; `checked`: when it sent the last read
    that returned the record."""

    record: tuple[Any, ...]
    since: float
    checked: float

    @classmethod
    def of(cls, lease: Mapping[str, Any] | None, previous: Observation | None, *, sent: float, received: float,
           settings: LeaseSettings) -> Observation:
        """The record of `lease`, read by a request sent at `sent` that returned at `received`."""
        record = _record(lease)
        if previous is not None and previous.record == record:
            return dataclasses.replace(previous, checked=sent)
        # Written after the previous read was sent, and sent by its writer before this read
        # returned, so its writer stops by `received + renew_deadline`: the lease may not end sooner.
        earliest = previous.checked if previous is not None else -math.inf
        duration = record[2] or 0
        return cls(record, max(earliest, received + settings.renew_deadline - duration), sent)

    @property
    def expires_at(self) -> float:
        """When the record's lease runs out, on the candidate's clock."""
        return self.since + (self.record[2] or 0)


def holder(lease: Mapping[str, Any] | None) -> str:
    """The identity the Lease names; empty where it names none (free, or released)."""
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def may_take(lease: Mapping[str, Any] | None, observed: Observation, identity: str, now: float) -> bool:
    """Whether `identity` may write itself into the Lease now."""
    current = holder(lease)
    return lease is None or current in ("", identity) or now >= observed.expires_at


def claimed(
    lease: Mapping[str, Any] | None, *, name: str, namespace: str, identity: str, settings: LeaseSettings,
    wall: datetime.datetime,
) -> dict[str, Any]:
    """The Lease that says `identity` holds it as of `wall`: created where `lease` is None, else
    a merge patch that the API server refuses (409) unless the Lease is still the one read."""
    spec = (lease or {}).get("spec") or {}
    renewing = lease is not None and holder(lease) == identity
    stamp = micro_time(wall)
    body: dict[str, Any] = {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": max(1, round(settings.lease_duration)),
            "acquireTime": spec.get("acquireTime") if renewing else stamp,
            "renewTime": stamp,
            "leaseTransitions": (spec.get("leaseTransitions") or 0) + (0 if renewing or lease is None else 1),
        },
    }
    if lease is not None:
        body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
    return body


def released(lease: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that hands the Lease back on a clean stop, as client-go's ReleaseOnCancel
    does: no holder, so a standby takes it at its next try rather than a lease duration later."""
    return {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
            "spec": {"holderIdentity": None, "leaseDurationSeconds": 1}}


def micro_time(moment: datetime.datetime) -> str:
    """Kubernetes' MicroTime: RFC 3339 with microseconds."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _record(lease: Mapping[str, Any] | None) -> tuple[Any, ...]:
    spec = (lease or {}).get("spec") or {}
    return (holder(lease), spec.get("renewTime"), spec.get("leaseDurationSeconds"), spec.get("leaseTransitions"))
