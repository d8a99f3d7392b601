"""--stream-interval: the OutputProcessor gathers a choice's tokens into fewer, larger deltas."""

from __future__ import annotations

import pytest

from kvpilot.runtime.engine.output_processor import OutputProcessor
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.outputs import EngineCoreOutput, TokenLogprobs
from kvpilot.runtime.request import SamplingParams

TOKENS = list(range(40, 50))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))[0]


def _deliver(tokenizer, interval: int, params: SamplingParams):
    """Feeds TOKENS one step at a time (the last step finishes with "length"); the deltas, and
    which steps returned the choice as stopped by a stop string."""
    processor = OutputProcessor(tokenizer, stream_interval=interval)
    deltas = []
    processor.add_request("r", "r-0", 0, params, prompt_token_ids=[1, 2, 3], sink=deltas.append)
    stopped_at = []
    last = len(TOKENS) - 1
    for step, token in enumerate(TOKENS):
        logprobs = [TokenLogprobs([token], [-0.5], [1])] if params.logprobs is not None else None
        output = EngineCoreOutput("r-0", [token], new_logprobs=logprobs,
                                  finish_reason="length" if step == last else None)
        if processor.process_outputs([output]):
            stopped_at.append(step)
    return deltas, stopped_at


def test_deltas_gather_interval_tokens_after_the_first(tokenizer):
    params = SamplingParams(max_tokens=len(TOKENS), logprobs=0)
    one_by_one, _ = _deliver(tokenizer, 1, params)
    gathered, _ = _deliver(tokenizer, 4, params)
    assert [len(d.token_ids) for d in one_by_one] == [1] * len(TOKENS)
    # The first token at once; then 4 at a time; the end at once with what is left.
    assert [len(d.token_ids) for d in gathered] == [1, 4, 4, 1]
    assert [t for d in gathered for t in d.token_ids] == TOKENS
    assert "".join(d.text for d in gathered) == "".join(d.text for d in one_by_one)
    assert [len(d.logprobs) for d in gathered] == [1, 4, 4, 1]
    assert [d.finish_reason for d in gathered] == [None, None, None, "length"]
    assert [d.num_output_tokens for d in gathered] == [1, 5, 9, 10]


def test_a_stop_string_is_reported_at_once_while_tokens_are_held(tokenizer):
    text = tokenizer.decode(TOKENS[:6])
    stop = text[len(tokenizer.decode(TOKENS[:4])):]  # what tokens 5 and 6 add
    params = SamplingParams(max_tokens=len(TOKENS), stop=[stop])
    deltas, stopped_at = _deliver(tokenizer, 8, params)
    # The engine must hear of it at the step that completed the stop string, not later.
    assert stopped_at == [5]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert "".join(d.text for d in deltas) == tokenizer.decode(TOKENS[:4])
