"""The C layer stack (kernels/cpu/layer_stack.py) against the layer-by-layer forward it stands in
for: the same kernels in the same order, so the same tokens and bitwise the same logprobs.

The engines run prompts of 1 to 120 tokens with 128-token steps: the first step (over 95 tokens)
goes layer by layer, the chunked prefill and decode steps after it through the stack.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import random_prompts
from kvpilot.kernels.cpu import layer_stack
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.tiny_model import make_tiny_model
from tiny_gguf import write_tiny_gguf

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=4)


def q4_k_m(name: str) -> str:
    return "Q6_K" if name.startswith(("token_embd", "output.")) or ".attn_v." in name or ".ffn_down." in name \
        else "Q4_K"


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """q and k Q4_K beside v's Q6_K: a fused projection of two packed parts."""
    hf_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-256"), hidden_size=256, num_heads=4, num_kv_heads=2)
    return {"model": str(write_tiny_gguf(hf_dir, hf_dir / "tiny.Q4_K_M.gguf", q4_k_m)), "tokenizer": str(hf_dir)}


def _outputs(llm: LLM, prompts) -> list[tuple[list[int], list[dict[int, float]]]]:
    return [(out.outputs[0].token_ids, [{token: entry.logprob for token, entry in step.items()}
                                        for step in out.outputs[0].logprobs])
            for out in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("kind", ["q4_k_m", "qwen2_int8"])
def test_the_stack_is_bitwise_the_layer_by_layer_forward(kind, q4_k_m_gguf, tiny_qwen2_dir, monkeypatch):
    # Qwen2's q, k and v carry biases; int8 packs float weights at load.
    settings = q4_k_m_gguf if kind == "q4_k_m" else {"model": str(tiny_qwen2_dir), "quantization": "int8"}
    calls = []
    run = layer_stack.LayerStack.run
    monkeypatch.setattr(layer_stack.LayerStack, "run", lambda self, hidden, *args: calls.append(len(hidden))
                        or run(self, hidden, *args))
    # No prefix caching: the second pass must compute what the first did, not reuse its blocks.
    llm = LLM(**settings, block_size=8, max_num_batched_tokens=128, max_num_seqs=8, enable_prefix_caching=False)
    try:
        prompts = random_prompts([120, 1, 9, 70, 33], 500, seed=11)
        stacked = _outputs(llm, prompts)
        assert calls and max(calls) > 1, "no step ran through the stack, or none with several tokens"
        model = llm.engine.executor.model
        model._stack, model._stack_refused = None, "the reference: layer by layer"
        ran = len(calls)
        assert _outputs(llm, prompts) == stacked
        assert len(calls) == ran
    finally:
        llm.engine.shutdown()


def test_a_model_the_stack_cannot_run_goes_layer_by_layer_and_says_why(tiny_llama_dir, caplog):
    llm = LLM(str(tiny_llama_dir), attention_backend="cpu")
    try:
        with caplog.at_level("INFO", logger="kvpilot.runtime.models.llama"):
            llm.generate([[5, 6, 7]], PARAMS)
        assert "weights are float" in llm.engine.executor.model._stack_refused
        assert "decoder layers run one by one: the weights are float" in caplog.text
    finally:
        llm.engine.shutdown()


def test_a_step_outside_the_stack_is_refused_with_the_shapes(q4_k_m_gguf):
    llm = LLM(**q4_k_m_gguf, block_size=8)
    try:
        llm.generate([[5, 6, 7]], PARAMS)
        stack = llm.engine.executor.model._stack
        ints = torch.zeros(200, dtype=torch.int64)
        with pytest.raises(ValueError, match=r"T <= 95"):
            stack.run(torch.zeros(200, 256), None, ints, ints, torch.zeros(1, 4, dtype=torch.int64),
                      torch.tensor([0, 200]), torch.tensor([200]))
    finally:
        llm.engine.shutdown()
