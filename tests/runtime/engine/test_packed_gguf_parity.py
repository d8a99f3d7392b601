"""Packed weights against transformers: GGUF files made from the tiny checkpoint, and int8 at load.

Each engine keeps the file's quantized matrices packed and multiplies with quant_matmul;
transformers loads the same file (`gguf_file=`) and dequantizes it. Greedy tokens must agree
token for token. int8 has no file: its oracle is transformers on the quantize-dequantize weights.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.kernels.cpu.quant_matmul import dequantize, pack_int8
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.tiny_model import make_tiny_model
from tiny_gguf import write_tiny_gguf

PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def q4_k_m(name: str) -> str:
    """llama.cpp's Q4_K_M mix: Q6_K for v, down and the embedding (the tied LM head), Q4_K elsewhere."""
    return "Q6_K" if name.startswith(("token_embd", "output.")) or ".attn_v." in name or ".ffn_down." in name \
        else "Q4_K"


@pytest.fixture(scope="module")
def q8_0_gguf(tiny_llama_dir, tmp_path_factory):
    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("q8") / "tiny.Q8_0.gguf", lambda name: "Q8_0")


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    # K-quant rows hold whole blocks of 256 inputs: every matrix's input width is a multiple of it.
    hf_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-256"), hidden_size=256, num_heads=4, num_kv_heads=2)
    return hf_dir, write_tiny_gguf(hf_dir, hf_dir / "tiny.Q4_K_M.gguf", q4_k_m)


def greedy(model: str, prompts: list[list[int]], **settings) -> list[list[int]]:
    llm = LLM(model, block_size=8, max_num_batched_tokens=64, **settings)
    try:
        return [output.outputs[0].token_ids for output in llm.generate(prompts, PARAMS)]
    finally:
        llm.engine.shutdown()


def assert_matches(oracle: HFOracle, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    for prompt, tokens in zip(prompts, outputs):
        assert tokens == oracle.greedy(prompt)[0], f"diverged on the prompt of {len(prompt)} tokens"


def test_q8_0_file_matches_transformers_at_tp_1_and_2(q8_0_gguf, tiny_llama_dir):
    prompts = random_prompts([1, 9, 70], 512, seed=3)
    single = greedy(str(q8_0_gguf), prompts, tokenizer=str(tiny_llama_dir))
    assert_matches(HFOracle(str(q8_0_gguf.parent), gguf_file=q8_0_gguf.name), prompts, single)
    # Two ranks: q/k/v and gate/up split by rows, o and down by whole blocks of 32 inputs.
    assert greedy(str(q8_0_gguf), prompts, tokenizer=str(tiny_llama_dir), tensor_parallel_size=2) == single


def test_q4_k_m_file_matches_transformers(q4_k_m_gguf):
    hf_dir, path = q4_k_m_gguf
    prompts = random_prompts([1, 9, 70], 512, seed=4)
    outputs = greedy(str(path), prompts, tokenizer=str(hf_dir))
    assert_matches(HFOracle(str(hf_dir), gguf_file=path.name), prompts, outputs)


def test_int8_matches_transformers_on_the_quantize_dequantize_weights(tiny_llama_dir):
    oracle = HFOracle(str(tiny_llama_dir))
    with torch.no_grad():
        for name, param in oracle.model.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR:
                param.copy_(dequantize(pack_int8(param)))
    prompts = random_prompts([1, 9, 70], 512, seed=5)
    outputs = greedy(str(tiny_llama_dir), prompts, quantization="int8")
    assert_matches(oracle, prompts, outputs)


def test_a_row_parallel_shard_inside_a_k_quant_block_names_the_layer(q4_k_m_gguf):
    # Two ranks would split o_proj's 256 inputs into 128 each: half a Q4_K block.
    hf_dir, path = q4_k_m_gguf
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 would split model\.layers\.0\.self_attn\.o_proj\."
                                         r"weight \(Q4_K\) into shards of 128 inputs, inside its blocks of 256"):
        LLM(str(path), tokenizer=str(hf_dir), tensor_parallel_size=2)
    # Dequantized at load, the same file splits anywhere.
    assert greedy(str(path), [[5, 6, 7]], tokenizer=str(hf_dir), tensor_parallel_size=2, quantization="none")


def test_a_fused_layer_with_packed_and_float_parts_names_the_weight(tiny_llama_dir, tmp_path):
    path = write_tiny_gguf(tiny_llama_dir, tmp_path / "mixed.gguf",
                           lambda name: "F16" if ".attn_v." in name else "Q8_0")
    with pytest.raises(ValueError, match=r"checkpoint weight model\.layers\.0\.self_attn\.v_proj\.weight is float "
                                         r"where the layer's other parts are packed"):
        LLM(str(path), tokenizer=str(tiny_llama_dir))
    # Dequantized at load, the same file runs.
    assert greedy(str(path), [[5, 6, 7]], tokenizer=str(tiny_llama_dir), quantization="none")
