"""xgrammar against llguidance on the default model's tokenizer (SmolLM2, 49,152 tokens): what a
JSON schema costs to compile, and what one decode step's token mask costs.

    .venv/bin/python bench/grammar_backends.py [--repeats 5] [--threads 1] [--model DIR]

xgrammar comes with the bench extra for this comparison only; kvpilot runs on llguidance.

Each repetition compiles every schema cold (a fresh compiler, so nothing is cached) with each
backend, interleaved, then walks each schema's example document token by token, filling the
next-token bitmask and accepting the token, as the engine does once per decode step. It prints a
markdown table with min and median over the repetitions and the llguidance/xgrammar ratio.

`--engine` instead measures what kvpilot's engine pays: SmolLM2 offline, 8 greedy requests of 32
tokens, without and with a regex grammar on every request (bounded so that each still writes its
32 tokens), interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "runtime" / "structured_output"))
from schemas import SCHEMAS  # noqa: E402

from kvpilot.runtime.config import EngineArgs  # noqa: E402
from kvpilot.runtime.models.default_model import ensure_default_model  # noqa: E402
from kvpilot.runtime.models.tokenizer_loader import load_tokenizer  # noqa: E402


def hf_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int, eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema):
        # A fresh compiler per call: its cache would otherwise make every repetition after the first free.
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def walk(self, compiled, tokens: list[int]) -> int:
        matcher = self.xgr.GrammarMatcher(compiled)
        for token in tokens:
            matcher.fill_next_token_bitmask(self.bitmask, 0)
            assert matcher.accept_token(token), token
        return len(tokens)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self.fill = llguidance.numpy.fill_next_token_bitmask

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, grammar, tokens: list[int]) -> int:
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        for token in tokens:
            self.fill(matcher, self.bitmask, 0)
            assert matcher.consume_token(token), (token, matcher.get_error())
        return len(tokens)


def engine_overhead(model: str, repeats: int, new_tokens: int) -> None:
    from kvpilot.runtime import LLM, SamplingParams
    from kvpilot.runtime.structured_output.params import StructuredOutputsParams

    llm = LLM(model, max_model_len=256)
    prompts = [f"Write about topic {i}:" for i in range(8)]
    # Bounded below by more characters than the tokens can write, so every request writes all of them.
    regex = StructuredOutputsParams(regex="[a-z ,.]{%d,%d}" % (8 * new_tokens, 10 * new_tokens))
    runs = {
        "no grammar": SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
        "regex on every request": SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True,
                                                 structured_outputs=regex),
    }
    llm.generate(prompts, runs["regex on every request"])  # compiles the grammar, warms up
    seconds = {name: [] for name in runs}
    for _ in range(repeats):
        for name, params in runs.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds[name].append(time.perf_counter() - start)
            assert all(len(o.outputs[0].token_ids) == new_tokens for o in outputs)
    print(f"| run | 8 x {new_tokens} tokens, min / median (s) |\n|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {min(s):.2f} / {statistics.median(s):.2f} |")
    ratio = statistics.median(seconds["regex on every request"]) / statistics.median(seconds["no grammar"])
    print(f"\nwith / without grammar (medians): {ratio:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", action="store_true", help="the engine's cost of a grammar instead")
    parser.add_argument("--model", help="checkpoint whose tokenizer (and, with --engine, weights) to use; "
                                        "default: the default model")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per request with --engine")
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS), help="how many of the test schemas to compile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or str(ensure_default_model())
    if args.engine:
        engine_overhead(model, args.repeats, args.new_tokens)
        return

    config = EngineArgs.from_kwargs(model).create_engine_config().model
    tokenizer, _ = load_tokenizer(model, config.tokenizer)
    hf = hf_tokenizer(tokenizer)
    vocab_size, eos = config.vocab_size, config.eos_token_ids[0]
    schemas = SCHEMAS[: args.schemas]
    documents = [tokenizer.encode(json.dumps(example, separators=(",", ":")), add_special_tokens=False).ids
                 for _, example in schemas]

    setup, backends = {}, []
    for cls in (XGrammar, LLGuidance):
        start = time.perf_counter()
        backends.append(cls(hf, vocab_size, eos))
        setup[cls.name] = time.perf_counter() - start

    compile_s = {b.name: [] for b in backends}
    step_s = {b.name: [] for b in backends}
    for _ in range(args.repeats):
        for backend in backends:
            start = time.perf_counter()
            compiled = [backend.compile(schema) for schema, _ in schemas]
            compile_s[backend.name].append((time.perf_counter() - start) / len(schemas))
            start = time.perf_counter()
            steps = sum(backend.walk(c, doc) for c, doc in zip(compiled, documents))
            step_s[backend.name].append((time.perf_counter() - start) / steps)

    print(f"vocab {vocab_size}, {len(schemas)} schemas, {sum(map(len, documents))} tokens of documents, "
          f"{args.repeats} repetitions, torch threads {args.threads}, bitmask {np.int32().nbytes * -(-vocab_size // 32)} B/row\n")
    def row(label: str, values: dict[str, list[float]], scale: float) -> str:
        cells = [f"{min(values[b.name]) * scale:.2f} / {statistics.median(values[b.name]) * scale:.2f}" for b in backends]
        ratio = statistics.median(values["llguidance"]) / statistics.median(values["xgrammar"])
        return f"| {label} | {' | '.join(cells)} | {ratio:.2f}x |"

    print("| workload | xgrammar, min / median | llguidance, min / median | llguidance / xgrammar (medians) |")
    print("|---|---|---|---|")
    print(row("tokenizer setup (s)", {name: [t] for name, t in setup.items()}, 1))
    print(row("compile per schema (ms)", compile_s, 1e3))
    print(row("mask + accept per token (us)", step_s, 1e6))


if __name__ == "__main__":
    main()
