"""The sampler's grammar mask against a plain reference: packed bits in, forbidden logits out."""

import numpy as np
import torch

from kvpilot.runtime.layers.sampler import Sampler, SamplingMetadata, apply_grammar_bitmask

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def pack(allowed: np.ndarray) -> torch.Tensor:
    """[rows, VOCAB] bools -> [rows, ceil(VOCAB / 32)] int32, bit t % 32 of word t // 32 for token t."""
    padded = np.zeros((allowed.shape[0], -(-VOCAB // 32) * 32), dtype=np.uint64)
    padded[:, :VOCAB] = allowed
    words = (padded.reshape(len(allowed), -1, 32) << np.arange(32, dtype=np.uint64)).sum(-1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def test_forbidden_tokens_get_minus_infinity_and_other_rows_are_untouched():
    rng = np.random.default_rng(0)
    logits = torch.randn(4, VOCAB)
    allowed = rng.random((2, VOCAB)) < 0.3
    allowed[:, 31] = allowed[:, 69] = True  # the sign bit and the last real token
    masked = apply_grammar_bitmask(logits, torch.tensor([0, 2]), pack(allowed))
    for row, mask in zip([0, 2], allowed):
        expected = torch.where(torch.from_numpy(mask), logits[row], float("-inf"))
        assert torch.equal(masked[row], expected)
    assert torch.equal(masked[[1, 3]], logits[[1, 3]])


def test_the_sampler_picks_and_scores_only_allowed_tokens():
    logits = torch.randn(3, VOCAB)
    allowed = np.zeros((2, VOCAB), dtype=bool)
    allowed[0, [3, 40]] = True
    allowed[1, [65]] = True
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0, 0.0]), top_k=None, top_p=None, min_p=None, generators={},
        max_num_logprobs=1, all_greedy=False, all_random=False,
        grammar_bitmask=(torch.tensor([0, 1]), pack(allowed)),
    )
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids[0] == (3 if logits[0, 3] > logits[0, 40] else 40)
    assert out.sampled_token_ids[1] == 65
    assert out.sampled_token_ids[2] == logits[2].argmax()
    # The masked row's distribution is over its allowed tokens only (vLLM applies the mask first).
    assert torch.isclose(out.logprobs.logprobs[1, 0], torch.tensor(0.0), atol=1e-6)
