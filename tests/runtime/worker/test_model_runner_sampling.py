"""The runner reuses its rows' sampling settings from step to step: a request id that comes back
with other parameters must not sample with the old ones."""

from __future__ import annotations

from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.request import Request

PROMPT = [5, 9, 12, 7, 3, 30]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=50.0, seed=3, ignore_eos=True)


def _run(llm: LLM, params: SamplingParams) -> list[int]:
    engine = llm.engine
    engine.add_request(Request("x", PROMPT, params, eos_token_id=None,
                               max_model_len=llm.config.scheduler.max_model_len))
    tokens = []
    while engine.scheduler.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
    return tokens


def test_a_reused_request_id_samples_with_its_new_parameters(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir))
    greedy = _run(llm, GREEDY)
    # The next step both drops the finished "x" and admits the new one into the same row: the
    # batch's request list is what it was, the parameters are not.
    reused = _run(llm, SEEDED)
    fresh = _run(LLM(str(tiny_llama_dir)), SEEDED)
    assert reused == fresh
    assert reused != greedy
