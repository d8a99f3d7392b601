"""Taking and holding the operator's Lease: the calls and the clock around leader_election.py.

`acquire()` returns once this operator holds the Lease; `hold()` renews it every retry period and
returns only when a whole renew deadline passed without a renewal, or another operator holds it:
the caller must then stop acting at once (run.py ends the process, as controller-runtime does).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import socket
import time
import uuid
from collections.abc import Callable

from kvpilot.operator import kube, leader_election
from kvpilot.operator.leader_election import LeaseSettings, Observation

logger = logging.getLogger(__name__)


def identity() -> str:
    """client-go's: the host (the pod's name) and a UUID, unique to this process."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


class Elector:
    def __init__(
        self,
        client: kube.Kube,
        *,
        name: str,
        namespace: str,
        identity: str,
        settings: LeaseSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._name = name
        self._namespace = namespace
        self.identity = identity
        self._settings = settings
        self._clock = clock
        self._url = kube.path(leader_election.API_VERSION, leader_election.KIND, namespace, name)
        self._observed: Observation | None = None
        self._renewed_at: float | None = None  # when the last successful renewal was sent

    @property
    def renewed_at(self) -> float | None:
        """When (the monotonic clock) the last successful renewal was sent; None before any."""
        return self._renewed_at

    async def acquire(self) -> None:
        """Try until this operator holds the Lease: every retry period, and as the holder's lease ends."""
        announced = ""
        while True:
            sent = self._clock()
            # As long as a renewal may take: a slow API server delays the takeover, never stops it.
            timeout = self._settings.renew_deadline
            try:
                if await asyncio.wait_for(self._try(timeout), timeout):
                    self._renewed_at = sent
                    logger.info(f"Holding Lease {self._namespace}/{self._name} as {self.identity}: leading")
                    return
            except (kube.ApiError, TimeoutError) as error:
                logger.warning(f"Could not read or take Lease {self._namespace}/{self._name}: {error!r}")
            holder = self._observed.record[0] if self._observed else ""
            if holder and holder != announced:
                logger.info(f"Lease {self._namespace}/{self._name} is held by {holder}: standing by")
                announced = holder
            await asyncio.sleep(self._until_next_try())

    def _until_next_try(self) -> float:
        """A retry period (jittered, as client-go does), or less where the holder's lease runs out
        sooner: a standby that polled just before the holder died takes over as the lease ends."""
        retry = self._settings.retry_period * random.uniform(1, leader_election.JITTER_FACTOR)
        left = self._observed.expires_at - self._clock() if self._observed is not None else 0.0
        return min(retry, left) if left > 0 else retry

    async def hold(self) -> None:
        """Renew until the Lease is lost; see the module's docstring."""
        assert self._renewed_at is not None, "acquire() first"
        while True:
            await asyncio.sleep(self._settings.retry_period)
            if not await self._renew():
                return

    async def release(self) -> None:
        """Hand the Lease back on a clean stop, so that a standby need not wait for it to expire."""
        timeout = self._settings.retry_period
        try:
            lease = await self._client.get_once(self._url, timeout=timeout)
            if lease is not None and leader_election.holder(lease) == self.identity:
                await self._client.patch_once(self._url, leader_election.released(lease), timeout=timeout)
                logger.info(f"Released Lease {self._namespace}/{self._name}")
        except (kube.ApiError, TimeoutError) as error:
            logger.warning(f"Could not release Lease {self._namespace}/{self._name}; it expires instead: {error!r}")

    async def _renew(self) -> bool:
        """Retry until the renew deadline; False once it passed, or another operator holds the Lease."""
        assert self._renewed_at is not None
        deadline = self._renewed_at + self._settings.renew_deadline
        while (remaining := deadline - self._clock()) > 0:
            sent = self._clock()
            try:
                if await asyncio.wait_for(self._try(remaining), remaining):
                    self._renewed_at = sent
                    return True
                holder = self._observed.record[0] if self._observed else ""
                if holder != self.identity:
                    logger.error(f"Lease {self._namespace}/{self._name} is held by {holder!r} now")
                    return False
                # A write raced this one (409): the next read says who holds the Lease.
            except (kube.ApiError, TimeoutError) as error:
                logger.warning(f"Could not renew Lease {self._namespace}/{self._name}: {error!r}")
            await asyncio.sleep(max(0.0, min(self._settings.retry_period, deadline - self._clock())))
        logger.error(f"Could not renew Lease {self._namespace}/{self._name} within the renew deadline"
                     f" ({self._settings.renew_deadline:g}s)")
        return False

    async def _try(self, timeout: float) -> bool:
        """One read and, where this operator may, one write of the Lease: whether it holds it now."""
        sent = self._clock()
        lease = await self._client.get_once(self._url, timeout=timeout)
        self._observed = Observation.of(lease, self._observed, sent=sent, received=self._clock(),
                                        settings=self._settings)
        if not leader_election.may_take(lease, self._observed, self.identity, self._clock()):
            return False
        claim = leader_election.claimed(lease, name=self._name, namespace=self._namespace, identity=self.identity,
                                        settings=self._settings, wall=datetime.datetime.now(datetime.UTC))
        try:
            if lease is None:
                await self._client.create_once(claim, timeout=timeout)
            else:
                await self._client.patch_once(self._url, claim, timeout=timeout)
        except kube.ApiError as error:
            if error.status == 409:
                return False  # another candidate wrote first; the next read shows who
            raise
        return True
