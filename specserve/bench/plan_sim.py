"""The adaptive plan against fixed draft lengths on simulated steps: what the controller's
choices of k cost or gain, apart from host time and from the machine's noise.

One request at a time (batch 1), each ``max_tokens`` long, on a CUDA-graph-like step whose
cost is known (``StepCosts``, by default the H200's for the default model and its built-in
draft, measured on 2026-12-01, and the drafter's fixed part estimated from a host-time
run of 2026-12-03), with timing noise. Each draft is accepted with the request's current
acceptance ``a`` given the ones before it were; ``a`` is drawn from ``acceptance`` (a
range; with ``switching``, either end of it, as copied spans and fresh text take turns for
n-gram lookup) for each segment of a request's text, segments of ``segment`` tokens on
average (geometric; 0: one segment a request); or real outputs say which drafts match
(``traces``). Policies: a fixed k, the real
``DraftLengthController`` (``"plan"``: fed every outcome, step time and goodput as the
engine feeds it, its cost model seeded as the engine's start-up profile seeds it), and an
``"oracle"`` that knows ``a`` and the costs and picks the k of the best expected goodput
each step: the most any choice of k could gain over the best fixed one.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from specserve.spec.acceptance import DraftOutcome
from specserve.spec.controller import DraftLengthController
from specserve.spec.cost_model import StepSample, draft_features

CONTEXT = 300  # tokens in the KV cache: the cost model's context feature (the simulated cost ignores it)


@dataclass(frozen=True)
class StepCosts:
    """A batch-1 step of k drafts: the target pass ``base + span * [k > 0] + token * (1 + k)``
    and the drafter's ``draft_fixed * [k > 0] + draft_pass * (k - 1)`` (a draft model's
    first proposal comes with its catch-up; what drafting costs past it whatever the
    depth, then its passes), in seconds, each times a log-normal noise of ``noise``. ``plan_host``:
    the host time the controller reads for a plan and for its step's cost fit each (on the
    H200's host about 0.5 and 0.15 ms), which sets how long its plans stand; the simulated
    steps do not pay it."""

    base: float = 1.33e-3
    span: float = 0.15e-3
    token: float = 0.01e-3
    draft_pass: float = 0.10e-3
    draft_fixed: float = 0.08e-3
    noise: float = 0.08
    plan_host: float = 0.3e-3

    def target(self, k: int) -> float:
        return self.base + (self.span if k else 0.0) + self.token * (1 + k)

    def draft(self, k: int) -> float:
        return (self.draft_fixed if k else 0.0) + self.draft_pass * max(k - 1, 0)


class _Clock:
    """A clock that moves ``tick`` seconds each time it is read."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def seeded_controller(max_k: int, costs: StepCosts) -> DraftLengthController:
    """A controller whose cost model is seeded much as ``Speculator.profile_step_cost``
    seeds it at batch 1: verify passes without drafts and with k (here at two contexts, so
    the fit can tell a context's cost from the fixed one), and a draft pass."""
    ctl = DraftLengthController(max_k, first_draft_in_catch_up=True)
    ctl.timer = _Clock(costs.plan_host)  # the simulation's own: its plans stand as long wherever it runs
    for k in (0, max_k):
        for context in (64, 1024):
            ctl.observe_step(StepSample(costs.target(k), num_tokens=1 + k, num_spans=1 if k else 0,
                                        num_padded=1 + k, num_reqs=1, context=context))
    ctl.costs.draft.observe(draft_features(1, 1, drafting=False), costs.draft_pass)
    ctl.costs.target.anchor(weight=0.1)
    ctl.costs.draft.anchor(weight=0.1)
    return ctl


def simulate(policy: int | str, max_k: int = 4, acceptance: tuple[float, float] = (0.3, 0.85),
             segment: float = 0.0, requests: int = 300, max_tokens: int = 128, seed: int = 0,
             costs: StepCosts = StepCosts(), switching: bool = False,
             traces: list[list[bool]] | None = None) -> tuple[float, float]:
    """Tokens per simulated second and the mean k verified, for ``policy``: a fixed k (an
    int), ``"plan"`` or ``"oracle"``. The same seed gives every policy the same texts
    (segments and their acceptance). ``traces``: real texts instead, each a list of
    whether the draft's greedy token at each generated position (on the true prefix)
    was the target's (``benchmarks/acceptance_traces.py``): k drafts from position t
    keep the run of matches from t, at most k; requests take the traces in turn, each as
    long as its trace (no oracle: it would know every token)."""
    if traces is not None and policy == "oracle":
        raise ValueError("the oracle needs an acceptance to know; real traces have none")
    text_rng, accept_rng, noise_rng = (random.Random(seed * 3 + i) for i in range(3))
    ctl = seeded_controller(max_k, costs) if policy == "plan" else None
    tokens = seconds = 0.0
    steps = drafted = 0
    for r in range(requests):
        trace = traces[r % len(traces)] if traces is not None else None
        length = len(trace) if trace is not None else max_tokens
        req_id, left = f"r{r}", length
        segments = []  # (first token after it, its acceptance)
        while trace is None and (not segments or segments[-1][0] < max_tokens):
            size = 1 + int(text_rng.expovariate(1.0 / segment)) if segment else max_tokens
            accept = acceptance[text_rng.random() < 0.5] if switching else text_rng.uniform(*acceptance)
            segments.append(((segments[-1][0] if segments else 0) + size, accept))
        while left > 0:
            at = length - left
            a = None if trace is not None else next(accept for end, accept in segments if end > at)
            cap = min(max_k, left - 1)
            if ctl is not None:  # the engine's caps: k, the drafts past max_tokens trimmed once chosen
                k = min(ctl.choose({req_id: max_k}, padded=True, context=CONTEXT, joined=r + 1)[req_id], cap)
            elif policy == "oracle":
                k = max(range(cap + 1), key=lambda j: sum(a ** i for i in range(j + 1)) /
                        (costs.target(j) + costs.draft(j)))
            else:
                k = min(int(policy), left - 1)
            accepted = 0
            if trace is not None:
                while accepted < k and trace[at + accepted]:
                    accepted += 1
            else:
                while accepted < k and accept_rng.random() < a:
                    accepted += 1
            emitted = min(1 + accepted, left)
            jitter = math.exp(noise_rng.gauss(0.0, costs.noise))
            target_s, draft_s = costs.target(k) * jitter, costs.draft(k) * jitter
            if ctl is not None:
                if k:
                    ctl.observe_acceptance(req_id, DraftOutcome(k, k, accepted))
                ctl.observe_goodput(emitted, target_s + draft_s)
                if ctl.wants_step_cost:
                    ctl.observe_step(StepSample(target_s, num_tokens=1 + k, num_spans=1 if k else 0,
                                                num_padded=1 + k, num_reqs=1, context=CONTEXT, depth=k,
                                                num_drafting=1 if k else 0, draft_s=draft_s))
            left -= emitted
            tokens += emitted
            seconds += target_s + draft_s
            steps += 1
            drafted += k
        if ctl is not None:
            ctl.free(req_id)
    return tokens / seconds, drafted / steps
