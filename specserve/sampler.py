"""Sampling building blocks: temperature, top-k, top-p and min-p turned into the
distribution a row samples from; inverse-CDF draws from given uniforms; per-request random
generators. The target and the draft go through the very same functions, which is what
keeps speculative sampling lossless."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for a ``[num_rows, vocab]`` logits matrix."""

    temperature: torch.Tensor            # [num_rows] float32, 0 = greedy
    top_k: torch.Tensor                  # [num_rows] int64, 0 = off
    top_p: torch.Tensor                  # [num_rows] float32, 1 = off
    min_p: torch.Tensor                  # [num_rows] float32, 0 = off
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> "SamplingMetadata":
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        top_k = [max(p.top_k, 0) for p in params]
        return cls(
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1 for p in params),
            any_min_p=any(p.min_p > 0 for p in params))


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from, after temperature and the filters.

    logits ``[num_rows, vocab]`` -> probs ``[num_rows, vocab]`` float32. Greedy rows get
    temperature 1 here; samplers take their argmax instead.
    """
    logits = logits.float()
    temperature = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
    logits = logits / temperature[:, None]
    if meta.any_top_k or meta.any_top_p:
        logits = _top_k_top_p(logits, meta)
    probs = logits.softmax(dim=-1)
    if meta.any_min_p:
        threshold = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if meta.any_top_k:
        # Keep every token tied with the k-th largest, as transformers' TopKLogitsWarper does.
        k = torch.where(meta.top_k > 0, meta.top_k, torch.full_like(meta.top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        remove |= sorted_logits < kth
    if meta.any_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        remove |= before >= meta.top_p[:, None]  # always keeps the first token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: row i takes the first token whose cumulative mass exceeds
    ``uniforms[i]`` times the row's total. Zero-probability tokens are never drawn.
    ``[num_rows, vocab]``, ``[num_rows]`` -> ``[num_rows]`` int64."""
    cdf = probs.cumsum(dim=-1)
    threshold = (uniforms.to(cdf.dtype) * cdf[:, -1])[:, None]
    tokens = torch.searchsorted(cdf, threshold, right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[-1] - 1)


class Generators:
    """One torch.Generator per request: seeded from ``SamplingParams.seed`` when given,
    otherwise from the owner's seed and arrival order, so whole runs are reproducible
    and a seeded request draws the same numbers whatever else shares its batch."""

    def __init__(self, device: torch.device, seed: int, salt: int = 0) -> None:
        """``salt`` separates streams: a drafter drawing for a seeded request must not reuse
        the numbers its verifier draws for the same request."""
        self.device = device
        self.salt = salt
        self._seeds = torch.Generator().manual_seed(seed + salt)
        self._generators: dict[str, torch.Generator] = {}

    def get(self, req_id: str, params: SamplingParams) -> torch.Generator:
        generator = self._generators.get(req_id)
        if generator is None:
            seed = (params.seed * 1_000_003 + self.salt) % 2**63 if params.seed is not None else int(
                torch.randint(2**62, (1,), generator=self._seeds))
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[req_id] = generator
        return generator

    def uniforms(self, req_id: str, params: SamplingParams, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.get(req_id, params), device=self.device)

    def free(self, req_id: str) -> None:
        self._generators.pop(req_id, None)
