"""Incremental detokenization and stop strings, against the tokenizer's own full decode."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvpilot.runtime.engine.detokenizer import IncrementalDetokenizer
from kvpilot.runtime.engine.output_processor import OutputProcessor
from kvpilot.runtime.outputs import EngineCoreOutput
from kvpilot.runtime.request import SamplingParams

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


def _sentencepiece_style_tokenizer() -> Tokenizer:
    """Llama 2's and Mistral's kind of decoder: "▁" marks a space, and the leading one of the text
    decoded is dropped (a text never starts with the space its first word was encoded with)."""
    words = ["the", "capital", "of", "France", "is", "Paris", "in", "spring"]
    vocab = {"<unk>": 0, **{f"▁{word}": i for i, word in enumerate(words, 1)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tokenizer


def test_the_first_output_token_is_decoded_after_the_prompt():
    # A client appends the completion to its prompt: "... is" + " Paris", not "... is" + "Paris".
    tokenizer = _sentencepiece_style_tokenizer()
    prompt = tokenizer.encode("the capital of France is").ids
    output = tokenizer.encode("Paris in spring").ids
    pieces, _ = _stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt), output)
    assert "".join(pieces) == tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):] == " Paris in spring"


def test_a_prompt_tail_cut_inside_a_character_leaves_the_output_whole(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    # The prompt ends in the middle of "ö"'s bytes; the prompt's decode shows a replacement character.
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    pieces, _ = _stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=ids[:cut]), ids[cut:])
    assert "".join(pieces) == TEXT[len(tokenizer.decode(ids[:cut])) - 1:]
    # A long prompt primes the same way: only its tail is decoded.
    pieces, _ = _stream(IncrementalDetokenizer(tokenizer, prompt_token_ids=ids * 50 + ids[:cut]), ids[cut:])
    assert "".join(pieces) == TEXT[len(tokenizer.decode(ids[:cut])) - 1:]


def test_the_output_processor_decodes_each_choice_after_its_prompt():
    tokenizer = _sentencepiece_style_tokenizer()
    prompt = tokenizer.encode("the capital of France is").ids
    processor, deltas = OutputProcessor(tokenizer), []
    processor.add_request("r", "r-0", 0, SamplingParams(max_tokens=2), prompt, deltas.append)
    processor.process_outputs([EngineCoreOutput("r-0", tokenizer.encode("Paris").ids)])
    processor.process_outputs([EngineCoreOutput("r-0", tokenizer.encode("in").ids, finish_reason="length")])
    assert [delta.text for delta in deltas] == [" Paris", " in"]


@pytest.mark.parametrize("stop", [[], ["fox jumps"], ["wörld, caf"], ["日本 the"]])
def test_a_resumed_stream_continues_the_text_of_the_stream_it_resumes(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    full, full_stop = _stream(IncrementalDetokenizer(tokenizer, stop), ids)
    # Piece i is what went out with token i; a stream that ran to its end has a last flush too.
    num_streamed = len(full) if full_stop is not None else len(full) - 1
    for k in range(1, num_streamed):
        resumed, resumed_stop = _stream(IncrementalDetokenizer(tokenizer, stop, resume_token_ids=ids[:k]), ids[k:])
        assert "".join(full[:k]) + "".join(resumed) == "".join(full), k
        assert resumed_stop == full_stop
