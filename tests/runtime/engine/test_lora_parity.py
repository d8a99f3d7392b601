"""LoRA adapters against transformers + peft with each adapter merged into the weights.

Three adapters made with peft on the tiny checkpoint (all seven linear modules at rank 8; q and v at
rank 4; the MLP at rank 2 with rsLoRA), with random non-zero B matrices, and the base model, mixed
in one batch: each row's greedy tokens equal the merged model's, token for token. The same under
preemption, at TP 2, and on a packed Q8_0 base (the oracle: transformers on the dequantized file,
adapter merged).
"""

from __future__ import annotations

import pytest

from hf_oracle import NEW_TOKENS, HFOracle, random_prompts
from kvpilot.runtime import LLM, SamplingParams
from kvpilot.runtime.lora.request import LoRARequest
from tiny_gguf import write_tiny_gguf

peft = pytest.importorskip("peft")

PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ADAPTERS = {
    "everything": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]),
    "attention": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=2, lora_alpha=4, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
# Each row's adapter, by name (None: the base model), cycling over the batch.
MIX = [None, "everything", "attention", "mlp"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory, make_peft_adapter) -> dict[str, LoRARequest]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, index + 1, str(make_peft_adapter(tiny_llama_dir, folder / name, seed=index,
                                                                     **options)))
            for index, (name, options) in enumerate(ADAPTERS.items())}


def oracles_for(adapters: dict[str, LoRARequest], model_dir: str, **load_kwargs) -> dict[str | None, HFOracle]:
    """The base model's oracle, and one per adapter with the adapter merged into its weights."""
    oracles = {None: HFOracle(model_dir, **load_kwargs)}
    for name, lora in adapters.items():
        oracle = HFOracle(model_dir, **load_kwargs)
        oracle.model = peft.PeftModel.from_pretrained(oracle.model, lora.lora_path).merge_and_unload().eval()
        oracles[name] = oracle
    return oracles


@pytest.fixture(scope="module")
def oracles(tiny_llama_dir, adapters):
    return oracles_for(adapters, str(tiny_llama_dir))


def mixed_batch(num_prompts: int, seed: int, lengths=(9, 30, 5, 17, 40, 3, 22, 12)):
    prompts = random_prompts(list(lengths[:num_prompts]), 512, seed=seed)
    return prompts, [MIX[i % len(MIX)] for i in range(num_prompts)]


def assert_rows_match(model: str, oracles, adapters, num_prompts: int, seed: int, **settings) -> LLM:
    """Runs a mixed batch on a fresh engine (stopped before returning) and compares every row."""
    llm = LLM(model, enable_lora=True, max_lora_rank=8, block_size=8, max_num_batched_tokens=64, **settings)
    try:
        prompts, names = mixed_batch(num_prompts, seed)
        loras = [None if name is None else adapters[name] for name in names]
        outputs = llm.generate(prompts, PARAMS, lora_request=loras)
    finally:
        llm.engine.shutdown()
    for row, (prompt, name, output) in enumerate(zip(prompts, names, outputs)):
        assert output.outputs[0].token_ids == oracles[name].greedy(prompt)[0], \
            f"row {row} (adapter {name}) diverged from transformers + peft"
    return llm


def test_each_adapter_changes_the_output(oracles):
    # Otherwise the parity below would hold with the adapters ignored.
    prompt = random_prompts([9], 512, seed=1)[0]
    outputs = {name: tuple(oracle.greedy(prompt)[0]) for name, oracle in oracles.items()}
    assert len(set(outputs.values())) == len(outputs)


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft_row_by_row(tiny_llama_dir, adapters, oracles):
    # Two slots for three adapters: a request whose adapter finds both in use waits its turn.
    assert_rows_match(str(tiny_llama_dir), oracles, adapters, 8, seed=2, max_loras=2)


def test_the_same_under_preemption(tiny_llama_dir, adapters, oracles):
    llm = assert_rows_match(str(tiny_llama_dir), oracles, adapters, 8, seed=3, max_loras=3,
                            num_gpu_blocks_override=16)
    assert llm.get_stats().num_preemptions > 0


def test_the_same_at_tp_2(tiny_llama_dir, adapters, oracles):
    # Two ranks: each holds B's rows of its q/k/v and gate/up shards, A's columns of its o and down.
    assert_rows_match(str(tiny_llama_dir), oracles, adapters, 4, seed=4, max_loras=3, tensor_parallel_size=2)


def test_the_same_on_a_packed_q8_0_base(tiny_llama_dir, adapters, tmp_path_factory):
    gguf = write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("q8") / "tiny.Q8_0.gguf", lambda name: "Q8_0")
    oracles = oracles_for(adapters, str(gguf.parent), gguf_file=gguf.name)
    llm = assert_rows_match(str(gguf), oracles, adapters, 4, seed=5, max_loras=3, tokenizer=str(tiny_llama_dir))
    # The base stayed packed: the adapters ran beside quant_matmul, not on dequantized weights.
    assert llm.engine.executor.model.layers[0].self_attn.qkv_proj.packed is not None


def test_the_same_with_async_scheduling(tiny_llama_dir, adapters, oracles):
    # Slots filled on the model thread while the next step is scheduled.
    assert_rows_match(str(tiny_llama_dir), oracles, adapters, 8, seed=6, max_loras=2, async_scheduling=True)
