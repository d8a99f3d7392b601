"""The LoRA adapters the server serves, by the name a request gives as its `model`.

vLLM's routes and answers: POST /v1/load_lora_adapter loads one live ({"lora_name", "lora_path"}),
POST /v1/unload_lora_adapter unloads one ({"lora_name"}); `--lora-modules name=path` loads some at
start. Each load gets a new id (LoRARequest), never reused: an adapter loaded again under the same
name shares no KV and no cached weights with the one before it.

Who may use an adapter is the tenants file's say (TenantRegistry.may_use_adapter). A request that
names an adapter its tenant may not use gets the same 404 as one that names no adapter at all, and
/v1/models does not list it: nothing tells a tenant that another tenant's adapter exists.
"""

from __future__ import annotations

import asyncio
import itertools

from kvpilot.runtime.engine.async_llm import AsyncLLM
from kvpilot.runtime.lora.request import LoRARequest
from kvpilot.runtime.server.errors import APIError, bad_request
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry


def model_not_found(model: str, base_model: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist (this server serves {base_model!r})",
                    param="model", code="model_not_found")


class ServedAdapters:
    def __init__(self, engine: AsyncLLM, base_model: str, tenants: TenantRegistry | None) -> None:
        self.engine = engine
        self.base_model = base_model
        self.tenants = tenants
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        # One load or unload at a time: two loads of one name must not both pass the check.
        self._lock = asyncio.Lock()

    def resolve(self, model: str | None, tenant: Tenant | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name that is
        neither the base model nor an adapter the tenant may use."""
        if model is None or model == self.base_model:
            return None
        lora = self._adapters.get(model)
        if lora is None or not self._may_use(tenant, model):
            raise model_not_found(model, self.base_model)
        return lora

    def visible(self, tenant: Tenant | None, *, everything: bool = False) -> list[LoRARequest]:
        """The adapters `tenant` may use, in load order; all of them with `everything` (the admin)."""
        return [lora for name, lora in self._adapters.items() if everything or self._may_use(tenant, name)]

    async def load(self, name: str, path: str) -> LoRARequest:
        """400 naming the adapter and the problem when it cannot be loaded; the engine and the other
        adapters keep serving."""
        if not self.engine.config.lora.enable_lora:
            raise bad_request("LoRA adapters are not enabled on this server (--enable-lora)", "lora_name")
        async with self._lock:
            if name == self.base_model or name in self._adapters:
                raise bad_request(f"the LoRA adapter {name!r} has already been loaded" if name in self._adapters
                                  else f"{name!r} is the base model's name", "lora_name")
            lora = LoRARequest(name, next(self._ids), path)
            try:
                await self.engine.add_lora(lora)
            except ValueError as err:
                raise bad_request(str(err), "lora_path") from err
            self._adapters[name] = lora
        return lora

    async def unload(self, name: str) -> None:
        """404 for an adapter that is not loaded."""
        async with self._lock:
            lora = self._adapters.pop(name, None)
            if lora is None:
                raise APIError(404, f"the LoRA adapter {name!r} is not loaded", param="lora_name",
                               code="not_found")
            await self.engine.remove_lora(lora.lora_int_id)

    def _may_use(self, tenant: Tenant | None, name: str) -> bool:
        return self.tenants is None or self.tenants.may_use_adapter(tenant, name)
