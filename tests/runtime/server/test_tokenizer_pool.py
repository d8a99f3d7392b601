"""The tokenizer pool: off-loop encoding, and the size bound that refuses a prompt before it is tokenized."""

from __future__ import annotations

import asyncio
import random

import pytest
from tokenizers import Tokenizer

from kvpilot.runtime.server.tokenizer_pool import PromptTooLong, TokenizerPool, max_bytes_per_token

SAMPLES = ["Hello wörld, café! 日本 the quick brown fox", "e\u0301 combining, \ud55c\uad6d\uc5b4 hangul", "   \n\t spaces",
           "🙂" * 20, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


@pytest.fixture
def pool(tokenizer):
    pool = TokenizerPool(tokenizer, workers=2)
    yield pool
    pool.shutdown()


def test_the_size_bound_never_exceeds_the_true_count(tokenizer, pool):
    rng = random.Random(0)
    alphabet = "".join(SAMPLES)
    texts = SAMPLES + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400))) for _ in range(200)]
    assert max_bytes_per_token(tokenizer) is not None
    for text in texts:
        assert pool.min_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False).ids), text


def test_encoding_matches_the_tokenizer(tokenizer, pool):
    for text in SAMPLES:
        for special in (True, False):
            got = asyncio.run(pool.encode(text, add_special_tokens=special))
            assert got == tokenizer.encode(text, add_special_tokens=special).ids
    ids = tokenizer.encode(SAMPLES[0]).ids
    assert asyncio.run(pool.decode(ids, skip_special_tokens=False)) == tokenizer.decode(ids, skip_special_tokens=False)


class _Untouchable:
    """Stands in for the tokenizer's encoder: a prompt refused by its size must never reach it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.normalizer = tokenizer.normalizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode_batch(self, *args, **kwargs):
        raise AssertionError("a prompt too long by its size alone was tokenized")


def test_a_prompt_too_long_by_its_size_is_refused_without_tokenizing(tokenizer, pool):
    pool.tokenizer = _Untouchable(tokenizer)
    text = "hello world " * 10_000
    with pytest.raises(PromptTooLong) as raised:
        asyncio.run(pool.encode(text, add_special_tokens=True, max_tokens=2048))
    assert raised.value.min_tokens >= 2048 and "2048" in str(raised.value)
