"""The tokenizer and chat template a GGUF file carries in its `tokenizer.*` metadata.

Built the way transformers builds a fast tokenizer from the same file (tests hold the two equal
on varied text), without importing transformers or torch: the API-server process tokenizes.
Byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with the GPT-2 split is what is implemented;
other tokenizer models are refused with a pointer to `--tokenizer`.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvpilot.runtime.models.gguf_checkpoint import GGUFCheckpoint, GGUFError

# llama.cpp's token types (llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer names (tokenizer.ggml.pre) whose split is GPT-2's own, the ByteLevel default.
_GPT2_SPLIT = ("default", "gpt2", "smollm")
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer(checkpoint: GGUFCheckpoint) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config-like dict with chat_template and the special tokens' text)."""
    kind = checkpoint.metadata("tokenizer.ggml.model")
    pre = checkpoint.metadata("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _GPT2_SPLIT:
        raise GGUFError(
            f"model: {checkpoint.path.name} has a {kind!r} tokenizer with pre-tokenizer {pre!r}; kvpilot builds "
            f"only byte-level BPE with the GPT-2 split ({', '.join(_GPT2_SPLIT)}) from GGUF metadata: "
            "pass --tokenizer with a Hugging Face folder holding tokenizer.json"
        )
    tokens: list[str] = checkpoint.metadata("tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in checkpoint.metadata("tokenizer.ggml.merges", [])]
    token_types = checkpoint.metadata("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_chars = _byte_chars()

    # llama.cpp writes special tokens in plain text; the BPE vocabulary needs them in the byte alphabet.
    vocab = {token if set(token) <= alphabet else "".join(byte_chars[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(checkpoint.metadata("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel that transformers skips too.
    tokenizer.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types) if token_type == _CONTROL and set(token) <= alphabet
    ])
    tokenizer.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types) if token_type == _USER_DEFINED and token in vocab
    ])
    special = {name: _token(tokens, checkpoint.metadata(f"tokenizer.ggml.{key}")) for name, key in _SPECIAL_TOKENS.items()}
    tokenizer.post_processor = _post_processor(checkpoint, tokens, special)
    config = {"chat_template": checkpoint.metadata("tokenizer.chat_template"), **special}
    return tokenizer, config


def _post_processor(checkpoint: GGUFCheckpoint, tokens: list[str], special: dict) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence, where the file asks for them (llama.cpp's add_*_token)."""
    bos = special["bos_token"] if checkpoint.metadata("tokenizer.ggml.add_bos_token", False) else None
    eos = special["eos_token"] if checkpoint.metadata("tokenizer.ggml.add_eos_token", False) else None
    single = " ".join(t for t in (bos, "$A", eos) if t)
    return processors.TemplateProcessing(single=single, pair=f"{single} $B:1",
                                         special_tokens=[(t, tokens.index(t)) for t in (bos, eos) if t])


def _token(tokens: list[str], token_id: int | None) -> str | None:
    return None if token_id is None else tokens[token_id]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table
