"""Sampling filters against direct definitions; seeds; greedy rows."""
from __future__ import annotations

import pytest
import torch

from specserve.spec.rejection_sampler import RejectionSampler, VerifyRequest
from specserve.sampler import SamplingMetadata, Uniforms, sample_from_probs, target_probs
from specserve.sampling_params import SamplingParams


def meta_for(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.build(params, torch.device("cpu"))


def sample_rows(logits, params, seed=0):
    """Plain sampling (k = 0) through the engine's sampler, one request per row."""
    sampler = RejectionSampler(torch.device("cpu"), seed)
    out = sampler(logits, [VerifyRequest(str(i), p, []) for i, p in enumerate(params)])
    return torch.tensor([tokens[0] for tokens in out])


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
    tokens = sample_rows(logits, params)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_sampling_follows_the_distribution():
    """10k draws: empirical frequencies within 4 sigma of the target probabilities."""
    n = 10_000
    logits = LOGITS.repeat(n, 1)
    tokens = sample_rows(logits, [SamplingParams(temperature=1.0)] * n)
    freq = torch.bincount(tokens, minlength=5).float() / n
    p = LOGITS.softmax(-1)[0]
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() < 4 * sigma).all(), (freq, p)


def test_uniforms_are_keyed_by_seed_position_and_purpose():
    seeded = SamplingParams(temperature=1.0, seed=7)
    a = Uniforms(seed=0)
    first = a.at("a", seeded, range(10, 14), Uniforms.DRAW)
    a.at("b", SamplingParams(), range(4), Uniforms.DRAW)
    assert Uniforms(seed=123).at("a", seeded, range(10, 14), Uniforms.DRAW) == first  # seed rules
    assert a.at("a", seeded, range(12, 13), Uniforms.DRAW) == first[2:3]   # keyed by position
    assert a.at("a", seeded, range(10, 14), Uniforms.ACCEPT) != first      # purposes differ
    assert all(0 <= u < 1 for u in first) and len(set(first)) == 4
    many = Uniforms(seed=0).at("c", SamplingParams(seed=1), range(20_000), Uniforms.DRAW)
    assert abs(sum(many) / len(many) - 0.5) < 0.01


def test_inverse_cdf_never_draws_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.999999])
    assert sample_from_probs(probs, u).tolist() == [1, 1, 3, 3, 3]


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


@pytest.mark.parametrize("params, warper", [
    (SamplingParams(top_k=2), ("TopKLogitsWarper", dict(top_k=2))),
    (SamplingParams(top_p=0.8), ("TopPLogitsWarper", dict(top_p=0.8))),
    (SamplingParams(min_p=0.2), ("MinPLogitsWarper", dict(min_p=0.2))),
    (SamplingParams(temperature=0.6), ("TemperatureLogitsWarper", dict(temperature=0.6))),
])
def test_filters_match_transformers_warpers(params, warper):
    """transformers' logits warpers are the oracle; ties included (top-k keeps all tied)."""
    import transformers

    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.5, 0.0]]),
                        torch.randn(5, 6, generator=g) * 2])
    name, kwargs = warper
    want = getattr(transformers, name)(**kwargs)(None, logits.clone()).softmax(-1)
    got = target_probs(logits, meta_for([params] * len(logits)))
    assert torch.allclose(got, want, atol=1e-6)


def test_target_logprobs_are_the_log_of_target_probs_without_underflow():
    """The processed log-probabilities in log space: the log of target_probs where that is
    finite, the same tokens filtered, and a kept token far below the best still finite."""
    from specserve.sampler import SamplingMetadata, target_logprobs, target_probs

    params = [SamplingParams(temperature=0.7, top_k=5, min_p=0.1), SamplingParams(temperature=0),
              SamplingParams(top_p=0.8), SamplingParams(min_p=0.3, temperature=1.3), SamplingParams()]
    meta = SamplingMetadata.build(params, torch.device("cpu"))
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[4, 7] = -200.0  # e^-200: zero in float32 probabilities
    logp, p = target_logprobs(logits, meta), target_probs(logits, meta)
    assert torch.equal(torch.isinf(logp[:4]), p[:4] == 0)
    kept = p > 0
    torch.testing.assert_close(logp[kept], p[kept].log(), rtol=0, atol=1e-5)
    plain = SamplingMetadata.build([SamplingParams()], torch.device("cpu"))  # no filter in the batch
    far = target_logprobs(logits[4:], plain)[0, 7]
    assert target_probs(logits[4:], plain)[0, 7] == 0 and torch.isfinite(far) and far < -150
