"""Adaptive speculation: each step, every decoding request's draft length k_i is chosen to
maximise expected goodput — expected emitted tokens per second of step time.

Two online estimates feed the choice:

* **Acceptance.** Per request, the conditional probability ``alpha[j]`` that draft
  position j is accepted given that all before it were (exponentially smoothed; a new
  request starts from the engine-wide estimate). A request drafting k tokens then emits
  ``E(k) = 1 + sum_{j<k} prod_{m<=j} alpha[m]`` tokens in expectation. Only proposed
  positions teach ``alpha``; how often the drafter proposes at all (n-gram lookup often
  finds nothing) is a second smoothed rate per request, which scales both what its
  drafts gain and what their tokens cost — but not the padding a CUDA graph step pays
  whenever any request in it drafts.
* **Step cost.** ``target = a + b * tokens + c * spans + p * padded`` — a fixed cost, a
  cost per token in the verify pass, a cost per request whose query span is longer than
  one token (its own attention tiles), and a cost per token of the padded shape a CUDA
  graph replays, where every request is padded to the step's longest query (so on a GPU
  a draft depth D costs every request of the batch D tokens; 0 on an eager pass) — plus
  ``draft = depth * (d + e * drafting_requests)`` for the drafter's sequential passes.
  Both are least-squares fits with exponential forgetting over measured steps, seeded by
  a short profile at start-up. A step slower than twice the prediction (another process
  stalled the machine) counts as twice the prediction, so one stall cannot poison the
  fit, while a cost that really changed is still learned, clip after clip.

The choice is a ratio maximisation, max (sum of gains) / (fixed cost + sum of costs),
solved exactly with Dinkelbach's method: with the current ratio lambda, each request's
net value of k drafts is ``r_i * (sum_{j<k} (p_ij - lambda*b) - lambda*c*[k>0])`` (``r_i``
its proposal rate); the best plan for every draft depth D at once is each request's best
k <= D (a running maximum over k) less ``lambda * (d + p * num_reqs) * D``; the best
depth's plan gives the next lambda, which converges in a few rounds (a handful of numpy
operations each, cheap next to a step). So k falls to 0 when tokens are expensive (a
compute-bound batch) or a request's drafts keep failing, and rises to k_max when
acceptance is high and extra tokens are nearly free. A request that has fallen to k = 0
is probed with k = 1 every ``probe_interval`` steps so it can recover.
"""
from __future__ import annotations

import numpy as np

ACCEPT_SMOOTHING = 0.3      # per-request EMA weight of a new observation
PRIOR_SMOOTHING = 0.05      # engine-wide EMA weight
INITIAL_ACCEPTANCE = 0.6    # before any observation
PROBE_INTERVAL = 16
OUTLIER_RATIO = 2.0         # a measured cost is clipped at this multiple of the prediction


class CostModel:
    """Least squares ``y ~ x . theta`` with exponential forgetting (recursive, tiny)."""

    def __init__(self, num_features: int, forgetting: float = 0.98, ridge: float = 1e-6) -> None:
        self.xtx = np.eye(num_features) * ridge
        self.xty = np.zeros(num_features)
        self.forgetting = forgetting
        self.theta = np.zeros(num_features)
        self.num_samples = 0

    def observe(self, x: list[float], y: float) -> None:
        x = np.asarray(x, dtype=float)
        predicted = self.predict(x)
        if self.num_samples >= len(x) and predicted > 0:
            y = min(y, OUTLIER_RATIO * predicted)  # a stall, not the cost of this batch
        self.xtx = self.forgetting * self.xtx + np.outer(x, x)
        self.xty = self.forgetting * self.xty + x * y
        self.num_samples += 1
        # Costs are never negative: clip, so a noisy fit cannot make tokens look free-er than free.
        self.theta = np.clip(np.linalg.lstsq(self.xtx, self.xty, rcond=None)[0], 0.0, None)

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.theta, x))


class DraftLengthController:
    """Chooses k_i per request per step; learns from what each step cost and accepted."""

    def __init__(self, max_k: int, probe_interval: int = PROBE_INTERVAL) -> None:
        self.max_k = max_k
        self.probe_interval = probe_interval
        self.target_cost = CostModel(4)   # [1, tokens, spans, padded tokens] -> seconds
        self.draft_cost = CostModel(2)    # [depth, depth * drafting requests] -> seconds
        self.prior = np.full(max_k, INITIAL_ACCEPTANCE)
        self._alpha: dict[str, np.ndarray] = {}
        self.prior_rate = 1.0                       # engine-wide share of planned drafts proposed
        self._rate: dict[str, float] = {}
        self._idle_steps: dict[str, int] = {}

    # ------------------------------------------------------------------ learning
    def observe_step(self, num_tokens: int, num_spans: int, target_s: float | None,
                     depth: int, num_drafting: int, draft_s: float, num_padded: int = 0) -> None:
        """One step's measured cost: the verify pass and, if any drafting ran, the drafter.
        ``target_s`` None: the verify pass says nothing about what drafts cost (the engine
        passes None for steps with a prefill chunk, which run eagerly where decode and
        verify steps replay CUDA graphs; their cost per token would mislead the choice).
        ``num_padded``: the tokens the pass really ran when it replayed a CUDA graph, every
        request padded to the longest query (0 for an eager pass)."""
        if target_s is not None:
            self.target_cost.observe([1.0, num_tokens, num_spans, num_padded], target_s)
        if depth:
            self.draft_cost.observe([depth, depth * num_drafting], draft_s)

    def observe_acceptance(self, req_id: str, num_planned: int, num_proposed: int,
                           num_accepted: int) -> None:
        """A request was planned ``num_planned`` drafts, the drafter proposed
        ``num_proposed`` of them and the target accepted the first ``num_accepted``."""
        if num_planned == 0:
            return
        share = min(num_proposed / num_planned, 1.0)
        rate = self._rate.get(req_id, self.prior_rate)
        self._rate[req_id] = rate + ACCEPT_SMOOTHING * (share - rate)
        self.prior_rate += PRIOR_SMOOTHING * (share - self.prior_rate)
        if num_proposed == 0:
            return
        alpha = self._alpha.setdefault(req_id, self.prior.copy())
        seen = min(num_accepted + 1, num_proposed)  # accepted ones, then the first rejection
        outcome = np.zeros(seen)
        outcome[:num_accepted] = 1.0
        alpha[:seen] += ACCEPT_SMOOTHING * (outcome - alpha[:seen])
        self.prior[:seen] += PRIOR_SMOOTHING * (outcome - self.prior[:seen])

    def free(self, req_id: str) -> None:
        self._alpha.pop(req_id, None)
        self._rate.pop(req_id, None)
        self._idle_steps.pop(req_id, None)

    # ------------------------------------------------------------------ the choice
    def choose(self, caps: dict[str, int], num_other_tokens: int = 0,
               num_other_spans: int = 0, padded: bool = False) -> dict[str, int]:
        """k_i for each decoding request (``caps``: req_id -> most drafts it may take).
        ``num_other_tokens`` / ``num_other_spans``: the prefill chunks the step runs anyway.
        ``padded``: the step will replay a CUDA graph, where every request is padded to
        the longest query, so a draft depth D costs every request D tokens."""
        if not caps or self.target_cost.num_samples == 0:
            return dict(caps)
        req_ids = list(caps)
        num_reqs, max_k = len(req_ids), self.max_k
        cap = np.minimum(np.fromiter(caps.values(), dtype=int, count=num_reqs), max_k)
        rate = np.array([self._rate.get(r, self.prior_rate) for r in req_ids])[:, None]
        # Expected accepted drafts per position, and the share of planned drafts that are
        # proposed, so verified and paid for per token.
        gains = rate * np.cumprod(np.stack([self._alpha.get(r, self.prior) for r in req_ids]), axis=1)
        over_cap = np.arange(max_k + 1)[None, :] > cap[:, None]        # [num_reqs, max_k + 1]
        _a, b, c, pad = self.target_cost.theta
        pad = pad if padded else 0.0
        d, e = self.draft_cost.theta
        per_token = b + e  # each drafted token is verified and (roughly) drafted once
        fixed = self.target_cost.predict([1.0, num_reqs + num_other_tokens, num_other_spans,
                                          num_reqs if padded else 0])
        depth_cost = (d + pad * num_reqs) * np.arange(max_k + 1)
        k = np.zeros(num_reqs, dtype=int)
        ratio = num_reqs / max(fixed, 1e-9)                            # the plan without drafts
        for _ in range(10):
            net = np.zeros((num_reqs, max_k + 1))                      # value of k = 0..max_k drafts
            net[:, 1:] = np.cumsum(gains - ratio * per_token * rate, axis=1) - ratio * c * rate
            net[over_cap] = -np.inf
            best_upto = np.maximum.accumulate(net, axis=1)             # best k <= D, per request
            depth = int(np.argmax(best_upto.sum(axis=0) - ratio * depth_cost))
            new_k = np.argmax(net[:, :depth + 1], axis=1)              # ties: the smaller k
            cost = (fixed + depth_cost[new_k.max()] + per_token * float(rate[:, 0] @ new_k)
                    + c * float(rate[:, 0] @ (new_k > 0)))
            new_ratio = (num_reqs + _expected(gains, new_k)) / max(cost, 1e-9)
            if np.array_equal(new_k, k) or new_ratio <= ratio:
                break
            k, ratio = new_k, new_ratio
        return self._with_probes(dict(zip(req_ids, k.tolist())), caps)

    def _with_probes(self, chosen: dict[str, int], caps: dict[str, int]) -> dict[str, int]:
        """Give a request idle at k = 0 for ``probe_interval`` steps one draft to test."""
        for req_id, k in chosen.items():
            if k or not caps[req_id]:
                self._idle_steps.pop(req_id, None)
                continue
            idle = self._idle_steps.get(req_id, 0) + 1
            if idle >= self.probe_interval:
                chosen[req_id], idle = 1, 0
            self._idle_steps[req_id] = idle
        return chosen


def _expected(gains: np.ndarray, k: np.ndarray) -> float:
    """Expected accepted drafts: sum over requests of gains[i, :k_i]."""
    mask = np.arange(gains.shape[1])[None, :] < k[:, None]
    return float((gains * mask).sum())
