"""What a step costs, learned online: least-squares fits of the target pass's time and the
drafter's, from the steps the engine runs.

* **Target.** ``a + b * tokens + q * requests + x * context + c * spans + p * padded +
  f * prefill + m * [prefill]``: a fixed cost, a cost per decode or verify token, per
  request and per token of context its attention reads (on a CPU, gathering a long
  context's keys costs more than a few more query tokens), per request whose query span
  is longer than one token (its own attention tiles), per padded token where the pass
  pads every request to the step's longest query (a CUDA graph replay does, and so does
  the CPU's attention over decode and verify spans: a draft depth D then costs every
  request D tokens), and the prefill chunks' tokens and a step with any its own fixed
  cost (on a GPU it replays a ragged graph, not a padded one, or runs eagerly). It is
  the whole step's wall time less the drafter's: the host work around the pass (verify
  lists, rollback, detokenising more tokens) is part of what drafts cost.
* **Drafter.** ``o + g * drafting_requests + d * passes + e * rows`` for a step that
  drafts at all: what drafting costs whatever its depth (ranking the first proposals,
  gathering them for the verify pass), what each request that drafts adds to it (a
  lazily fed draft model's first pass catches it up on the tokens the target accepted:
  two or more rows each, not one), and its sequential passes and the rows they run all
  together. The passes are D for a draft depth D, or D - 1 for a draft model whose
  catch-up runs at every step whatever k is and yields the first proposals (its time
  counts with the target's). Their rows are each drafting request's passes for its own
  k, or fewer where drafting stops by confidence (a pass then runs only the rows still
  drafting). Without ``o`` a depth's fixed part was spread over its passes (and a draft
  model's depth of 1, with none, taught nothing): a depth of 2 priced its one pass at
  both, and the plan drafted too little. Without ``g`` the catch-up of a full batch was
  priced from the fixed cost the fit learned over every batch size, far under what it
  took, and the plan drafted where drafts lost.

Both forget old steps exponentially, and no cost is negative (an active-set solve). A
start-up profile is kept for good (``CostModel.anchor``): it varies what a steady state
does not, such as how many requests draft, so the fit can still tell the costs apart.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OUTLIER_RATIO = 2.0   # a measured cost is clipped at this multiple of the prediction
RESOLVE_ERROR = 0.25  # a fit is solved at once for a sample off by more than this
RESOLVE_EVERY = 8     # and else every this many samples
SEEN_WEIGHT = 0.05    # a side of the kernels' switch is known from this much sample weight on (``seen_above``)


class CostModel:
    """Least squares ``y ~ x . theta`` with exponential forgetting (recursive, tiny).

    ``anchor()`` keeps the samples seen so far (the start-up profile) for good: online
    steps are forgotten, and in a steady state they vary little (a batch that never
    drafts has as many tokens as requests, so the two costs cannot be told apart from
    it); the anchor still tells them apart, while online steps move every cost they do
    show."""

    def __init__(self, num_features: int, forgetting: float = 0.98, ridge: float = 1e-6) -> None:
        self.anchor_xtx = np.eye(num_features) * ridge
        self.anchor_xty = np.zeros(num_features)
        self.xtx = np.zeros((num_features, num_features))
        self.xty = np.zeros(num_features)
        self.forgetting = forgetting
        self.theta = np.zeros(num_features)
        self.num_samples = 0
        self.anchored = False  # a start-up profile is kept: its predictions can be trusted from the first step
        self._unsolved = 0  # samples since the last solve

    def observe(self, x: list[float], y: float) -> None:
        """Learn one sample. A step slower than ``OUTLIER_RATIO`` times the prediction
        (another process stalled the machine, or one-off work such as the first verify
        pass's kernel compilation on a GPU) counts as that much, so one stall cannot
        poison the fit, while a cost that really changed is still learned, clip after clip.
        The prediction is trusted once the fit has seen as many samples as it has costs,
        or from the first sample after a start-up profile (``anchor``): the first drafted
        step of an engine's life is the one most often slowed by one-off work.
        The fit is solved again at once when the sample surprises it (off the prediction
        by more than ``RESOLVE_ERROR``), else every ``RESOLVE_EVERY`` samples: a step that
        costs what was predicted teaches the plan nothing it needs now."""
        x = np.asarray(x, dtype=float)
        predicted = self.predict(x)
        surprise = self.num_samples < 2 * len(x) or abs(y - predicted) > RESOLVE_ERROR * predicted
        if (self.anchored or self.num_samples >= len(x)) and predicted > 0:
            y = min(y, OUTLIER_RATIO * predicted)  # a stall, not the cost of this batch
        self.xtx *= self.forgetting
        self.xtx += np.outer(x, x)
        self.xty *= self.forgetting
        self.xty += x * y
        self.num_samples += 1
        self._unsolved += 1
        if surprise or self._unsolved >= RESOLVE_EVERY:
            self.solve()

    def solve(self) -> None:
        """The least-squares fit of every sample so far with no cost negative
        (``nonnegative_fit``). Clipping an unconstrained fit at zero instead leaves the
        costs it had set against the negative one too high: where features move together
        (a step's requests, its context and the fixed cost; its tokens, padded tokens and
        verify span) the clipped fit predicted the steps it learned from well above what
        they took, and the steps it had not seen (a large batch) further still."""
        self._unsolved = 0
        # A ridge a billionth of the scale: the least-norm fit where the samples cannot tell
        # costs apart, and much cheaper than an SVD.
        xtx = self.anchor_xtx + self.xtx
        xtx = xtx + (1e-9 * np.trace(xtx) / len(xtx) + 1e-12) * np.eye(len(xtx))
        self.theta = nonnegative_fit(xtx, self.anchor_xty + self.xty, self.theta > 0)

    def anchor(self, weight: float = 1.0) -> None:
        """Keep every sample observed so far unforgotten, at ``weight`` each."""
        self.anchor_xtx = self.anchor_xtx + weight * self.xtx
        self.anchor_xty = self.anchor_xty + weight * self.xty
        self.anchored = True
        self.xtx = np.zeros_like(self.xtx)
        self.xty = np.zeros_like(self.xty)
        self.solve()

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.theta, x))


def nonnegative_fit(xtx: np.ndarray, xty: np.ndarray, start: np.ndarray) -> np.ndarray:
    """argmin over theta >= 0 of ``theta' xtx theta / 2 - xty' theta`` (least squares from
    its normal equations, ``xtx`` positive definite): Lawson and Hanson's active set,
    starting from the costs ``start`` marks as positive (the last fit's: a fit that moved
    a little takes one solve)."""
    n = len(xty)
    tol = 1e-10 * max(float(np.abs(xty).max()), 1e-30)
    theta = np.zeros(n)
    positive = np.zeros(n, dtype=bool)
    if start.any():
        trial = np.linalg.solve(xtx[np.ix_(start, start)], xty[start])
        if (trial > 0).all():
            theta[start], positive = trial, start.copy()
    for _ in range(3 * n):
        gradient = xty - xtx @ theta  # where raising a cost held at zero would lower the error
        gradient[positive] = -np.inf
        j = int(np.argmax(gradient))
        if gradient[j] <= tol:
            break
        positive[j] = True
        while True:
            trial = np.zeros(n)
            trial[positive] = np.linalg.solve(xtx[np.ix_(positive, positive)], xty[positive])
            if (trial[positive] > 0).all():
                break
            # Step from theta towards trial until a cost reaches zero; hold it there.
            falling = positive & (trial <= 0)
            step = float(np.min(theta[falling] / np.maximum(theta[falling] - trial[falling], 1e-300)))
            theta = theta + step * (trial - theta)
            positive &= theta > 0
            theta[~positive] = 0.0
        theta = trial
    return theta


@dataclass(frozen=True)
class StepSample:
    """One step's measured cost and the shape that explains it."""

    target_s: float | None   # the step less the drafter's time; None: the pass says nothing
    num_tokens: int = 0      # decode and verify tokens
    num_spans: int = 0       # requests whose query span is longer than one token (verify spans)
    num_padded: int = 0      # tokens the pass ran where it padded every request to the longest query
    num_reqs: int = 1        # requests in the pass
    context: int = 0         # their tokens in the KV cache after it, all together
    num_prefill: int = 0     # prefill chunks' tokens
    depth: int = 0           # draft depth: the step's longest k
    num_drafting: int = 0    # requests that drafted
    draft_s: float = 0.0     # the drafter's time, its catch-up excluded
    draft_rows: int | None = None  # rows its passes ran, all together (None: the depth's passes x num_drafting)


def target_features(num_tokens: int, num_reqs: int, context: int, num_spans: int, num_padded: int,
                    num_prefill: int = 0, switch_rows: int = 0, above: bool | None = None) -> list[float]:
    """The target cost model's inputs: decode/verify tokens, requests, context (in
    thousands of tokens, to keep the fit's columns alike in scale), verify spans, padded
    tokens, prefill tokens and whether the step has any; then whether the pass's rows
    (its tokens and prefill tokens) reach ``switch_rows`` (0: no such count), and its
    decode/verify tokens there. From that many rows a pass runs its projections another
    way (a quantized CPU layer unpacks its weight: ``QuantLinear.dequant_rows``), at another
    cost per token with a fixed cost of its own; one slope for both priced a lone request's
    verify tokens at a batch's. ``above``: the pass priced on that side of the switch
    whatever its rows (None: by its rows)."""
    if above is None:
        above = 0 < switch_rows <= num_tokens + num_prefill
    above = above and switch_rows > 0
    return [1.0, 0 if above else num_tokens, num_reqs, context / 1000.0, num_spans, num_padded, num_prefill,
            1.0 if num_prefill else 0.0, 1.0 if above else 0.0, num_tokens if above else 0]


def draft_features(passes: int, num_drafting: int, rows: int | None = None, drafting: bool = True) -> list[float]:
    """The drafter's cost model's inputs: a step that drafts at all, the requests that
    draft, its passes and the rows they run all together (None: every pass runs every
    drafting request). ``drafting`` False: passes alone over ``num_drafting`` rows each
    (the start-up profile's)."""
    rows = passes * num_drafting if rows is None else rows
    return [1.0 if drafting else 0.0, float(num_drafting) if drafting else 0.0, float(passes), float(rows)]


class StepCosts:
    """The target pass's cost model and the drafter's.

    ``first_draft_in_catch_up``: the drafter catches its cache up every step, whatever k
    is, and that pass yields the first proposals (a draft model): a draft depth D costs
    D - 1 passes of the drafter, not D. The catch-up's time is the target's where steps
    without drafts wait for it too, else (fed after the target's pass in those,
    ``Speculator.catch_up``) the drafter's: what drafting at all costs, the step's and
    each drafting request's.
    ``switch_rows``: the target's (``target_features``)."""

    def __init__(self, first_draft_in_catch_up: bool = False, switch_rows: int = 0) -> None:
        self.target = CostModel(10)  # target_features -> seconds
        self.draft = CostModel(4)    # draft_features -> seconds
        self.first_free = int(first_draft_in_catch_up)
        self.switch_rows = switch_rows

    def features(self, num_tokens: int, num_reqs: int, context: int, num_spans: int, num_padded: int,
                 num_prefill: int = 0, above: bool | None = None) -> list[float]:
        """``target_features`` of a pass of this target."""
        return target_features(num_tokens, num_reqs, context, num_spans, num_padded, num_prefill, self.switch_rows,
                               above)

    def token_price(self, rows: int) -> float:
        """What a further decode/verify token costs a pass of ``rows`` rows: the fit's slope
        on that side of ``switch_rows``."""
        theta = self.target.theta
        return float(theta[9] if 0 < self.switch_rows <= rows else theta[1])

    def seen_above(self) -> bool:
        """Whether the target's fit has timed passes at or above ``switch_rows`` (the
        start-up profile's batches of 32, or steps since): it prices that side only then."""
        target = self.target
        return self.switch_rows > 0 and float(target.anchor_xtx[8, 8] + target.xtx[8, 8]) > SEEN_WEIGHT

    def drafter_passes(self, depths: np.ndarray) -> np.ndarray:
        """The drafter's sequential passes a draft depth costs."""
        return np.maximum(depths - self.first_free, 0)

    def observe(self, sample: StepSample) -> None:
        if sample.target_s is not None:
            self.target.observe(self.features(sample.num_tokens, sample.num_reqs, sample.context,
                                              sample.num_spans, sample.num_padded, sample.num_prefill),
                                sample.target_s)
        if sample.depth > 0:
            self.draft.observe(draft_features(self.drafter_passes(sample.depth), sample.num_drafting,
                                              sample.draft_rows), sample.draft_s)
