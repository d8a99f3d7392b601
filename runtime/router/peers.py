"""The routers of one fleet, and this router's share of each tenant's limit.

A tenant's `maxConcurrentRequests` holds across the fleet with no store the routers share: the
ready routers, sorted by address, split each limit L among themselves, router i of N taking
L // N, plus one where i < L % N. Together they admit exactly L (the engines keep their own
per-replica limits as a backstop).

The error this leaves, by design:
- A router whose share is taken refuses (429) while another has room, when a tenant's requests
  reach the routers unevenly: a tenant may be refused below its limit, never admitted above it.
  A share can be 0 (a limit smaller than the routers): that router refuses the tenant always.
- While the routers do not see the same peers (one starting or leaving), the shares can add up to
  one router's share more or less than L, until every router has seen the change.
A router that does not find itself among the ready peers (not ready yet) counts itself one more.
"""

from __future__ import annotations

from kvpilot.runtime.router.backends import Endpoint


class RouterPeers:
    def __init__(self, own_url: str) -> None:
        self.own_url = own_url
        self.peers: list[str] = [own_url]

    def update(self, endpoints: list[Endpoint]) -> None:
        ready = sorted({e.url for e in endpoints if e.ready and not e.terminating})
        self.peers = ready if self.own_url in ready else [*ready, self.own_url]

    def share(self, limit: int) -> int:
        count, index = len(self.peers), self.peers.index(self.own_url)
        return limit // count + (1 if index < limit % count else 0)
