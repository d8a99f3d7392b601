"""Incremental detokenization and stop strings, against the tokenizer's own full decode."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from kvpilot.runtime.engine.detokenizer import IncrementalDetokenizer

TEXT = "Hello wörld, café! 日本 the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


def _stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], str | None]:
    pieces = []
    for token_id in token_ids:
        stop = detokenizer.update([token_id])
        pieces.append(detokenizer.take_new_text(finished=stop is not None))
        if stop is not None:
            return pieces, stop
    pieces.append(detokenizer.take_new_text(finished=True))
    return pieces, None


def test_streamed_text_equals_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    pieces, stop = _stream(IncrementalDetokenizer(tokenizer), ids)
    assert stop is None
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    # Multi-byte characters split across byte-level tokens never come out half-made.
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("hi there", add_special_tokens=True).ids
    assert ids[0] == tokenizer.token_to_id("<|begin_of_text|>")
    pieces, _ = _stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == "hi there"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(tokenizer, include):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["brown", "lazy"], include_stop_str_in_output=include)
    pieces, stop = _stream(detokenizer, ids)
    assert stop == "brown"
    expected = TEXT[: TEXT.index("brown") + (len("brown") if include else 0)]
    assert "".join(pieces) == expected


def test_nothing_of_a_stop_string_leaks_before_it_completes(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["fox jumps"])
    streamed = ""
    for token_id in ids:
        stop = detokenizer.update([token_id])
        streamed += detokenizer.take_new_text(finished=stop is not None)
        if stop is not None:
            break
        assert "fox" not in streamed
    assert streamed == TEXT[: TEXT.index("fox jumps")]


def test_earliest_stop_string_wins_within_one_update(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["dog", "quick"])
    assert detokenizer.update(ids) == "quick"
    assert detokenizer.take_new_text(finished=True) == TEXT[: TEXT.index("quick")]


def test_the_detokenizer_keeps_only_the_text_not_taken_yet(tokenizer):
    # What a stop-string search touches per token is what is kept: it must not grow with the output.
    ids = tokenizer.encode(TEXT * 400, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["never appears", "nor this one"])
    kept = []
    for token_id in ids:
        assert detokenizer.update([token_id]) is None
        detokenizer.take_new_text(finished=False)
        kept.append(sum(len(value) for value in vars(detokenizer).values() if isinstance(value, str)))
    assert max(kept) <= len("never appears") + max(len(tokenizer.decode([t])) for t in ids)
