"""What names an adapter wherever a request travels: the API server, the scheduler, the workers."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """An adapter as vLLM's LoRARequest names it.

    `lora_int_id` is given once per load by the API server and never reused, so an adapter
    unloaded and loaded again under the same name (perhaps from another folder) is another adapter
    to the prefix cache and to the workers' caches. The path travels with every request so that a
    worker can load the adapter again after its host cache evicted it.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
