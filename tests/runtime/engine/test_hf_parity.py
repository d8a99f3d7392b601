"""The engine against its oracle: Hugging Face transformers greedy decoding on the same checkpoint.

Every engine configuration below must reproduce transformers' greedy tokens exactly, for a batch
of prompts of mixed lengths decoded together.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.worker.step_inputs import StepBuffers

PROMPT_LENGTHS = [1, 3, 17, 40, 64, 99, 150, 200]
SHARED_PREFIX_LEN = 100


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = str(tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir)
    return model_dir, HFOracle(model_dir)


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **extra)


def _assert_matches_oracle(oracle: HFOracle, prompts, outputs) -> None:
    for prompt, output in zip(prompts, outputs):
        expected, _ = oracle.greedy(prompt)
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert output.outputs[0].finish_reason == "length"


ENGINE_CONFIGS = {
    "default": {},
    "chunked_prefill_16": {"max_num_batched_tokens": 16},
    "block_size_4": {"block_size": 4},
    "long_prefill_threshold": {"long_prefill_token_threshold": 24, "max_num_seqs": 3},
    "enforce_eager": {"enforce_eager": True},
    # `auto` is the C kernel on a CPU: the torch reference backend keeps its own parity run, on
    # steps that mix decodes with prefill chunks over small blocks.
    "torch_backend": {"attention_backend": "torch", "max_num_batched_tokens": 16, "block_size": 4},
}


@pytest.mark.parametrize("config_name", ENGINE_CONFIGS)
def test_greedy_matches_transformers(checkpoint, config_name):
    model_dir, oracle = checkpoint
    llm = LLM(model_dir, **ENGINE_CONFIGS[config_name])
    prompts = random_prompts(PROMPT_LENGTHS, llm.config.model.vocab_size, seed=1)
    _assert_matches_oracle(oracle, prompts, llm.generate(prompts, _greedy()))


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_padded_decode_steps_match_transformers(checkpoint, monkeypatch, enforce_eager):
    """Five requests decode as a batch of eight (three padding requests) unless eager."""
    model_dir, oracle = checkpoint
    loads = []
    original = StepBuffers.load

    def spy(self, step, padded_reqs=None, full_block_tables=False):
        loads.append((len(step.req_ids), padded_reqs))
        return original(self, step, padded_reqs, full_block_tables)

    monkeypatch.setattr(StepBuffers, "load", spy)
    llm = LLM(model_dir, enforce_eager=enforce_eager)
    prompts = random_prompts([1, 17, 64, 150, 200], llm.config.model.vocab_size, seed=3)
    _assert_matches_oracle(oracle, prompts, llm.generate(prompts, _greedy()))
    assert ((5, 8) in loads) != enforce_eager
    assert all(padded is None for _, padded in loads) == enforce_eager


def test_greedy_matches_under_preemption(checkpoint):
    model_dir, oracle = checkpoint
    # 8 sequences of up to 232 tokens want ~75 blocks of 16; 24 blocks force recompute preemption.
    llm = LLM(model_dir, num_gpu_blocks_override=24)
    prompts = random_prompts(PROMPT_LENGTHS, llm.config.model.vocab_size, seed=2)
    outputs = llm.generate(prompts, _greedy())
    assert llm.get_stats().num_preemptions > 0
    _assert_matches_oracle(oracle, prompts, outputs)
    assert llm.get_stats().kv_cache_usage == 0.0


def test_prefix_caching_on_and_off_agree(checkpoint):
    model_dir, oracle = checkpoint
    vocab = LLM(model_dir, num_gpu_blocks_override=8).config.model.vocab_size
    prefix = random_prompts([SHARED_PREFIX_LEN], vocab, seed=3)[0]
    prompts = random_prompts([1, 5, 20, 33, 60, 2, 9, 14], vocab, seed=4, prefix=prefix)
    results = {}
    for caching in (True, False):
        llm = LLM(model_dir, enable_prefix_caching=caching)
        # The first request fills the cache; the batch after it shares the prefix.
        results[caching] = llm.generate(prompts[:1], _greedy()) + llm.generate(prompts[1:], _greedy())
        stats = llm.get_stats()
        if caching:
            assert stats.prefix_cache_hits >= 6 * (SHARED_PREFIX_LEN // 16) * 16
        else:
            assert stats.prefix_cache_hits == 0
    assert [o.outputs[0].token_ids for o in results[True]] == [o.outputs[0].token_ids for o in results[False]]
    assert any(o.num_cached_tokens > 0 for o in results[True])
    _assert_matches_oracle(oracle, prompts, results[True])


def test_priority_policy_with_mixed_priorities(checkpoint):
    model_dir, oracle = checkpoint
    llm = LLM(model_dir, scheduling_policy="priority", max_num_seqs=3, num_gpu_blocks_override=24)
    prompts = random_prompts(PROMPT_LENGTHS, llm.config.model.vocab_size, seed=5)
    outputs = llm.generate(prompts, _greedy(), priority=[3, -1, 0, 2, 1, 0, -5, 4])
    _assert_matches_oracle(oracle, prompts, outputs)


def test_llama3_rope_scaling_matches_transformers(tiny_llama3_rope_dir):
    oracle = HFOracle(str(tiny_llama3_rope_dir))
    llm = LLM(str(tiny_llama3_rope_dir), block_size=8)
    # Long enough to reach positions where the scaled frequencies differ from plain RoPE.
    prompts = random_prompts([300, 7], llm.config.model.vocab_size, seed=6)
    _assert_matches_oracle(oracle, prompts, llm.generate(prompts, _greedy()))


def test_linear_rope_scaling_matches_transformers(tiny_llama_dir, edited_checkpoint):
    # How transformers 5 writes a linear-scaled checkpoint's rotary settings (and a GGUF file's
    # rope.scaling.type "linear" becomes).
    rope = json.loads((tiny_llama_dir / "config.json").read_text())["rope_parameters"]
    folder = edited_checkpoint(tiny_llama_dir, rope_parameters={**rope, "rope_type": "linear", "factor": 4.0})
    oracle = HFOracle(str(folder))
    llm = LLM(str(folder), block_size=8)
    prompts = random_prompts([300, 7], llm.config.model.vocab_size, seed=6)
    _assert_matches_oracle(oracle, prompts, llm.generate(prompts, _greedy()))


def test_a_sliding_window_checkpoint_matches_transformers_within_its_window(tiny_llama_dir, edited_checkpoint):
    # Mistral's architecture with a window: transformers masks past it; the engine, which attends over
    # the whole context, caps max_model_len at the window, where both attentions are the same.
    folder = edited_checkpoint(tiny_llama_dir, architectures=["MistralForCausalLM"], model_type="mistral",
                               sliding_window=48)
    llm = LLM(str(folder), block_size=8)
    assert llm.config.scheduler.max_model_len == 48
    prompts = random_prompts([48 - NEW_TOKENS, 5], llm.config.model.vocab_size, seed=8)
    _assert_matches_oracle(HFOracle(str(folder)), prompts, llm.generate(prompts, _greedy()))


def test_logprobs_close_to_transformers(checkpoint):
    model_dir, oracle = checkpoint
    llm = LLM(model_dir, max_num_batched_tokens=32)
    prompts = random_prompts([4, 45, 130], llm.config.model.vocab_size, seed=7)
    outputs = llm.generate(prompts, _greedy(logprobs=5))
    for prompt, output in zip(prompts, outputs):
        expected_tokens, logits = oracle.greedy(prompt)
        reference = torch.log_softmax(logits, dim=-1)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens
        assert len(completion.logprobs) == NEW_TOKENS
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            top = torch.topk(reference[step], 5)
            assert entry[token].rank == 1
            assert abs(entry[token].logprob - reference[step, token].item()) < 1e-4
            assert set(entry) == set(top.indices.tolist()) | {token}
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[token_id].logprob - value) < 1e-4
        assert completion.cumulative_logprob == pytest.approx(
            sum(reference[i, t].item() for i, t in enumerate(expected_tokens)), abs=1e-3
        )


def test_prompt_logprobs_close_to_transformers(checkpoint):
    model_dir, oracle = checkpoint
    # Chunked prefill: the prompt logprobs arrive in several pieces.
    llm = LLM(model_dir, max_num_batched_tokens=16)
    prompt = random_prompts([50], llm.config.model.vocab_size, seed=8)[0]
    output = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    reference = torch.log_softmax(oracle.prompt_logits(prompt), dim=-1)
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        actual = prompt[position]
        expected = reference[position - 1, actual].item()
        assert abs(entry[actual].logprob - expected) < 1e-4
        top = torch.topk(reference[position - 1], 3).indices.tolist()
        assert set(top) <= set(entry)
