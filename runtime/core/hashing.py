"""Block hashes for prefix caching: chained sha256 over full blocks of tokens."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.runtime.request import Request

BlockHash = bytes


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None
) -> BlockHash:
    """Hash one full block, chained to the hash of the block before it.

    JSON of a fixed-shape list is canonical and unambiguous (token boundaries, None vs empty
    are all explicit), and unlike pickle or hash() it is stable across processes and versions.
    A non-JSON extra key raises instead of being hashed by its repr.
    """
    payload = [
        None if parent is None else parent.hex(),
        [int(t) for t in token_ids],
        None if extra_keys is None else list(extra_keys),
    ]
    encoded = json.dumps(payload, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(encoded.encode("ascii")).digest()


def first_block_extra_keys(cache_salt: str | None, lora_int_id: int | None = None) -> tuple | None:
    """What the first block's hash mixes in besides its tokens: the cache salt, and the LoRA
    adapter's id, so that two adapters (or an adapter and the base model) never share KV. Keying
    the first block is enough: the chain carries it into every later hash."""
    if lora_int_id is None:
        return None if cache_salt is None else (cache_salt,)
    return (cache_salt, lora_int_id)


def hash_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str | None, *,
                start: int = 0, parent: BlockHash | None = None, lora_int_id: int | None = None) -> list[BlockHash]:
    """The hashes of the full blocks of `token_ids` from block `start` on; `parent` is the hash of
    block `start - 1`. The router hashes a prompt with this, as the engine does, to know which
    replica holds its blocks."""
    hashes = []
    first_keys = first_block_extra_keys(cache_salt, lora_int_id)
    for i in range(start, len(token_ids) // block_size):
        extra_keys = first_keys if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Hash the full blocks of the request's tokens that have no hash yet."""
    hashes = request.block_hashes
    lora = request.lora_request
    hashes += hash_blocks(request.all_token_ids, block_size, request.cache_salt, start=len(hashes),
                          parent=hashes[-1] if hashes else None, lora_int_id=lora and lora.lora_int_id)
