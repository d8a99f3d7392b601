"""vLLM's `bad_words`, from strings to the token sequences the sampler bans (logits_processors.py)."""

from __future__ import annotations

from typing import Callable

from kvpilot.runtime.request import ParamError


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each word as the text's first word and as a later one (after a space), as vLLM does.

    The spaced form counts only where the space makes a different first token and no extra one:
    a tokenizer that spells the space as a token of its own would otherwise ban every space.
    """
    sequences = []
    for word in words:
        bare = encode(word.lstrip())
        if not bare:
            raise ParamError("bad_words", f"bad word {word!r} is no token at all")
        sequences.append(bare)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences
