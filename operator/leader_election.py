"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection package (and so
controller-runtime) does it. Pure: the Lease goes in as the API server served it, the clocks are
parameters, and what to write comes out; leader.py makes the calls.

Invariants (with `LeaseSettings.problems()` empty):
- A candidate writes itself into a Lease only where the Lease names no holder, names it already,
  or has not changed for a whole lease duration by the candidate's own clock (`Observation`):
  another operator's clock is never compared with ours, so clock skew cannot shorten a lease.
- Every write carries the resourceVersion read before it, so of two candidates that saw the same
  expired Lease, the API server lets one write (the other gets 409 Conflict and stays standby).
- The holder stops acting `renew_deadline` after the last renewal it sent successfully (by its
  monotonic clock, counted from before the request left). Any other candidate saw that renewal no
  earlier than it was sent and waits `lease_duration` > `renew_deadline` from then: the old
  holder has stopped before anyone else may start, so two operators never write at once.
"""

from __future__ import annotations

import datetime
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
    """A Lease's record as a candidate last saw it, and when (its monotonic clock) it first saw
    that record: the lease runs from then, whatever the holder's clock says."""

    record: tuple[Any, ...]
    since: float

    @classmethod
    def of(cls, lease: Mapping[str, Any] | None, previous: Observation | None, now: float) -> Observation:
        record = _record(lease)
        if previous is not None and previous.record == record:
            return previous
        return cls(record, now)


def holder(lease: Mapping[str, Any] | None) -> str:
    """The identity the Lease names; empty where it names none (free, or released)."""
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def may_take(lease: Mapping[str, Any] | None, observed: Observation, identity: str, now: float) -> bool:
    """Whether `identity` may write itself into the Lease now."""
    current = holder(lease)
    if lease is None or current in ("", identity):
        return True
    duration = (lease.get("spec") or {}).get("leaseDurationSeconds") or 0
    return now - observed.since >= duration


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
