"""The goodput-maximising draft length per request, a pure function of the estimates
(``plan_draft_lengths``).

The choice is a ratio maximisation, max (sum of gains) / (fixed cost + sum of costs),
solved exactly with Dinkelbach's method: with the current ratio lambda, each request's
net value of k drafts is ``r_i * (sum_{j<k} (p_ij - lambda*b) - lambda*c*[k>0])`` (``r_i``
its proposal rate; with further draft paths, the better of that and it plus what they
add less lambda times what they cost). The best plan for every draft depth D at once is
each request's best k <= D (a running maximum over k) less ``lambda * (o * [D > 0] + d *
passes(D) + p * num_reqs * D)``; the best depth's plan gives the next lambda, which converges in a few
rounds. So k falls to 0 when tokens are expensive (a compute-bound batch) or a request's
drafts keep failing, and rises to k_max when acceptance is high and extra tokens are
nearly free.

The iteration starts from the plan without drafts (at ``Prices.plain``, what the kind's
steps without drafts were seen to cost, where they were) with its ratio raised by ``min_gain``
and divided by ``Prices.promise`` (how far its kind's drafts delivered beyond what their
plans promised): a plan with drafts is taken only if it promises that much more goodput
(Dinkelbach's step finds such a plan whenever one exists). The bar moves only whether
drafts are taken, not which: the best plan's ratio does not depend on where the
iteration starts. The controller's default is no margin: a plan
that loses on what it promised is caught by the goodput check (``goodput.py``), while a
margin gave up every gain smaller than itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Prices:
    """What a step's pieces cost, in seconds (from the cost models)."""

    fixed: float         # the step as it would run without drafts
    token: float         # a verified draft token
    span: float          # a verify span (a request drafting at all)
    padded_token: float  # a padded token a depth costs every request (0 where nothing is padded)
    draft_pass: float    # one drafter pass
    draft_token: float   # a drafted token in one pass
    draft_fixed: float = 0.0  # a step that drafts at all, whatever its depth (the drafter's own part)
    draft_request: float = 0.0  # a request that drafts at all (a lazily fed draft's catch-up on what it accepted)
    plain: float = 0.0   # the step without drafts as measured, the bar a plan with drafts must clear (0: ``fixed``)
    promise: float = 1.0  # how many times what plans promised drafts delivered (>= 1): the bar divided by it


def plan_draft_lengths(alpha: np.ndarray, rate: np.ndarray, cap: np.ndarray, prices: Prices,
                       passes: np.ndarray, min_gain: float, paths: np.ndarray | None = None,
                       path_gain: np.ndarray | None = None, can_fork: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray | None]:
    """k per request, and for those that may fork whether each should verify its own path
    only.

    ``alpha`` ``[n, max_k]``: acceptance per position; ``rate`` ``[n]``: share of planned
    drafts proposed; ``cap`` ``[n]``: most drafts each may take; ``passes`` ``[max_k + 1]``:
    drafter passes per draft depth. Draft paths (all three or none): ``paths``
    ``[max_k + 1]`` paths a forking request verifies at each k, ``path_gain`` extra
    accepted tokens per number of paths, ``can_fork`` ``[n]`` which requests may fork.
    Returns ``(k [n], chain_only [n] or None, goodput)``: chain_only None when no request
    may fork; goodput the plan's expected emitted tokens per second under ``prices`` (the
    bar, raised by the margin, where no plan with drafts beats it)."""
    num_reqs, max_k = alpha.shape
    rate = rate[:, None]
    b, c, e = prices.token, prices.span + prices.draft_request, prices.draft_token
    depths = np.arange(max_k + 1)
    depth_cost = prices.draft_pass * passes + prices.padded_token * num_reqs * depths + \
        prices.draft_fixed * (depths > 0)
    # Per request and k = 0..max_k: expected accepted drafts (each position's chance,
    # times the share of planned drafts the drafter proposes) and the cost of its
    # verified tokens and span (a planned draft not proposed is not paid for): each
    # drafted token is verified and (roughly) drafted once.
    gain = np.zeros((num_reqs, max_k + 1))
    gain[:, 1:] = np.cumsum(rate * np.cumprod(alpha, axis=1), axis=1)
    ks = depths[1:]
    cost_k = np.zeros((num_reqs, max_k + 1))
    cost_k[:, 1:] = rate * (b * ks + e * passes[1:] + c)
    cost_k[np.arange(max_k + 1)[None, :] > cap[:, None]] = np.inf  # over the request's cap
    if can_fork is not None and can_fork.any():
        # A forking request's further paths at k: what they were seen to add, for 1 + k
        # more verified tokens, k more drafted and a span each.
        more = paths[1:] - 1
        fork_gain = np.zeros((num_reqs, max_k + 1))
        fork_cost = np.zeros((num_reqs, max_k + 1))
        fork_gain[can_fork, 1:] = (rate * path_gain[paths[1:]])[can_fork]
        fork_cost[can_fork, 1:] = (rate * (b * more * (1 + ks) + e * more * passes[1:] + c * more))[can_fork]
    else:  # nobody may fork: the plan is over k alone
        can_fork = None
    every = np.arange(num_reqs)
    k = np.zeros(num_reqs, dtype=int)
    fork = new_fork = None
    total_gain, total_cost = gain, cost_k
    # Start from the plan without drafts (as measured where it was), raised by the margin
    # a plan must beat: a plan with drafts is priced by the fit, and taken only if that
    # beats what steps without drafts were seen to deliver.
    ratio = (1.0 + min_gain) * num_reqs / max(prices.plain or prices.fixed, 1e-9) / prices.promise
    for _ in range(10):
        if can_fork is not None:
            new_fork = fork_gain - ratio * fork_cost > 0           # paths pay at this ratio
            total_gain = gain + new_fork * fork_gain
            total_cost = cost_k + new_fork * fork_cost
        net = total_gain - ratio * total_cost                      # value of k = 0..max_k drafts
        best_upto = np.maximum.accumulate(net, axis=1)             # best k <= D, per request
        depth = int(np.argmax(best_upto.sum(axis=0) - ratio * depth_cost))
        new_k = np.argmax(net[:, :depth + 1], axis=1)              # ties: the smaller k
        cost = prices.fixed + depth_cost[new_k.max()] + total_cost[every, new_k].sum()
        new_ratio = (num_reqs + total_gain[every, new_k].sum()) / max(cost, 1e-9)
        if np.array_equal(new_k, k) or new_ratio <= ratio:
            break
        k, ratio, fork = new_k, new_ratio, new_fork
    if can_fork is None:
        return k, None, ratio
    chain_only = can_fork & (k > 0) if fork is None else can_fork & (k > 0) & ~fork[every, k]
    return k, chain_only, ratio
