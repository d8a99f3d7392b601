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


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Hash the full blocks of the request's tokens that have no hash yet."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        # Salting the first block is enough: the chain carries it into every later hash.
        extra_keys = (request.cache_salt,) if i == 0 and request.cache_salt is not None else None
        parent = hashes[i - 1] if i > 0 else None
        block = tokens[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, extra_keys))
