"""A tenant's limit, split among the ready routers: exactly the limit in all, whatever the numbers."""

import pytest

from kvpilot.runtime.router.backends import Endpoint
from kvpilot.runtime.router.peers import RouterPeers


def routers(count: int) -> list[RouterPeers]:
    urls = [f"http://10.0.0.{i}:8000" for i in range(count)]
    fleet = [RouterPeers(url) for url in urls]
    for router in fleet:
        # Each sees the others in its own order: the split must not depend on it.
        router.update([Endpoint(url) for url in reversed(urls)])
    return fleet


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("limit", [1, 2, 4, 7, 10])
def test_the_shares_add_up_to_the_limit(count, limit):
    shares = [router.share(limit) for router in routers(count)]
    assert sum(shares) == limit
    assert max(shares) - min(shares) <= 1


def test_a_router_not_yet_ready_counts_itself_one_more():
    router = RouterPeers("http://10.0.0.9:8000")
    router.update([Endpoint("http://10.0.0.1:8000"), Endpoint("http://10.0.0.9:8000", ready=False),
                   Endpoint("http://10.0.0.2:8000", terminating=True)])
    assert router.peers == ["http://10.0.0.1:8000", "http://10.0.0.9:8000"]
    assert router.share(4) == 2


def test_alone_a_router_takes_the_whole_limit():
    assert RouterPeers("http://10.0.0.1:8000").share(3) == 3
