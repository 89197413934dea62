"""Sampling filters against direct definitions; seeds; greedy rows."""
from __future__ import annotations

import pytest
import torch

from specserve.sampler import Sampler, SamplingMetadata, sample, target_probs
from specserve.sampling_params import SamplingParams


def meta_for(params: list[SamplingParams], seed: int = 0) -> SamplingMetadata:
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    return SamplingMetadata.build(params, gens, torch.device("cpu"))


LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))


def test_temperature_only_is_softmax():
    probs = target_probs(LOGITS, meta_for([SamplingParams(temperature=0.5)]))
    assert torch.allclose(probs, torch.softmax(LOGITS / 0.5, dim=-1), atol=1e-6)


def test_top_k_keeps_k_likeliest():
    probs = target_probs(LOGITS, meta_for([SamplingParams(top_k=2)]))[0]
    assert torch.allclose(probs, torch.tensor([0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]), atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p():
    # sorted: .4 .3 .15 .1 .05 -> mass above each: 0 .4 .7 .85 .95; top_p .7 keeps .4 and .3
    probs = target_probs(LOGITS, meta_for([SamplingParams(top_p=0.7)]))[0]
    assert torch.allclose(probs, torch.tensor([0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]), atol=1e-6)
    probs = target_probs(LOGITS, meta_for([SamplingParams(top_p=0.71)]))[0]
    assert (probs > 0).tolist() == [False, True, False, True, True]


def test_min_p_drops_below_fraction_of_top():
    probs = target_probs(LOGITS, meta_for([SamplingParams(min_p=0.5)]))[0]  # keeps >= .2
    assert torch.allclose(probs, torch.tensor([0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]), atol=1e-6)


def test_rows_are_independent():
    logits = LOGITS.repeat(3, 1)
    params = [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.7)]
    probs = target_probs(logits, meta_for(params))
    assert probs[0].tolist() == [0, 1, 0, 0, 0]
    assert torch.allclose(probs[1], LOGITS.softmax(-1)[0], atol=1e-6)


def test_greedy_rows_take_argmax_in_mixed_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 2
    tokens = sample(logits, meta_for(params))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_sampling_follows_the_distribution():
    """10k draws: empirical frequencies within 4 sigma of the target probabilities."""
    n = 10_000
    logits = LOGITS.repeat(n, 1)
    tokens = sample(logits, meta_for([SamplingParams(temperature=1.0)] * n))
    freq = torch.bincount(tokens, minlength=5).float() / n
    p = LOGITS.softmax(-1)[0]
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 4 * sigma).all(), (freq, p)


def test_sampler_seeds_per_request():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(2, 1000)
    seeded = SamplingParams(temperature=1.0, seed=7)
    first = sampler(logits, [("a", seeded), ("b", SamplingParams(temperature=1.0))])
    other = Sampler(torch.device("cpu"), seed=123)
    second = other(logits[:1], [("a", seeded)])
    assert first[0] == second[0]
    sampler.free("a")
    assert sampler(logits[:1], [("a", seeded)])[0] == first[0]  # fresh generator, same seed


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(min_p=2), "min_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"), (dict(temperature=float("nan")), "temperature"),
])
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ["END"]
