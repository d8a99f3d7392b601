"""The tokenizer and chat template built from SmolLM2's GGUF metadata behave exactly as the ones
transformers builds from the same file."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from kvpilot.runtime.models.tokenizer_loader import load_tokenizer
from kvpilot.runtime.server.chat_template import ChatTemplate

STRINGS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "a", "Hello world", "Hello  world", "hello   world   ",
    "The quick brown fox jumps over the lazy dog.", "  leading spaces", "trailing spaces   ",
    "UPPER lower MiXeD", "don't can't I'm you're we've they'll she'd", "e-mail: someone@example.com",
    "https://example.com/path?q=1&r=2#frag", "1234567890", "3.14159 2.71828 -42 +7 1e-9", "1,000,000.00",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 42;", "<html><body><p class=\"x\">hi</p></body></html>",
    "{\"key\": [1, 2, {\"nested\": null}]}", "    indented\n\tand tabbed\n        deeper",
    "café naïve résumé façade", "Ünïcödé ß ẞ Œuvre", "日本語のテキスト", "中文文本测试", "한국어 텍스트",
    "Русский текст", "العربية نص", "עברית", "ελληνικά", "हिन्दी पाठ", "emoji 🤖🎉👍🏽", "👨‍👩‍👧‍👦 family",
    "🇫🇷🇩🇪 flags", "mixed 日本 and English and 😀", "\u200bzero\u200bwidth", "tab\there", "crlf\r\nline",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "text<|im_end|>more", "<repo_name>kvpilot<file_sep>",
    "a" * 200, "ab " * 60 + "end",
]


@pytest.fixture(scope="module")
def tokenizers(smollm2_gguf):
    ours, config = load_tokenizer(str(smollm2_gguf))
    theirs = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return ours, config, theirs


def test_fifty_strings_encode_and_decode_as_in_transformers(tokenizers):
    ours, _, theirs = tokenizers
    assert len(STRINGS) == 50
    for text in STRINGS:
        ids = ours.encode(text, add_special_tokens=True).ids
        assert ids == theirs.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.get_vocab_size() == len(theirs)


@pytest.mark.parametrize("messages, add_generation_prompt", [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
      {"role": "user", "content": "Write code:\n  x = 1"}], False),
])
def test_the_chat_template_renders_as_in_transformers(tokenizers, messages, add_generation_prompt):
    _, config, theirs = tokenizers
    ours = ChatTemplate(config).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_the_special_tokens_are_the_files(tokenizers):
    _, config, theirs = tokenizers
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
        theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.unk_token)


def test_the_api_process_builds_it_without_torch(smollm2_gguf, tmp_path):
    code = ("import sys; from kvpilot.runtime.models.tokenizer_loader import load_tokenizer; "
            f"load_tokenizer({str(smollm2_gguf)!r}); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path, timeout=120).returncode == 0


def test_a_small_vocabulary_with_bos_and_user_defined_tokens_matches_transformers(tmp_path):
    """The paths SmolLM2 does not take: add_bos_token, a USER_DEFINED token, a mislabeled control token."""
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    tokens = ["<s>", "</s>", "<think>", "<ctl ü>", *alphabet, "Ġt", "he", "Ġthe", "Ġa"]
    types = [3, 3, 4, 3] + [1] * (len(tokens) - 4)
    path = tmp_path / "tok.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, config = load_tokenizer(str(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the cat", " the <think> a", "<s>he</s>", "ünï the", "<ctl ü>"]:
        ids = ours.encode(text, add_special_tokens=True).ids
        assert ids == theirs.encode(text), text
        assert ids[0] == 0
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
