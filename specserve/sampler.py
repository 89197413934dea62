"""Sampling building blocks: temperature, top-k, top-p and min-p turned into the
distribution a row samples from; inverse-CDF draws from given uniforms; per-request
random numbers keyed by output position. The target and the draft go through the very
same functions, which is what keeps speculative sampling lossless."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specserve.kernels import cpu_ops
from specserve.sampling_params import SamplingParams
from specserve.transfer import to_device


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
        """From per-row params; the tensors reach the device in two asynchronous copies."""
        top_k = [max(p.top_k, 0) for p in params]
        temperature, top_p, min_p = to_device([[p.temperature for p in params], [p.top_p for p in params],
                                               [p.min_p for p in params]], torch.float32, device)
        (top_k_t,) = to_device([top_k], torch.int64, device)
        return cls(temperature=temperature, top_k=top_k_t, top_p=top_p, min_p=min_p,
                   all_greedy=all(p.greedy for p in params), any_top_k=any(k > 0 for k in top_k),
                   any_top_p=any(p.top_p < 1 for p in params), any_min_p=any(p.min_p > 0 for p in params))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as ``logits.argmax(dim=-1)``; on a CPU through the C++ op, which
    vectorises what torch runs element by element over the vocabulary."""
    if _cpu_greedy(logits):
        return torch.ops.specserve_cpu.greedy_rows(logits, False)[0]
    return logits.argmax(dim=-1)


def greedy_confidence(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and its probability under softmax(logits), float32."""
    if _cpu_greedy(logits):
        return torch.ops.specserve_cpu.greedy_rows(logits, True)
    greedy = logits.argmax(dim=-1)
    return greedy, token_probability(logits, greedy)


def token_probability(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's probability of its token ``tokens[i]`` under softmax(logits), float32."""
    best = logits.gather(1, tokens[:, None])[:, 0].float()
    return torch.exp(best - torch.logsumexp(logits.float(), dim=-1))


def _cpu_greedy(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.dtype in (torch.float32, torch.bfloat16) and cpu_ops.available())


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from, after temperature and the filters.

    logits ``[num_rows, vocab]`` -> probs ``[num_rows, vocab]`` float32. Greedy rows get
    temperature 1 here; samplers take their argmax instead.
    """
    probs = _filtered_logits(logits, meta).softmax(dim=-1)
    if meta.any_min_p:
        threshold = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def target_logprobs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``target_probs`` as log-probabilities, computed in log space (no underflow to -inf
    for a token the filters keep): ``[num_rows, vocab]`` float32, -inf where filtered."""
    logprobs = _filtered_logits(logits, meta).log_softmax(dim=-1)
    if meta.any_min_p:  # p < min_p * p_max  <=>  log p < log(min_p) + log p_max
        threshold = meta.min_p.log()[:, None] + logprobs.max(dim=-1, keepdim=True).values
        logprobs = logprobs.masked_fill(logprobs < threshold, float("-inf"))
        logprobs = logprobs - logprobs.logsumexp(dim=-1, keepdim=True)
    return logprobs


def _filtered_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 logits over temperature (1 for greedy rows), top-k and top-p applied (-inf)."""
    temperature = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
    logits = logits.float() / temperature[:, None]
    if meta.any_top_k or meta.any_top_p:
        logits = _top_k_top_p(logits, meta)
    return logits


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


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a fast, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Uniforms:
    """Random numbers keyed by (request seed, output position, purpose).

    Each uniform a request ever uses is a pure function of its seed, the index of the
    output token it decides and what it decides (accepting a draft, drawing a token,
    drafting one). So a seeded request gets the same tokens whatever shares its batch and
    however many drafts each step happens to carry. Reusing the number of a position in a
    later step is safe: a step's outcome depends only on the numbers up to the position
    where it stopped, and every later position is decided afresh.
    Unseeded requests get a seed from the owner's seed, in order of first use.
    """

    ACCEPT, DRAW, DRAFT = 1, 2, 3

    def __init__(self, seed: int) -> None:
        self._seeds = random.Random(seed)
        self._base: dict[str, int] = {}

    def base_seed(self, req_id: str, params: SamplingParams) -> int:
        base = self._base.get(req_id)
        if base is None:
            base = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            self._base[req_id] = base
        return base

    def at(self, req_id: str, params: SamplingParams, positions: range, purpose: int) -> list[float]:
        """One uniform in [0, 1) per output position."""
        base = _mix64(self.base_seed(req_id, params) * 4 + purpose)
        return [(_mix64(base ^ p) >> 11) * 2.0**-53 for p in positions]

    def free(self, req_id: str) -> None:
        self._base.pop(req_id, None)
