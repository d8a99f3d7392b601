"""Which adapter each of the device's `max_loras` slots holds: the scheduler's view of the slots.

Invariants:
- an adapter is in at most one slot, and a slot holds at most one adapter;
- a slot whose adapter a running request uses is never given to another adapter, so at most
  `max_loras` distinct adapters run in one step;
- `acquire` changes nothing when it fails (no slot is free of running requests).

A slot whose adapter no running request uses keeps it: the next request for that adapter finds it
there without a copy. A slot is given to another adapter only when none is empty, the one idle
longest first. Every admission with an adapter is recorded as a LoRAAssignment, which the step
carries to the workers: they fill the slot where it held another adapter, and either way count the
adapter as used in their host caches (loading it again from its path if they had evicted it).
"""

from __future__ import annotations

import itertools

import msgspec

from kvpilot.runtime.lora.request import LoRARequest


class LoRAAssignment(msgspec.Struct, array_like=True, frozen=True):
    slot: int
    lora_request: LoRARequest


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self._adapters: list[LoRARequest | None] = [None] * num_slots
        self._slot_of: dict[int, int] = {}
        # Request id -> the slot it uses, for the running requests that use one.
        self._users: dict[str, int] = {}
        self._num_users = [0] * num_slots
        # When each slot's last user left (or its adapter arrived): the idle longest goes first.
        self._idle_since = [0] * num_slots
        self._clock = itertools.count(1)
        self._assignments: list[LoRAAssignment] = []

    def can_acquire(self, lora: LoRARequest) -> bool:
        return lora.lora_int_id in self._slot_of or self._free_slot() is not None

    def acquire(self, request_id: str, lora: LoRARequest) -> int | None:
        """The slot that holds `lora` for this request (now in use by it), or None when every slot
        is in use by running requests of other adapters."""
        slot = self._slot_of.get(lora.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            previous = self._adapters[slot]
            if previous is not None:
                del self._slot_of[previous.lora_int_id]
            self._adapters[slot] = lora
            self._slot_of[lora.lora_int_id] = slot
        assignment = LoRAAssignment(slot, lora)
        # Many requests of one adapter in a row say it once.
        if not self._assignments or self._assignments[-1] != assignment:
            self._assignments.append(assignment)
        self._users[request_id] = slot
        self._num_users[slot] += 1
        return slot

    def release(self, request_id: str) -> None:
        """The request no longer runs; nothing when it held no slot."""
        slot = self._users.pop(request_id, None)
        if slot is not None:
            self._num_users[slot] -= 1
            if not self._num_users[slot]:
                self._idle_since[slot] = next(self._clock)

    def take_assignments(self) -> list[LoRAAssignment]:
        """The admissions' assignments since the last call, in the order they were made."""
        assignments, self._assignments = self._assignments, []
        return assignments

    def running_adapters(self) -> list[str]:
        """The names of the adapters that running requests use."""
        return [lora.lora_name for lora, users in zip(self._adapters, self._num_users) if users]

    def _free_slot(self) -> int | None:
        idle = [slot for slot, users in enumerate(self._num_users) if not users]
        if not idle:
            return None
        empty = [slot for slot in idle if self._adapters[slot] is None]
        return empty[0] if empty else min(idle, key=self._idle_since.__getitem__)
