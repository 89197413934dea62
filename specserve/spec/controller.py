"""Adaptive speculation: each step, every decoding request's draft length k_i is chosen to
maximise expected goodput, expected emitted tokens per second of step time
(``DraftLengthController``).

It brings together what is learned online (``acceptance.py``: how often each request's
drafts are accepted; ``cost_model.py``: what a step and the drafter cost), the plan
(``planner.py``, a pure function of those) and the check that the plan delivers
(``goodput.py``). The choice must stay cheap next to a GPU step at hundreds of requests:
each kind of step (same padding, prefill or not, batch size within a factor of two)
keeps its plan for a few of its steps (``StandingPlan``), longer while it drafts nothing,
and only freshly planned steps are timed for the cost model. A plan with drafts stands
``DRAFT_REPLAN`` steps, or more where its own host time would be more than ``PLAN_SHARE``
of them (a short GPU step at batch 1 on a slow host), unless most of the batch is new to it;
``DRAFT_REPLAN_MAX`` for a lone request whose drafter stops token by token by its confidence
(the plan then only bounds what the drafter decides). The engine teaches it a step, and
makes the next step's choice where it can, while a step's verify pass is under way
(``Speculator.learn``): on a GPU neither then adds to the step.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, replace

import numpy as np

from specserve.spec.acceptance import AcceptanceEstimates, DraftOutcome
from specserve.spec.calibration import ConfidenceCalibration
from specserve.spec.cost_model import StepCosts, StepSample
from specserve.spec.goodput import GoodputCheck
from specserve.spec.planner import Prices, plan_draft_lengths
from specserve.spec.stopping import StopRule

# Drafts are planned only if they promise this much more goodput than none: no margin, the
# goodput check is the safety net (one of 0.10 left gains untaken on every workload measured).
MIN_GAIN = 0.0
IDLE_REPLAN = 16            # while the plan is to draft nothing, a full choice after this many steps
IDLE_REPLAN_S = 0.2         # and, for a batch of IDLE_REPLAN_BATCH or more, this many seconds of
IDLE_REPLAN_BATCH = 16      # steps (all kinds) since it was made,
IDLE_REPLAN_MAX = 128       # or after this many steps of its kind, however short
DRAFT_REPLAN = 2            # while it drafts, every this many (requests keep their k in between),
PLAN_SHARE = 0.02           # or more, until a plan's host time is at most this share of the steps it serves,
PLAN_SMOOTHING = 0.2        # (a plan's host time smoothed with this weight a plan)
DRAFT_REPLAN_MAX = 16       # up to this many


@dataclass
class StandingPlan:
    """A kind of step's last plan, repeated for its next few steps."""

    draft_lengths: dict[str, int]   # k > 0 per request (empty: it drafts nothing)
    unforked: set[str]              # forkable requests that verify their own path only
    made_at: int                    # the controller's choices when it was made
    made_s: float                   # its clock when it was made
    prices: Prices | None = None    # what the step's pieces cost when it was made
    served: int = 1                 # choices it served
    stands: int = DRAFT_REPLAN      # choices it serves, with drafts
    joined: int = 0                 # requests joined (``choose``'s count) when it was made
    promised: float = 0.0           # the goodput it expected, with drafts (tokens per second)


@dataclass
class Choice:
    """What a choice's step teaches once it has run (``observe_goodput``, ``observe_step``):
    its kind's goodput check and the side the step ran (drafts or none, by the plan or
    against it), and whether it was planned afresh (its step is then timed for the cost
    model, whose fit counts in the plan's host time). The engine may apply it after the
    next choice was made (``Speculator.learn``)."""

    check: GoodputCheck | None = None
    drafted: bool = False
    checked: bool = False
    promised: float = 0.0  # the goodput its plan expected of its drafts (0: none)
    planned: bool = False
    after_drafts: bool = False  # the step before was chosen for the same kind, with drafts (``_choose``)
    before: tuple = (None, False)  # the kind (check) and drafts of the choice before it,
    continued: bool = False        # whether it took a plain check's next step,
    started: tuple | None = None   # and a plain check it began at a switch (``withdraw``)
    fit_weight: float = 0.0  # what its fit's time weighs in the plan's
    regime: tuple | None = None            # a fresh plan's kind of step,
    replaced: StandingPlan | None = None   # and the plan it replaced there (``withdraw``)


class DraftLengthController:
    """Chooses k_i per request per step; learns from what each step cost and accepted."""

    def __init__(self, max_k: int, min_gain: float | None = None, check_goodput: bool = True,
                 forks: tuple[tuple[int, int], ...] = (), first_draft_in_catch_up: bool = False,
                 confidence: bool = False, switch_rows: int = 0, lazy_from: float = math.inf) -> None:
        """``forks``: the further draft paths' (depth, rank) (``DraftPaths.forks``): a
        request drafting k tokens may verify one path more for each fork above depth k.
        ``first_draft_in_catch_up``: the drafter's catch-up yields the first proposals
        (``StepCosts``). ``lazy_from``: steps of at least this many requests leave a
        request that drafts nothing unfed (``Drafter.lazy_from``). ``confidence``: the
        drafter stops token by token by its confidence (``spec.stopping``; not with
        further paths, which keep their static forks): the plan is then the most each
        request may draft, made with the calibration map's best case, and the drafter
        decides how much of it to use.
        ``switch_rows``: the rows from which the target's pass runs its projections
        another way (``target_features``; 0: none). ``min_gain``: how much more goodput
        than none a plan with drafts must promise (None: ``MIN_GAIN``, read when the
        controller is made)."""
        self.max_k = max_k
        self.calibration = ConfidenceCalibration() if confidence and not forks else None
        self.stop: StopRule | None = None  # the last choice's stopping rule (None: drafts as planned)
        # Draft paths per request at k = 0..max_k (1 at k = 0: none but its own).
        self._paths = np.array([1 + sum(depth < k for depth, _ in forks) for k in range(max_k + 1)])
        # Per-request acceptance, what the plan reads without a map (with one it reads the
        # map's best case, and the drafter judges each token): not kept where unread.
        self.estimates = AcceptanceEstimates(max_k, len(forks) + 1) if self.calibration is None else None
        self.costs = StepCosts(first_draft_in_catch_up, switch_rows)
        self.unforked: set[str] = set()  # the last choice's requests to verify their own path only
        self.min_gain = MIN_GAIN if min_gain is None else min_gain
        self.measured_plain = True  # the plan without drafts priced as its kind's steps showed; False: by the fit
        self.check_goodput = check_goodput  # False: the plan stands unchecked (benchmarks, tests)
        self.keep_promises = True  # the bar lowered where drafts deliver more than promised (``GoodputCheck.promise``)
        self.checks: dict[tuple, GoodputCheck] = {}  # per kind of step
        self._plans: dict[tuple, StandingPlan] = {}  # per kind of step
        self._steps_since_plan = 0   # choices since the last full plan (the rest repeated it)
        self._choices = 0            # choices made, all together
        self._clock = 0.0            # seconds of steps observed (observe_goodput), all kinds together
        self.idle_replan = IDLE_REPLAN      # a plan without drafts stands for this many steps
        self.idle_replan_s = IDLE_REPLAN_S  # (and seconds; at most IDLE_REPLAN_MAX steps)
        self.draft_replan = DRAFT_REPLAN    # and one with drafts for this many at least,
        self.plan_share = PLAN_SHARE        # more while a plan costs more than this share of its steps
        self.timer = time.perf_counter      # times the plans
        self._plan_s = 0.0                  # a plan's host time, smoothed, its step's cost fit included
        self._step_s = 0.0                  # a step's wall time, smoothed
        self.last = Choice()                # the last choice, what its step will teach
        # The last choice's kind (its check) and whether it chose drafts (``_choose``).
        self._before: tuple[GoodputCheck | None, bool] = (None, False)
        # In steps of fewer requests than this the drafter catches its cache up whatever k
        # is, so a step without drafts right after one of its kind with drafts is a switch
        # (``GoodputCheck.observe``): inf for one fed every step, ``lazy_from`` for one fed
        # lazily in large steps only, 0 for one fed lazily (stopping by confidence, n-gram)
        # or not at all, which feeds nothing in a step without drafts.
        self.switches_below = lazy_from if first_draft_in_catch_up else 0

    # ------------------------------------------------------------------ learning
    @property
    def wants_step_cost(self) -> bool:
        """Whether the step just planned should be timed: every step the controller
        planned afresh (while a standing plan repeats, a step teaches little the last did not)."""
        return self.last.planned

    def observe_step(self, sample: StepSample, choice: Choice | None = None) -> None:
        """One step's measured cost: the verify pass and, if any drafting ran, the drafter.
        The fit is host time the plan that asked for it costs: it counts in the plan's.
        ``choice``: the step's (None: the last)."""
        choice = choice or self.last
        began = self.timer()
        self.costs.observe(sample)
        self._plan_s += choice.fit_weight * (self.timer() - began)
        choice.fit_weight = 0.0  # one fit a plan

    def observe_goodput(self, num_tokens: int, seconds: float, choice: Choice | None = None,
                        backlog_s: float = 0.0, after_drafts: bool | None = None) -> None:
        """A step emitted ``num_tokens`` in ``seconds`` of wall time (the whole step,
        drafting included): its kind's goodput check learns from it. ``choice``: the
        step's (None: the last). ``backlog_s``: what the step spent besides, on earlier
        steps' tokens; ``after_drafts``: whether the step before ran drafts and this one
        none, as they ran (None: as the controller chose them); with the step before of
        the same kind, a switch (``GoodputCheck.observe``)."""
        choice = choice or self.last
        self._clock += seconds
        self._step_s = seconds if not self._step_s else self._step_s + 0.1 * (seconds - self._step_s)
        if choice.check is not None and self.check_goodput:
            check, choice.check = choice.check, None  # taught once
            check.observe(choice.drafted, choice.checked, num_tokens, seconds, backlog_s, choice.promised,
                          choice.after_drafts and (after_drafts is None or after_drafts))

    def observe_acceptance(self, req_id: str, outcome: DraftOutcome) -> None:
        if self.estimates is not None:
            self.estimates.observe(req_id, outcome)

    def observe_confidence(self, greedy, depth, confidence, accepted) -> None:
        """Verified draft tokens, flat: the calibration map learns from each
        (``ConfidenceCalibration.observe``)."""
        if self.calibration is not None:
            self.calibration.observe(greedy, depth, confidence, accepted)

    def settle(self) -> None:
        """Apply the queued acceptance outcomes to the estimates now, rather than at the
        next plan (``AcceptanceEstimates.apply_pending``): the engine calls it while a
        verify pass runs, so that a plan made between steps does not pay for it. Under
        load a plan is made there most of the times the running requests change, after
        plans that stood for several steps, whose outcomes are applied step by step."""
        if self.estimates is not None:
            self.estimates.apply_pending()

    def acceptance(self, req_id: str) -> np.ndarray:
        """The request's acceptance per position as the plan reads it (without a map)."""
        return self.estimates.acceptance(req_id)

    def set_estimates(self, req_id: str, alpha, rate: float) -> None:
        self.estimates.set(req_id, alpha, rate)

    def free(self, req_id: str) -> None:
        if self.estimates is not None:
            self.estimates.free(req_id)

    # ------------------------------------------------------------------ the choice
    def choose(self, caps: dict[str, int], num_other_tokens: int = 0,
               num_other_spans: int = 0, padded: bool = False,
               context: int | Callable[[], int] = 0, forkable: Container[str] = (),
               joined: int = 0) -> dict[str, int]:
        """k_i for each decoding request (``caps``: req_id -> most drafts it may take), and
        in ``unforked`` those of ``forkable`` (requests that may verify further draft
        paths: greedy ones) whose drafts pay more without them.
        ``num_other_tokens`` / ``num_other_spans``: the prefill chunks the step runs anyway.
        ``context``: the tokens in the KV cache of every request in the step, all together,
        or a function that counts them, called only if a plan is made (most steps repeat
        a standing plan, and counting walks every request).
        ``padded``: the step will pad every request to the longest query (a CUDA graph
        replay; the CPU attention), so a draft depth D costs every request D tokens.
        ``joined``: how many requests ever joined ``caps`` (a running count,
        ``DecodingRequests.joined``): when more than half the batch joined since a plan or
        a veto was made, they are about other requests (at batch 1, the next one)."""
        before = self._before
        k = self._choose(caps, num_other_tokens, num_other_spans, padded, context, forkable, joined)
        self.last.before, self._before = before, (self.last.check, any(k.values()))
        return k

    def _choose(self, caps: dict[str, int], num_other_tokens: int, num_other_spans: int, padded: bool,
                context: int | Callable[[], int], forkable: Container[str], joined: int) -> dict[str, int]:
        self.last = choice = Choice()
        self.unforked = set()
        self.stop = None
        if not caps or self.costs.target.num_samples == 0:
            return dict(caps)
        self._steps_since_plan += 1
        self._choices += 1
        if self.estimates is not None:
            self.estimates.new_step()
        regime = (padded, num_other_tokens > 0, len(caps).bit_length())
        check = self.checks.get(regime)
        if check is None:
            check = self.checks[regime] = GoodputCheck(self.max_k, batch=1 << (regime[2] - 1))
            for size in (regime[2] + 1, regime[2] - 1):  # a neighbour's verdict, the larger one's first
                neighbour = self.checks.get((*regime[:2], size))
                if neighbour is not None:
                    check.inherit(neighbour)
                    break
        # Right after a step of its kind with drafts, a step without is the switch
        # (``GoodputCheck.observe``); a plain check chosen there goes on at the kind's next step.
        choice.after_drafts = len(caps) + num_other_spans < self.switches_below and self._before == (check, True)
        if check.continues():
            choice.check, choice.checked, choice.continued = check, True, True
            return dict.fromkeys(caps, 0)
        if check.vetoed:
            check.saw(joined, len(caps))  # a batch mostly new to the veto weighs its evidence less
        standing = self._plans.get(regime)
        if standing is not None and (self._expired(standing, regime[2] >= IDLE_REPLAN_BATCH.bit_length())
                                     or (standing.draft_lengths and 2 * (joined - standing.joined) > len(caps))):
            standing = None
        if (standing is not None and not standing.draft_lengths) or (check.vetoed and not check.stale(drafted=True)):
            # The kind's plan drafts nothing: it stands for a few steps (the drifts catch
            # up at the next plan), so where drafting does not pay (large, host-bound
            # batches) the choice costs least. Each kind keeps its own: under load, steps
            # that admit a request and steps that do not take turns, and one plan for both
            # would be made again at every turn. Nor is a plan made where drafts are
            # vetoed, but at the vetoed kind's next check.
            if standing is not None:
                standing.served += 1
            choice.check = check
            return dict.fromkeys(caps, 0)
        if standing is not None:
            # A plan with drafts stands for a step more: each request keeps its k (a new one
            # drafts nothing until the next plan).
            standing.served += 1
            get = standing.draft_lengths.get
            k = [min(get(r, 0), cap) for r, cap in caps.items()]
            self.unforked = standing.unforked
        else:
            began = self.timer()
            planned, self.unforked, prices, promised = self._plan(caps, num_other_tokens, num_other_spans, padded,
                                                                  context, forkable, check)
            k = planned.tolist()
            spent, first = self.timer() - began, not self._plan_s
            self._plan_s = spent if first else self._plan_s + PLAN_SMOOTHING * (spent - self._plan_s)
            choice.fit_weight = 1.0 if first else PLAN_SMOOTHING  # its step's fit joins it (observe_step)
            choice.planned, choice.regime, choice.replaced = True, regime, self._plans.get(regime)
            standing = self._plans[regime] = StandingPlan({r: kr for r, kr in zip(caps, k) if kr},
                                                          self.unforked, self._choices, self._clock, prices,
                                                          stands=self._stands(self._plans.get(regime), joined,
                                                                              len(caps)),
                                                          joined=joined, promised=promised)
        drafted = any(k)
        checked = drafted and (check.vetoed or check.stale(drafted=False))
        choice.check, choice.checked = check, checked
        if checked:  # a step of the stale side is on its way: the next choice does not check again
            marks = check.running(drafted=check.vetoed, switch=choice.after_drafts)
            if choice.after_drafts and not check.vetoed:
                choice.started = marks
        if checked and not check.vetoed:
            return dict.fromkeys(caps, 0)  # the check: this step runs without the plan's drafts
        choice.drafted = drafted
        choice.promised = standing.promised if drafted else 0.0
        if drafted and self.calibration is not None and standing.prices is not None:
            self.stop = StopRule(self.calibration, standing.prices, len(caps), caps, padded)
        return dict(zip(caps, k))

    def withdraw(self, choice: Choice) -> None:
        """``choice`` (made ahead for a step whose requests then changed) will not run: a
        fresh plan it made does not stand for the requests that replace them (a request
        that joined would draft nothing until the plan after it); the plan it replaced
        stands again, served, so the next choice plans afresh. The controller's record of
        the step before is as it was (one choice is made ahead at a time: the last), and
        what it did to a plain check begun at a switch undone (``GoodputCheck.unchoose``)."""
        self._before = choice.before
        if (choice.continued or choice.started is not None) and choice.check is not None:
            choice.check.unchoose(choice.continued, choice.started)
        if choice.planned and choice.regime is not None:
            if choice.replaced is None:
                self._plans.pop(choice.regime, None)
            else:
                self._plans[choice.regime] = choice.replaced

    def _expired(self, standing: StandingPlan, large: bool) -> bool:
        """Whether a kind's plan has served its time, or was made too long ago (other
        kinds ran since). One with drafts serves its ``stands`` steps (``_stands``). One without serves
        ``idle_replan`` steps, and for a ``large`` batch (``IDLE_REPLAN_BATCH`` requests or
        more) more while less than ``idle_replan_s`` seconds have passed (up to
        ``IDLE_REPLAN_MAX`` steps): there a request that joins changes the step's goodput
        little, while for a lone request a new one (the next prompt at low load, code
        after chat) is the whole step, and its plan is cheap. Where steps are short and
        drafting does not pay (a host-bound GPU batch), planning every few steps would be
        a cost of its own; where steps are long (a CPU forward) a plan stays every
        ``idle_replan``."""
        age = self._choices - standing.made_at
        served = standing.served
        if standing.draft_lengths:
            return served >= standing.stands or age >= 2 * standing.stands
        if served >= IDLE_REPLAN_MAX or age >= 2 * IDLE_REPLAN_MAX:
            return True
        return (served >= self.idle_replan or age >= 2 * self.idle_replan) and \
            (not large or self._clock - standing.made_s >= self.idle_replan_s)

    def _stands(self, previous: StandingPlan | None, joined: int, batch: int) -> int:
        """Steps a plan with drafts serves: ``DRAFT_REPLAN_MAX`` for a lone request whose
        drafter stops by confidence (the plan only bounds what the drafter decides, from the
        map's best case, and its prices follow no batch); else ``draft_replan``, or as many
        as keep the plans' host time at most ``plan_share`` of the steps' (smoothed), up to ``DRAFT_REPLAN_MAX``;
        but at most twice what the kind's ``previous`` plan served, and ``draft_replan`` for a
        batch mostly new since it (``joined``, as ``choose``'s): a new request's estimates
        move most in its first steps, so its plans are made again after 2, 4, 8, ... steps
        (where acceptance differs between requests, standing 16–32 steps at once left each
        request's first ~20 steps with the k planned from the engine-wide estimate)."""
        if self.calibration is not None and batch == 1:
            # Not under load: there plans standing this long drafted more and lost to off
            # (made for other batches; and only planned steps teach the cost model).
            return DRAFT_REPLAN_MAX
        if not self.plan_share or self._step_s <= 0:
            return self.draft_replan
        wanted = math.ceil(self._plan_s / (self.plan_share * self._step_s))
        if previous is None or 2 * (joined - previous.joined) > batch:
            return self.draft_replan
        return max(self.draft_replan, min(DRAFT_REPLAN_MAX, 2 * previous.stands, wanted))

    def _plan(self, caps: dict[str, int], num_other_tokens: int, num_other_spans: int,
              padded: bool, context: int | Callable[[], int],
              forkable: Container[str] = (), check: GoodputCheck | None = None
              ) -> tuple[np.ndarray, set[str], Prices, float]:
        """The goodput-maximising k per request (in ``caps``' order), from the estimates
        (with a calibration map: its best case, ``forkable`` telling greedy requests),
        the forkable requests that should verify their own draft path only, the step's
        prices and the goodput the plan expects. Without prefill chunks, the plan without
        drafts is priced as the kind's ``check`` saw its steps without drafts
        (``GoodputCheck.plain_step``); with them, a step's cost follows its chunks' sizes,
        which the fit prices. Either bar is lowered by what the kind's drafts delivered
        beyond their plans' promises (``GoodputCheck.promise``)."""
        if callable(context):
            context = context()
        steps, self._steps_since_plan = self._steps_since_plan, 0
        req_ids = list(caps)
        num_reqs = len(req_ids)
        cap = np.minimum(np.fromiter(caps.values(), dtype=int, count=num_reqs), self.max_k)
        theta = self.costs.target.theta
        o, g, d, e = self.costs.draft.theta
        step_rows = num_reqs + num_other_tokens
        shape = (num_reqs, num_reqs + num_other_spans, context, 0, num_reqs if padded else 0, num_other_tokens)
        prices = Prices(
            fixed=self.costs.target.predict(self.costs.features(*shape)),
            # (drafts priced on the side of the kernels' switch the step starts on; see below)
            token=self.costs.token_price(step_rows), span=theta[4],
            padded_token=theta[5] if padded else 0.0,
            draft_pass=d, draft_token=e, draft_fixed=o, draft_request=g,
            plain=(check.plain_step(num_reqs) if self.measured_plain and check is not None and not num_other_tokens
                   else None) or 0.0,
            promise=check.promise if self.keep_promises and check is not None else 1.0)
        can_fork = np.fromiter((r in forkable for r in req_ids), dtype=bool, count=num_reqs) \
            if forkable and self._paths[-1] > 1 else None
        estimates = self.estimates
        if estimates is None:  # the map's best case: the drafter stops where its tokens are less sure
            best = [self.calibration.best_case(greedy, self.max_k) for greedy in (True, False)]
            alpha = np.array([best[r not in forkable] for r in req_ids]).reshape(num_reqs, self.max_k)
            rate, path_gain = np.ones(num_reqs), None
        else:
            estimates.drift_priors(steps)
            rows = estimates.rows(req_ids)
            estimates.drift_idle(rows, steps)  # not observed since the last plan: trusted a little less
            alpha, rate, path_gain = estimates.alpha[rows], estimates.rate[rows], estimates.path_gain
        passes = self.costs.drafter_passes(np.arange(self.max_k + 1))
        k, chain_only, goodput = plan_draft_lengths(alpha, rate, cap, prices, passes, self.min_gain, self._paths,
                                                    path_gain, can_fork)
        switch = self.costs.switch_rows
        if 0 < step_rows < switch <= step_rows + int(cap.sum()) and self.costs.seen_above():
            # The step starts below the rows where the pass runs its projections another
            # way, and its drafts may carry it past them: there the whole pass costs what
            # that side's fit says, its fixed cost and every token at its slope (a quantized
            # CPU layer on AMX tiles: 14 requests and 14 drafts can cost less than the 14
            # requests alone on the integer kernel). Priced on the side it starts on, such a
            # batch (a burst's tail, draining) drafted nothing step after step. The plan that
            # promises more is taken, this one only where its drafts do reach the switch.
            crossing = replace(prices, fixed=self.costs.target.predict(self.costs.features(*shape, above=True)),
                               token=self.costs.token_price(switch))
            k_over, chain_over, over = plan_draft_lengths(alpha, rate, cap, crossing, passes, self.min_gain,
                                                          self._paths, path_gain, can_fork)
            if over > goodput and step_rows + int(k_over.sum()) >= switch:
                k, chain_only, prices, goodput = k_over, chain_over, crossing, over
        if estimates is not None:
            estimates.idle[rows] = (k == 0) & (cap > 0)
        if chain_only is None:
            return k, set(), prices, goodput
        return k, {req_ids[i] for i in np.flatnonzero(chain_only)}, prices, goodput

