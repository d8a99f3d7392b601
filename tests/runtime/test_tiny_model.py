from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpilot.runtime.cli import main
from kvpilot.runtime.tiny_model import TinyModelError, make_tiny_model, train_tokenizer

CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}
ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed , spaced .",
    "déjà vu, naïve café, 東京, emoji 🚀, zero\u200bwidth",
    "def f(x):\n    return x ** 2  # comment",
]


def _tensor_names(model_dir: Path) -> set[str]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def _random_prompt(vocab_size: int, length: int = 300) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


def test_checkpoint_holds_the_hugging_face_files(tiny_llama_dir: Path) -> None:
    assert CHECKPOINT_FILES <= {p.name for p in tiny_llama_dir.iterdir()}
    tok_config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["bos_token"] == "<|begin_of_text|>"
    assert tok_config["eos_token"] == "<|end_of_text|>"
    assert tok_config["pad_token"] == "<|pad|>"
    assert "<|im_start|>" in tok_config["chat_template"]
    assert tok_config["model_max_length"] == 2048

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for key, token in [("bos_token_id", "<|begin_of_text|>"), ("eos_token_id", "<|end_of_text|>")]:
        assert config[key] == generation[key] == tokenizer.convert_tokens_to_ids(token)
    assert config["pad_token_id"] == tokenizer.pad_token_id


def test_llama_is_untied_gqa_without_bias(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads
    assert not config.tie_word_embeddings
    assert config.rms_norm_eps == 1e-5
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10_000.0}

    names = _tensor_names(tiny_llama_dir)
    assert "lm_head.weight" in names
    assert not [n for n in names if n.endswith(".bias")]
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_qwen2_is_tied_gqa_with_qkv_bias(tiny_qwen2_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.tie_word_embeddings
    assert config.rms_norm_eps == 1e-6
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}

    names = _tensor_names(tiny_qwen2_dir)
    assert "lm_head.weight" not in names
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for layer in range(config.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert f"model.layers.{layer}.self_attn.{proj}.bias" in names
        assert f"model.layers.{layer}.self_attn.o_proj.bias" not in names


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_norms_and_biases_are_not_init_defaults(fixture: str, request: pytest.FixtureRequest) -> None:
    # An engine that skipped loading a gain of 1 or a bias of 0 would still match transformers.
    model_dir: Path = request.getfixturevalue(fixture)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            if name.endswith("norm.weight"):
                assert not torch.all(f.get_tensor(name) == 1), name
            if name.endswith(".bias"):
                assert not torch.all(f.get_tensor(name) == 0), name


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_rope_dir"])
def test_logits_are_spread_and_finite(fixture: str, request: pytest.FixtureRequest) -> None:
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    with torch.no_grad():
        out = model(_random_prompt(model.config.vocab_size), output_hidden_states=True)
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    assert torch.isfinite(out.logits).all()
    assert out.logits.std(dim=-1).mean() >= 2.0


def test_same_seed_gives_identical_files_and_another_seed_differs(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", num_layers=1, seed=7)
    b = make_tiny_model(tmp_path / "b", num_layers=1, seed=7)
    c = make_tiny_model(tmp_path / "c", num_layers=1, seed=8)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(c / "model.safetensors", "pt") as fc:
        assert not torch.equal(fa.get_tensor("lm_head.weight"), fc.get_tensor("lm_head.weight"))


def test_make_tiny_model_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    make_tiny_model(tmp_path, num_layers=1)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_text(tiny_llama_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_tokenizer_normalizes_to_nfc(tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer("cafe\u0301")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "caf\u00e9"


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tokenizer_json_and_auto_tokenizer_agree(fixture: str, request: pytest.FixtureRequest) -> None:
    # transformers loads qwen2 with Qwen2Tokenizer, which rebuilds the pipeline from its own code.
    model_dir: Path = request.getfixturevalue(fixture)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for text in ROUND_TRIP_TEXTS:
        assert tokenizer(text)["input_ids"] == raw.encode(text).ids, text
    ids = list(range(raw.get_vocab_size()))
    assert tokenizer.decode(ids) == raw.decode(ids, skip_special_tokens=False)


def test_chat_template_renders_chatml_with_one_bos(tiny_qwen2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert prompt.startswith(closed) and not closed.endswith("assistant\n")

    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert tokenizer.decode(ids) == prompt


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_every_model_token_id_decodes(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab_size
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    assert None not in tokens and len(set(tokens)) == vocab_size


def test_tokenizer_reaches_larger_vocabularies_and_names_the_limit() -> None:
    assert train_tokenizer(1024).get_vocab_size() == 1024
    assert train_tokenizer(2048).get_vocab_size() == 2048
    with pytest.raises(TinyModelError, match=r"vocab_size=100000 is too large: .* at most \d+ tokens"):
        train_tokenizer(100_000)


def test_llama3_rope_scaling_checkpoint(tiny_llama3_rope_dir: Path, tiny_llama_dir: Path) -> None:
    raw = json.loads((tiny_llama3_rope_dir / "config.json").read_text())
    assert raw["rope_parameters"] == {
        "rope_type": "llama3",
        "rope_theta": 10_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    scaled = AutoModelForCausalLM.from_pretrained(tiny_llama3_rope_dir).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    # Same seed and shapes, so only the rotary frequencies tell the two apart.
    assert torch.equal(scaled.lm_head.weight, plain.lm_head.weight)
    scaled_freq, plain_freq = scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq
    assert torch.equal(scaled_freq[:2], plain_freq[:2])  # high frequencies are kept
    assert torch.allclose(scaled_freq[-2:], plain_freq[-2:] / 8)  # low ones are divided by factor

    prompt = _random_prompt(scaled.config.vocab_size)
    with torch.no_grad():
        assert (scaled(prompt).logits[0, -1] - plain(prompt).logits[0, -1]).abs().max() > 0.1


def test_cli_builds_a_loadable_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "qwen"
    assert main(["make-tiny-model", str(out), "--arch", "qwen2", "--layers", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.num_hidden_layers == 1
    AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--arch", "gpt2"], "--arch"),
        (["--hidden", "65"], "--hidden"),
        (["--heads", "4", "--kv-heads", "3"], "--heads"),
        (["--layers", "0"], "--layers"),
        (["--vocab", "100"], "--vocab"),
        (["--vocab", "100000"], "--vocab"),
        (["--arch", "qwen2", "--llama3-rope-scaling"], "--llama3-rope-scaling"),
    ],
)
def test_cli_usage_errors_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["make-tiny-model", str(tmp_path / "m"), *extra])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_cli_requires_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "COMMAND" in capsys.readouterr().err
