"""The correctness oracle: Hugging Face transformers greedy decoding on the same checkpoint."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

NEW_TOKENS = 32


def random_prompts(lengths: list[int], vocab_size: int, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


class HFOracle:
    """Greedy continuations and raw logits from transformers, memoised per prompt."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32, **load_kwargs) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **load_kwargs).eval()
        self._cache: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def greedy(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """Returns (new token ids, logits [NEW_TOKENS, vocab]); EOS does not stop it (eos_token_id=[])."""
        key = tuple(prompt)
        if key not in self._cache:
            config = GenerationConfig(
                max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )
            input_ids = torch.tensor([prompt])
            with torch.no_grad():
                # An explicit mask: otherwise prompt tokens equal to pad_token_id are taken for padding.
                out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                          generation_config=config)
            tokens = out.sequences[0, len(prompt):].tolist()
            self._cache[key] = tokens, torch.cat(out.logits).float()
        return self._cache[key]

    def assert_greedy_match(self, prompt: list[int], completion, tolerance: float = 1e-4) -> None:
        """The engine's greedy `completion` (asked for logprobs) has transformers' tokens, and each
        chosen token's logprob within `tolerance` of transformers'."""
        expected, logits = self.greedy(prompt)
        assert completion.token_ids == expected
        reference = torch.log_softmax(logits, dim=-1)
        for step, (token, entry) in enumerate(zip(expected, completion.logprobs)):
            assert abs(entry[token].logprob - reference[step, token].item()) < tolerance

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([prompt])).logits[0].float()
