"""A request's prompt as the engines will see it: its token ids and its block hashes, computed
with the served model's tokenizer and chat template and the tenant's cache salt, by the same code
the API server and the KV-cache manager run. A request the router cannot tokenize is still sent
on (the engine says what is wrong with it); it is just placed without knowing its prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvpilot.runtime.core.hashing import hash_block_tokens, hash_blocks
from kvpilot.runtime.server.chat_template import ChatTemplate
from kvpilot.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.runtime.server.tenants import Tenant, TenantRegistry
from kvpilot.runtime.server.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)

# The tokens of a request's affinity key: its first block at the engine's default block size,
# the same for every turn of a conversation.
AFFINITY_TOKENS = 16


class PromptHasher:
    def __init__(self, tokenizers: TokenizerPool, template: ChatTemplate, tenants: TenantRegistry | None) -> None:
        self.tokenizers = tokenizers
        self.template = template
        self.tenants = tenants

    def cache_salt(self, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant | None) -> str | None:
        """The salt the engine will hash the prompt with (serving.py applies the same rule)."""
        return body.cache_salt if tenant is None else self.tenants.cache_salt(tenant, body.cache_salt)

    async def place(self, body: CompletionRequest | ChatCompletionRequest, tenant: Tenant | None,
                    block_sizes: Iterable[int]) -> tuple[dict[int, list[bytes]], bytes]:
        """The prompt's block hashes at each block size, and its affinity key."""
        token_ids = await self._token_ids(body)
        if not token_ids:
            return {}, b""
        salt = self.cache_salt(body, tenant)
        hashes = {size: await self.tokenizers.run(hash_blocks, token_ids, size, salt) for size in set(block_sizes)}
        return hashes, hash_block_tokens(None, token_ids[:AFFINITY_TOKENS], None if salt is None else (salt,))

    async def _token_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
        try:
            if isinstance(body, CompletionRequest):
                prompt = body.prompts[0]
                if isinstance(prompt, list):
                    return prompt
                return await self.tokenizers.encode(prompt, add_special_tokens=True) if prompt else None
            tools = [tool.as_template_input() for tool in body.tools] if body.tools else None
            text = await self.tokenizers.run(self.template.render, [m.as_template_input() for m in body.messages],
                                             body.add_generation_prompt, body.continue_final_message, tools)
            # The template writes the special tokens (BOS included) itself.
            return await self.tokenizers.encode(text, add_special_tokens=False)
        except Exception as err:  # noqa: BLE001 - any failure here is the engine's to report, not the router's
            logger.debug("prompt not tokenized, placed without its prefix: %r", err)
            return None
