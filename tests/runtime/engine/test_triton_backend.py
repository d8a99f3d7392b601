"""The whole engine on the Triton kernels (under the interpreter on a CPU) against the torch
backend and transformers: same greedy tokens, logprobs within float tolerance.

Chunked prefill with tiny blocks makes steps that mix decode rows with prefill chunks over a
cached context, and a shared prefix makes later prompts start from prefix-cache hits.
"""

from __future__ import annotations

import pytest

from hf_oracle import HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams

NUM_TOKENS = 6
ENGINE = {"max_num_batched_tokens": 16, "block_size": 4, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def results(tiny_llama_dir):
    model_dir = str(tiny_llama_dir)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model_dir, attention_backend=backend, **ENGINE)
        vocab = llm.config.model.vocab_size
        prefix = random_prompts([9], vocab, seed=11)[0]
        prompts = random_prompts([1, 13, 30], vocab, seed=12) + random_prompts([2, 6], vocab, seed=13, prefix=prefix)
        # The first call caches the shared prefix; the second starts its prompts from it.
        outputs[backend] = llm.generate(prompts[:3] + prompts[3:4], params) + llm.generate(prompts[4:], params)
        assert llm.get_stats().prefix_cache_hits > 0
    return HFOracle(model_dir), prompts, outputs


def test_greedy_tokens_match_torch_backend_and_transformers(results):
    oracle, prompts, outputs = results
    for prompt, torch_out, triton_out in zip(prompts, outputs["torch"], outputs["triton"]):
        expected = oracle.greedy(prompt)[0][:NUM_TOKENS]
        assert triton_out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert torch_out.outputs[0].token_ids == expected


def test_logprobs_match_torch_backend(results):
    _, _, outputs = results
    for torch_out, triton_out in zip(outputs["torch"], outputs["triton"]):
        for token, torch_step, triton_step in zip(
            triton_out.outputs[0].token_ids, torch_out.outputs[0].logprobs, triton_out.outputs[0].logprobs
        ):
            assert triton_step[token].logprob == pytest.approx(torch_step[token].logprob, abs=1e-4)
