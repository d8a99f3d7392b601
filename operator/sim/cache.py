"""A replica's prefix cache: which KV blocks it holds, as the engine's block pool keeps them.

A block is an id: block j of conversation c, except the leading blocks that hold only the shared
system prompt, which have the same id in every conversation (so every conversation can hit them).
A block stays pinned while a running request uses it. When none does, it stays cached until the
pool needs its room, least recently freed first: the engine's lazy eviction. A request frees its
blocks last first, so a conversation loses its tail before its head, as in the engine.
"""

from __future__ import annotations

from collections import OrderedDict

# Block ids: conversation c's block j is c * _STRIDE + j; a shared block j is j (conversation 0).
_STRIDE = 1 << 32
SHARED = 0


def block_id(conversation: int, shared_blocks: int, j: int) -> int:
    return j if j < shared_blocks else conversation * _STRIDE + j


class PrefixCache:
    __slots__ = ("free", "pins", "held")

    def __init__(self) -> None:
        self.free: OrderedDict[int, None] = OrderedDict()  # unpinned, least recently freed first
        self.pins: dict[int, int] = {}  # block -> running requests using it
        self.held: dict[int, int] = {}  # conversation -> its blocks here, pinned or free

    def __len__(self) -> int:
        return len(self.free) + len(self.pins)

    def leading(self, conversation: int, shared_blocks: int, count: int) -> int:
        """How many of the first `count` blocks are held, from the first block on."""
        held = self.held
        if conversation not in held:
            # None of its own: at most the shared ones, all of them when all are held.
            if held.get(SHARED, 0) == shared_blocks:
                return min(shared_blocks, count)
            count = min(shared_blocks, count)
        free, pins = self.free, self.pins
        j = 0
        while j < count:
            block = j if j < shared_blocks else conversation * _STRIDE + j
            if block not in free and block not in pins:
                break
            j += 1
        return j

    def pin(self, conversation: int, shared_blocks: int, start: int, end: int) -> None:
        """Blocks start..end-1 are in use by one more request (computed by it if not held)."""
        free, pins, held = self.free, self.pins, self.held
        for j in range(start, end):
            block = j if j < shared_blocks else conversation * _STRIDE + j
            users = pins.get(block)
            if users is not None:
                pins[block] = users + 1
                continue
            if block in free:
                del free[block]
            else:
                owner = SHARED if j < shared_blocks else conversation
                held[owner] = held.get(owner, 0) + 1
            pins[block] = 1

    def release(self, conversation: int, shared_blocks: int, pinned: int, computed: int) -> None:
        """A request stops using its blocks 0..pinned-1, and leaves pinned..computed-1 (which it
        computed without pinning them: its output's) cached, last first."""
        free, pins, held = self.free, self.pins, self.held
        for j in range(max(pinned, computed) - 1, -1, -1):
            block = j if j < shared_blocks else conversation * _STRIDE + j
            users = pins.get(block)
            if j < pinned:
                if users > 1:
                    pins[block] = users - 1
                    continue
                del pins[block]
            elif users is not None:
                continue  # another request of the conversation has it in use
            elif block not in free:
                owner = SHARED if j < shared_blocks else conversation
                held[owner] = held.get(owner, 0) + 1
            free[block] = None
            free.move_to_end(block)

    def trim(self, room: int) -> None:
        """Evict the least recently freed blocks until the free ones fit in `room` blocks."""
        free, held = self.free, self.held
        while len(free) > max(room, 0):
            block, _ = free.popitem(last=False)
            owner = block // _STRIDE
            if held[owner] == 1:
                del held[owner]
            else:
                held[owner] -= 1
