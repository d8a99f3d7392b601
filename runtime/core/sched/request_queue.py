"""The waiting queue, in the two orders the scheduler knows: arrival (FCFS) and priority."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvpilot.runtime.config import SchedulingPolicy
from kvpilot.runtime.request import Request


class RequestQueue(ABC):
    """Waiting requests in scheduling order; the head is the next one to admit."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put back a request that must run before the others (a preempted one)."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The head; IndexError when empty."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Take the head out; IndexError when empty."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Take out a request anywhere in the queue; KeyError when it is not there."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every request once, in scheduling order."""

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.remove_request(request)

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order, with preempted requests put back at the head."""

    def __init__(self) -> None:
        # An OrderedDict moves an entry to the front in O(1), which a plain dict cannot.
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def add_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def prepend_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._requests.move_to_end(request.request_id, last=False)

    def peek_request(self) -> Request:
        if not self._requests:
            raise IndexError("peek from an empty request queue")
        return next(iter(self._requests.values()))

    def pop_request(self) -> Request:
        if not self._requests:
            raise IndexError("pop from an empty request queue")
        return self._requests.popitem(last=False)[1]

    def remove_request(self, request: Request) -> None:
        del self._requests[request.request_id]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        # A snapshot, so that callers may remove what they iterate over.
        return iter(list(self._requests.values()))


PriorityKey = tuple[int, float, str]


def priority_key(request: Request) -> PriorityKey:
    """Lowest first: lower priority value, then earlier arrival, then request id."""
    return (request.priority, request.arrival_time, request.request_id)


class PriorityRequestQueue(RequestQueue):
    """Ordered by `priority_key`; a preempted request simply goes back to its place."""

    def __init__(self) -> None:
        # The heap holds keys only, so a removed request's key can linger there (lazy
        # deletion) and is dropped when it reaches the top; `_requests` says what is live. A
        # key is live only while it is its request's own: an id can come back with a new key.
        self._heap: list[PriorityKey] = []
        self._requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        heapq.heappush(self._heap, priority_key(request))

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        self._drop_removed_head()
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._requests[self._heap[0][2]]

    def pop_request(self) -> Request:
        self._drop_removed_head()
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return self._requests.pop(heapq.heappop(self._heap)[2])

    def remove_request(self, request: Request) -> None:
        del self._requests[request.request_id]
        # Rebuilding once stale keys outnumber live ones keeps the heap O(live) and each
        # removal O(1) amortised.
        if len(self._heap) > 2 * len(self._requests) + 16:
            self._heap = [priority_key(r) for r in self._requests.values()]
            heapq.heapify(self._heap)

    def _drop_removed_head(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)

    def _is_live(self, key: PriorityKey) -> bool:
        request = self._requests.get(key[2])
        return request is not None and priority_key(request) == key

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._requests.values(), key=priority_key))


_QUEUES: dict[SchedulingPolicy, type[RequestQueue]] = {
    SchedulingPolicy.FCFS: FCFSRequestQueue,
    SchedulingPolicy.PRIORITY: PriorityRequestQueue,
}


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """ValueError naming the policy when it is not one the scheduler knows."""
    return _QUEUES[SchedulingPolicy.parse(policy)]()
