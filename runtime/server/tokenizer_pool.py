"""Tokenization, chat-template rendering and detokenization off the event loop, on a bounded pool.

The `tokenizers` batch calls release the GIL (the single-text ones do not), so a long prompt
is encoded while the loop keeps answering /health. A chat template is Python (jinja2), which
shares the GIL, but in a thread it gets time slices instead of holding the loop for its whole
run.

A prompt whose size alone proves it cannot fit is refused before it is tokenized: with a
byte-level BPE every token covers at most as many bytes as the vocabulary's longest entry, so a
text of B bytes is at least B / longest tokens long.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenizers import Tokenizer

T = TypeVar("T")


class PromptTooLong(ValueError):
    def __init__(self, min_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt is at least {min_tokens} tokens long, which leaves no room to generate "
                         f"within this model's maximum context length of {limit} tokens")
        self.min_tokens = min_tokens


def max_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most bytes of (normalized) text one token can cover; None when no bound is known.

    Only byte-level BPE maps text to tokens byte for byte; other models (WordPiece's [UNK] can
    stand for a whole word) get no bound.
    """
    if "ByteLevel" not in json.dumps(json.loads(tokenizer.to_str()).get("pre_tokenizer")):
        return None
    # UTF-8 length of each entry: at least the bytes it covers (a byte-level character stands
    # for one byte but may take two), so the bound errs towards letting prompts through.
    return max(len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True))


class TokenizerPool:
    def __init__(self, tokenizer: Tokenizer, workers: int) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenizer")
        self._bytes_per_token = max_bytes_per_token(tokenizer)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to (0 when none is known)."""
        if self._bytes_per_token is None:
            return 0
        normalizer = self.tokenizer.normalizer
        if normalizer is not None:
            # A normalizer may shorten the text (NFC composes characters): bound what it gives.
            text = normalizer.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // self._bytes_per_token)

    async def run(self, function: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def encode(self, text: str, *, add_special_tokens: bool, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; PromptTooLong, before tokenizing, if it surely has max_tokens or more."""
        return await self.run(self._encode, text, add_special_tokens, max_tokens)

    def _encode(self, text: str, add_special_tokens: bool, max_tokens: int | None) -> list[int]:
        if max_tokens is not None:
            least = self.min_tokens(text)
            if least >= max_tokens:
                raise PromptTooLong(least, max_tokens)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    async def decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        return await self.run(self._decode, token_ids, skip_special_tokens)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
