"""The adapters held in host memory, at most `capacity`, the least recently used evicted first.

The EngineCore and every worker keep one each and make the same calls in the same order (an
adapter loaded through the API, then each slot assignment of each step), so they agree on which
adapters are loaded without asking each other: the workers hold the weights (their own shard), the
EngineCore only the names it reports in its metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from kvpilot.runtime.lora.request import LoRARequest

T = TypeVar("T")


class AdapterLRU(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least one adapter, got capacity {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[LoRARequest, T]] = OrderedDict()

    def use(self, lora: LoRARequest, load: Callable[[LoRARequest], T]) -> T:
        """The adapter's entry, loaded with `load` unless it is held; now the most recently used.
        A load that raises changes nothing."""
        entry = self._entries.get(lora.lora_int_id)
        if entry is not None:
            self._entries.move_to_end(lora.lora_int_id)
            return entry[1]
        value = load(lora)
        self._entries[lora.lora_int_id] = (lora, value)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value

    def remove(self, lora_int_id: int) -> None:
        self._entries.pop(lora_int_id, None)

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._entries

    def loaded(self) -> list[LoRARequest]:
        """The adapters held, least recently used first."""
        return [lora for lora, _ in self._entries.values()]
