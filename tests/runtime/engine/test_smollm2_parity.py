"""The engine against transformers on a trained model: SmolLM2-135M-Instruct from its GGUF file.

Both sides load the same file: transformers (`gguf_file=`) dequantizes it to float32; the engine
keeps its Q4_1 and Q8_0 matrices packed (the default `--quantization auto`) and multiplies them
with the quantized matmul, which equals float32 matmul on the same dequantized weights up to
summation order. The engine decodes 8 chat prompts in one batch, at TP 1 and TP 3 (row-parallel
shards of 192 and 512 inputs: whole Q4_1 blocks).

Greedy decoding takes, at each step, the argmax given the tokens before it. So transformers'
greedy continuation equals the engine's exactly when every engine token is transformers' argmax
at its position, which one forward pass over prompt + output shows for all 24 steps at once
(a 24-step `generate` per prompt costs 24 passes, too many for a 2-core CI machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_oracle import HFOracle
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.models.gguf_checkpoint import open_gguf
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.server.chat_template import ChatTemplate

# Each sequence decodes across KV blocks (16 tokens) in 24 steps; a step at TP 3, three ranks on a
# 2-core machine, is a long one.
NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name a famous painting by Leonardo da Vinci.",
    "How do I reverse a list in Python?",
]


@pytest.fixture(scope="module")
def oracle(smollm2_gguf) -> HFOracle:
    return HFOracle(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def prompts(smollm2_gguf) -> list[list[int]]:
    tokenizer, tokenizer_config = load_tokenizer(str(smollm2_gguf))
    template = ChatTemplate(tokenizer_config)
    return [tokenizer.encode(template.render([{"role": "user", "content": q}]), add_special_tokens=False).ids
            for q in QUESTIONS]


def test_both_sides_run_the_same_dequantized_weights(smollm2_gguf, oracle):
    reference = oracle.model.state_dict()
    checkpoint = open_gguf(str(smollm2_gguf))
    for name, weight in checkpoint.iterate_weights(num_heads=9, num_kv_heads=3):
        np.testing.assert_array_equal(weight, reference[name].numpy(), err_msg=name)


@pytest.mark.parametrize("tensor_parallel_size", [1, 3])
def test_greedy_tokens_and_logprobs_match_transformers(smollm2_gguf, oracle, prompts, tensor_parallel_size):
    llm = LLM(str(smollm2_gguf), tensor_parallel_size=tensor_parallel_size, max_model_len=512)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
        outputs = llm.generate(prompts, params)
    finally:
        llm.engine.shutdown()
    for question, prompt, output in zip(QUESTIONS, prompts, outputs):
        completion = output.outputs[0]
        assert len(completion.token_ids) == NEW_TOKENS
        # Row i: transformers' next-token logits after prompt + the first i generated tokens.
        logits = oracle.prompt_logits(prompt + completion.token_ids)[len(prompt) - 1 : -1]
        assert logits.argmax(dim=-1).tolist() == completion.token_ids, f"diverged on {question!r}"
        reference = torch.log_softmax(logits, dim=-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert abs(entry[token].logprob - reference[step, token].item()) < 1e-4, (question, step)
    assert "Paris" in outputs[0].outputs[0].text


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_names_both_numbers(smollm2_gguf):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's num_attention_heads \(9\)"):
        LLM(str(smollm2_gguf), tensor_parallel_size=2)
