import math

import pytest
import torch

from kvpilot.runtime.layers.logits_processors import LogitsAdjustments
from kvpilot.runtime.layers.sampler import Sampler, SamplingMetadata, _apply_top_k_top_p, gather_logprobs, skip_noise
from kvpilot.runtime.request import GREEDY_TEMPERATURE


def _metadata(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    greedy = [t < GREEDY_TEMPERATURE for t in temperature]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
        all_greedy=all(greedy),
        all_random=not any(greedy),
    )


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample_repeated(logits: torch.Tensor, num_samples: int, **params: list) -> torch.Tensor:
    """Samples one logits row `num_samples` times, each row with its own generator."""
    batch = logits.expand(num_samples, -1)
    per_row = {name: value * num_samples for name, value in params.items()}
    metadata = _metadata(generators={i: _seeded(i) for i in range(num_samples)}, **per_row)
    return Sampler()(batch, metadata).sampled_token_ids


def _logits_from_probs(probs: list[float], order: list[int]) -> torch.Tensor:
    """A logits row whose softmax puts probs[i] on token order[i]."""
    logits = torch.full((len(probs),), float("-inf"))
    logits[order] = torch.tensor(probs).log()
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    logits = torch.randn(6, 300, generator=_seeded(0)).to(dtype)
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1  # a tie: the lowest id wins
    out = Sampler()(logits, _metadata([0.0] * 6))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids[2] == 17
    assert out.logprobs is None


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.randn(6, 1000, generator=_seeded(1))
    # Flat random rows: their argmax would come up by chance with probability 1/1000.
    logits[1::2] = 0.0
    metadata = _metadata(
        temperature=[0.0, 1.0, 0.0, 2.0, 0.0, 1.0],
        top_k=[5, 0, 1, -1, 2, 900],
        top_p=[0.5, 1.0, 0.1, 0.9, 1.0, 1.0],
        min_p=[0.5, 0.0, 0.0, 0.1, 0.9, 0.0],
    )
    sampled = Sampler()(logits, metadata, generator=_seeded(2)).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sampled[0::2], argmax[0::2])
    assert not torch.equal(sampled[1::2], argmax[1::2])


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 500, generator=_seeded(3))
    logits[5, 40] = logits[5, 400] = logits[5].max() + 1  # a tie: the lowest id wins, as in argmax
    metadata = _metadata([1.5] * 8, top_k=[1] * 8)
    sampled = Sampler()(logits, metadata, generator=_seeded(4)).sampled_token_ids
    assert torch.equal(sampled, logits.argmax(dim=-1))


def test_top_k_restricts_support():
    logits = torch.randn(40, generator=_seeded(5))
    sampled = _sample_repeated(logits, 2000, temperature=[3.0], top_k=[4])
    assert set(sampled.tolist()) == set(logits.topk(4).indices.tolist())


def test_top_p_keeps_the_nucleus():
    # Sorted, the masses run 0.5, 0.3, 0.15, 0.05: top_p = 0.75 needs the first two.
    order = [3, 0, 2, 1]
    logits = _logits_from_probs([0.5, 0.3, 0.15, 0.05], order)
    sampled = _sample_repeated(logits, 2000, temperature=[1.0], top_p=[0.75])
    assert set(sampled.tolist()) == {3, 0}
    sampled = _sample_repeated(logits, 200, temperature=[1.0], top_p=[0.1])
    assert set(sampled.tolist()) == {3}


def test_top_p_of_one_keeps_the_whole_tail():
    # The top token's float32 mass rounds to 1.0, so a cumulative-sum cut would drop the rest.
    logits = torch.full((1, 10), -20.0)
    logits[0, 0] = 0.0
    kept = _apply_top_k_top_p(logits, None, torch.tensor([1.0]))
    assert torch.equal(kept, logits)


def test_min_p_drops_unlikely_tokens():
    # min_p = 0.3 sets the bar at 0.3 * 0.4 = 0.12, so the 0.1 and 0.05 tokens go.
    order = [4, 1, 3, 0, 2]
    logits = _logits_from_probs([0.4, 0.3, 0.15, 0.1, 0.05], order)
    sampled = _sample_repeated(logits, 2000, temperature=[1.0], min_p=[0.3])
    assert set(sampled.tolist()) == {4, 1, 3}


@pytest.mark.parametrize("seeded", [False, True])
def test_samples_follow_tempered_softmax(seeded):
    num_samples, temperature = 20000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    expected = (logits / temperature).softmax(dim=-1) * num_samples
    if seeded:
        sampled = _sample_repeated(logits, num_samples, temperature=[temperature])
    else:
        metadata = _metadata([temperature] * num_samples)
        batch = logits.expand(num_samples, -1)
        sampled = Sampler()(batch, metadata, generator=_seeded(6)).sampled_token_ids
    observed = torch.bincount(sampled, minlength=logits.numel()).float()
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    # 20.5 is the 99.9th percentile of chi-square with 5 degrees of freedom.
    assert chi_square < 20.5


def test_seed_gives_same_tokens_regardless_of_batch():
    vocab, steps = 200, 6
    step_logits = torch.randn(steps, vocab, generator=_seeded(7)) * 0.5
    params = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01)

    def run(batch_size: int, row: int, engine_seed: int) -> list[int]:
        # Neighbours: seeded, unseeded and greedy rows with other settings.
        temperature = [0.8, 1.2, 0.0, 0.5, 1.0][:batch_size]
        top_k = [0, 10, 3, 0, -1][:batch_size]
        top_p = [1.0, 0.5, 0.9, 0.7, 1.0][:batch_size]
        min_p = [0.0, 0.2, 0.0, 0.05, 0.1][:batch_size]
        temperature[row], top_k[row], top_p[row], min_p[row] = params.values()
        generators = {row: _seeded(1234)}
        if batch_size > 1:
            generators |= {0: _seeded(99), 4: _seeded(100)}
        engine = _seeded(engine_seed)
        tokens = []
        for logits_row in step_logits:
            logits = torch.randn(batch_size, vocab, generator=engine)
            logits[row] = logits_row
            metadata = _metadata(temperature, top_k, top_p, min_p, generators)
            tokens.append(Sampler()(logits, metadata, generator=engine).sampled_token_ids[row].item())
        return tokens

    alone = run(batch_size=1, row=0, engine_seed=8)
    assert alone == run(batch_size=5, row=3, engine_seed=9)
    assert len(set(alone)) > 1


def test_skipped_noise_resumes_a_seeded_row_where_its_draws_left_off():
    vocab, steps, skipped = 200, 8, 5
    step_logits = torch.randn(steps, vocab, generator=_seeded(7))

    def run(generator: torch.Generator, first_step: int) -> list[int]:
        # Row 1 of 3: its draws are views into the batch's noise, the skipped ones are not.
        metadata = _metadata([1.0, 1.0, 1.0], generators={1: generator})
        return [Sampler()(logits.expand(3, -1).clone(), metadata, generator=_seeded(0)).sampled_token_ids[1].item()
                for logits in step_logits[first_step:]]

    uninterrupted = run(_seeded(1234), 0)
    resumed = _seeded(1234)
    skip_noise(resumed, skipped, vocab)
    assert run(resumed, skipped) == uninterrupted[skipped:]
    assert len(set(uninterrupted)) > 1


def test_logprobs_come_from_the_raw_distribution():
    num_logprobs = 5
    logits = torch.randn(4, 100, generator=_seeded(10)).to(torch.bfloat16)
    metadata = _metadata(
        temperature=[0.0, 0.5, 2.0, 1.0],
        top_k=[0, 3, 0, 1],
        top_p=[1.0, 1.0, 0.8, 1.0],
        min_p=[0.0, 0.0, 0.0, 0.5],
        generators={2: _seeded(11)},
        max_num_logprobs=num_logprobs,
    )
    out = Sampler()(logits, metadata, generator=_seeded(12))
    raw = logits.float().log_softmax(dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (4, num_logprobs + 1)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(lp.logprobs[:, 0], raw.gather(-1, out.sampled_token_ids[:, None]).squeeze(-1))
    top = raw.topk(num_logprobs, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.equal(lp.logprobs[:, 1:], top.values)
    assert (lp.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    positions = raw.argsort(dim=-1, descending=True).argsort(dim=-1)
    assert torch.equal(lp.ranks, positions.gather(-1, out.sampled_token_ids[:, None]).squeeze(-1) + 1)
    assert lp.ranks[0] == 1 and lp.ranks[3] == 1
    assert lp.ranks[2] > 1  # a temperature-2 draw from 100 tokens that was not the top one


def test_gather_logprobs_on_given_tokens():
    logprobs = torch.tensor([[-0.1, -3.0, -2.0, -5.0], [-4.0, -1.0, -0.5, -2.5]])
    out = gather_logprobs(logprobs, 2, torch.tensor([3, 1]))
    assert torch.equal(out.token_ids, torch.tensor([[3, 0, 2], [1, 2, 1]]))
    assert torch.equal(out.logprobs, torch.tensor([[-5.0, -0.1, -2.0], [-1.0, -0.5, -1.0]]))
    assert torch.equal(out.ranks, torch.tensor([4, 2]))
    only_token = gather_logprobs(logprobs, 0, torch.tensor([0, 2]))
    assert only_token.token_ids.shape == (2, 1)
    assert torch.equal(only_token.ranks, torch.tensor([1, 1]))


def test_edge_cases_stay_finite():
    vocab = 50
    logits = torch.randn(5, vocab, generator=_seeded(13))
    logits[4] = float("-inf")
    logits[4, 7] = 0.0  # everything but one token masked
    metadata = _metadata(
        temperature=[1.0, 1.0, 1.0, GREEDY_TEMPERATURE, 1.0],
        top_k=[vocab + 100, 0, 0, 0, 5],
        top_p=[1.0, 1.0, 1.0, 1.0, 0.5],
        min_p=[0.0, 0.0, 1.0, 0.0, 0.5],
        max_num_logprobs=3,
    )
    out = Sampler()(logits, metadata, generator=_seeded(14))
    sampled = out.sampled_token_ids
    assert ((sampled >= 0) & (sampled < vocab)).all()
    argmax = logits.argmax(dim=-1)
    assert sampled[2] == argmax[2]  # min_p = 1 leaves only the top token
    assert sampled[3] == argmax[3]  # tiny temperature, still sampled, is all but greedy
    assert sampled[4] == 7
    assert not out.logprobs.logprobs.isnan().any()
    assert math.isfinite(out.logprobs.logprobs[4, 0].item())


def test_top_p_that_rounds_to_zero_keeps_the_top_token():
    logits = torch.tensor([[0.1, 2.0, 0.3, -1.0]])
    metadata = SamplingMetadata(
        temperature=torch.tensor([1.0]), top_k=None, top_p=torch.tensor([1e-300]), min_p=None,
        generators={}, max_num_logprobs=None, all_greedy=False, all_random=True,
    )
    sampled = Sampler()(logits, metadata, torch.Generator().manual_seed(0)).sampled_token_ids
    assert sampled.tolist() == [1]


def test_logit_bias_steers_greedy_and_random_rows_but_not_the_logprobs():
    logits = torch.randn(3, 50, generator=_seeded(1))
    metadata = _metadata([0.0, 0.0, 1.0], generators={2: _seeded(2)}, max_num_logprobs=1)
    favoured, banned = 7, int(logits[1].argmax())
    # Row 0 and the random row 2 favour token 7; row 1 bans its own greedy pick.
    metadata.adjustments = LogitsAdjustments(logit_bias=(
        torch.tensor([0, 1, 2]), torch.tensor([favoured, banned, favoured]), torch.tensor([100.0, -100.0, 100.0])))
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids[0] == favoured and out.sampled_token_ids[2] == favoured
    assert out.sampled_token_ids[1] == logits[1].topk(2).indices[1]
    # The logprobs are the model's own (vLLM's raw_logprobs), bias or not.
    raw = logits.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw.gather(-1, out.sampled_token_ids.unsqueeze(-1))[:, 0])


def test_the_c_argmax_samples_what_torch_samples():
    """Sampler("cpu") (the C argmax, for greedy rows and the exponential race) against torch's."""
    from kvpilot.kernels.cpu.build import KernelBuildError

    try:
        c_sampler = Sampler("cpu")
    except KernelBuildError as error:
        pytest.skip(f"the C kernels do not build here: {error}")
    logits = torch.randn(8, 3000, generator=_seeded(20)).round(decimals=1)  # with ties
    for temperature in ([0.0] * 8, [1.0] * 8, [0.0, 0.7, 1.0, 0.0, 1.3, 0.0, 0.5, 2.0]):
        sampled = [sampler(logits, _metadata(temperature, top_k=[0, 5] * 4), generator=_seeded(21)).sampled_token_ids
                   for sampler in (Sampler(), c_sampler)]
        assert torch.equal(*sampled)
