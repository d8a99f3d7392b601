"""Penalties, logit bias and token restrictions against their oracle: vLLM's formula, written out
plainly below, applied step by step to transformers' logits on the same checkpoint.

The engine applies them batched (one tensor pass over the rows that ask for them); the reference
walks the tokens one by one. Greedy decoding must agree token for token, and each case must
change the output, or it would prove nothing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from hf_oracle import HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams

NEW_TOKENS = 24


def vllm_reference(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                   eos_token_id: int | None) -> torch.Tensor:
    """One row of logits as vLLM's sampler adjusts it before a greedy pick, in vLLM's order."""
    logits = logits.float().clone()
    if params.allowed_token_ids is not None:
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[params.allowed_token_ids] = True
        logits[~allowed] = float("-inf")
    for word in params.bad_words_token_ids:
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]:
            logits[word[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        for token in [eos_token_id, *params.stop_token_ids]:
            logits[token] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += torch.tensor(bias, dtype=torch.float32)
    repetition = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token, count in Counter(output).items():
        logits[token] -= torch.tensor(params.frequency_penalty, dtype=torch.float32) * count
        logits[token] -= torch.tensor(params.presence_penalty, dtype=torch.float32)
    return logits


def reference_greedy(oracle: HFOracle, prompt: list[int], params: SamplingParams, eos_token_id: int | None) -> list[int]:
    output: list[int] = []
    inputs, cache = prompt, None
    while len(output) < params.max_tokens:
        with torch.no_grad():
            step = oracle.model(torch.tensor([inputs]), cache=cache, use_cache=True)
        cache = step.cache
        token = int(vllm_reference(step.logits[0, -1], prompt, output, params, eos_token_id).argmax())
        inputs = [token]
        output.append(token)
        stops = token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos)
        if len(output) >= params.min_tokens and stops:
            break
    return output


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    model_dir = str(tiny_llama_dir)
    llm = LLM(model_dir)
    vocab = llm.config.model.vocab_size
    return llm, HFOracle(model_dir), vocab, llm.eos_token_id


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **extra)


# Each case's params; the prompts repeat tokens, so prompt-side repetition penalties matter.
CASES = {
    "repetition_up": dict(repetition_penalty=1.8),
    "repetition_down": dict(repetition_penalty=0.4),
    "frequency": dict(frequency_penalty=2.0),
    "presence": dict(presence_penalty=2.0),
    "negative_frequency_and_presence": dict(frequency_penalty=-1.5, presence_penalty=-0.5),
    "all_three_and_a_bias": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                                 logit_bias={5: 3.0, 17: -2.5, 40: 1.25}),
}


def _prompts(vocab: int) -> list[list[int]]:
    base = random_prompts([6, 30, 11], vocab, seed=11)
    # A repeated motif: the prompt mask and a high count for some tokens.
    return [p * 2 for p in base]


def test_penalties_match_vllms_formula_on_transformers_logits(setup):
    llm, oracle, vocab, eos = setup
    prompts = _prompts(vocab)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy())]
    # Every case and a plain request decode in one batch, so rows with and without penalties mix.
    jobs = [(prompt, _greedy(**params)) for params in CASES.values() for prompt in prompts]
    jobs += [(prompts[0], _greedy())]
    outputs = llm.generate([p for p, _ in jobs], [params for _, params in jobs])
    changed = set()
    for (prompt, params), output, name in zip(jobs, outputs, [n for n in CASES for _ in prompts] + ["plain"]):
        expected = reference_greedy(oracle, prompt, params, eos)
        assert output.outputs[0].token_ids == expected, f"{name}: diverged from the reference"
        if expected != plain[prompts.index(prompt)]:
            changed.add(name)
    assert outputs[-1].outputs[0].token_ids == plain[0]
    assert changed == set(CASES), f"cases that did not change greedy output: {set(CASES) - changed}"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_and_min_tokens_survive_preemption(tiny_llama_dir, setup, async_scheduling):
    _, oracle, vocab, eos = setup
    # 16 blocks of 16 for 6 sequences of up to ~84 tokens: recompute preemption must happen, and a
    # resumed request rebuilds its counts from the output it had.
    llm = LLM(str(tiny_llama_dir), num_gpu_blocks_override=16, async_scheduling=async_scheduling)
    prompts = _prompts(vocab) * 2
    params = [_greedy(repetition_penalty=1.5, frequency_penalty=1.0), _greedy(presence_penalty=1.5),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0, min_tokens=NEW_TOKENS - 2,
                             logit_bias={eos: 100.0}, repetition_penalty=1.2)] * 2
    outputs = llm.generate(prompts, params)
    assert llm.get_stats().num_preemptions > 0
    for prompt, p, output in zip(prompts, params, outputs):
        assert output.outputs[0].token_ids == reference_greedy(oracle, prompt, p, eos)


def test_logit_bias_of_100_makes_greedy_emit_the_token(setup):
    llm, _, vocab, _ = setup
    prompt = _prompts(vocab)[1]
    plain = llm.generate([prompt], _greedy())[0].outputs[0].token_ids
    favoured = next(t for t in range(vocab) if t not in plain)
    output = llm.generate([prompt], _greedy(logit_bias={favoured: 100.0}))[0].outputs[0]
    assert output.token_ids == [favoured] * NEW_TOKENS


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(setup):
    llm, oracle, vocab, eos = setup
    prompt = _prompts(vocab)[0]
    stop = next(t for t in range(vocab) if t != eos)
    # The bias makes EOS (or the stop token) the greedy pick at every step: only the mask holds it off.
    for params in (SamplingParams(max_tokens=NEW_TOKENS, temperature=0, min_tokens=7, logit_bias={eos: 100.0}),
                   SamplingParams(max_tokens=NEW_TOKENS, temperature=0, min_tokens=4, stop_token_ids=[stop],
                                  logit_bias={stop: 100.0})):
        output = llm.generate([prompt], params)[0].outputs[0]
        expected = reference_greedy(oracle, prompt, params, eos)
        assert output.token_ids == expected
        assert len(expected) == params.min_tokens + 1 and output.finish_reason == "stop"
        without = llm.generate([prompt], dataclasses.replace(params, min_tokens=0))[0].outputs[0]
        assert len(without.token_ids) == 1


def test_allowed_token_ids_and_bad_words(setup):
    llm, oracle, vocab, eos = setup
    prompt = _prompts(vocab)[2]
    plain = llm.generate([prompt], _greedy())[0].outputs[0].token_ids
    allowed = random_prompts([6], vocab, seed=12)[0]
    # A one-token word banned everywhere, and a two-token word that greedy decoding produces.
    bad_words = [[plain[0]], plain[3:5]]
    for params in (_greedy(allowed_token_ids=allowed), _greedy(bad_words_token_ids=bad_words),
                   _greedy(allowed_token_ids=allowed, repetition_penalty=1.5)):
        output = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert output == reference_greedy(oracle, prompt, params, eos)
        assert output != plain
        if params.allowed_token_ids:
            assert set(output) <= set(allowed)
        else:
            assert plain[0] not in output
            assert all(output[i:i + 2] != plain[3:5] for i in range(len(output) - 1))


def test_seeded_sampling_with_penalties_ignores_its_batch(setup):
    llm, _, vocab, _ = setup
    prompts = _prompts(vocab)
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=7, repetition_penalty=1.4,
                            frequency_penalty=0.5)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    crowd = llm.generate(prompts + [prompts[0]], [_greedy(presence_penalty=1.0), SamplingParams(max_tokens=NEW_TOKENS),
                                                   _greedy(), seeded])
    assert crowd[-1].outputs[0].token_ids == alone
