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
* **Step cost.** ``target = a + b * tokens + q * requests + x * context + c * spans + p *
  padded + f * prefill + m * [prefill]`` — a fixed cost, a cost per token in the verify
  pass, a cost per request and per token of context its attention reads (on a CPU, gathering a long context's keys
  costs more than a few more query tokens: without these terms a batch of long requests
  made every token look dear), a cost per request whose query span is longer than one
  token (its own attention tiles), and a cost per padded token where the pass pads every
  request to the step's longest query — a CUDA graph replay does, and the CPU's
  attention batches decode and verify spans that way — so a draft depth D costs every
  request of the batch D tokens there — and the prefill chunks' tokens and a step with
  any its own fixed cost (on a GPU such a step replays a ragged graph, not a padded one,
  or runs eagerly past the largest token bucket; and at high load most steps admit a new
  request), plus
  ``draft = passes * (d + e * drafting_requests)`` for the drafter's sequential passes: D
  for a draft depth D, or D - 1 for a draft model, whose catch-up on the tokens the target
  accepted runs at every step whatever k is and yields the first proposals — its time is
  the target's (planning D passes for it, charging the catch-up to drafting, made a draft
  model look dear: on 16 held-out chat prompts at batch 1 adaptive speculation with the
  built-in draft ran 1.10x speculation off on the CPU, 1.26x after, where a fixed k = 4
  runs 1.49x; on an H200 it never drafted, 0.86x, and drafts now, 0.92x).
  The target cost is the whole engine step's wall time less the drafter's: the host
  work around the pass (verify lists, rollback, detokenising the extra tokens) is part
  of what drafts cost, and on a GPU most of it. Both are least-squares fits with
  exponential forgetting over measured steps, seeded by a short profile at start-up that
  is never forgotten, at a tenth of a live step's weight (it times passes alone, but it
  varies what a steady state does not, such as how many requests draft). A step slower than twice the prediction
  (another process stalled the machine) counts as twice the prediction, so one stall
  cannot poison the fit, while a cost that really changed is still learned, clip after
  clip.

Draft paths (``num_draft_paths`` > 1) are a choice of the same plan. A request's acceptance
per position is learned from its own path only — what a chain of k would get — and, apart,
engine-wide, how many tokens more the best of m verified paths kept (``path_gain[m]``,
smoothed like the priors, drifting back to ``PATH_GAIN_START`` a path while no request
verifies any). A greedy request may then take, at each k, its further paths for their
expected extra tokens at their cost — 1 + k verified tokens, k drafted ones and a span each
— and ``unforked`` names those whose plan is better without them. The built-in draft's
second path adds ~0.3 tokens a step on held-out chat for 5 more verified tokens; what the
model misses is the host work a path adds on a GPU (a row in every draft pass, a block
copy): on an H200, adaptive runs with two paths took them and ran chat at 0.84x
speculation off against 0.92x with one.

The choice is a ratio maximisation, max (sum of gains) / (fixed cost + sum of costs),
solved exactly with Dinkelbach's method: with the current ratio lambda, each request's
net value of k drafts is ``r_i * (sum_{j<k} (p_ij - lambda*b) - lambda*c*[k>0])`` (``r_i``
its proposal rate; with further paths, the better of that and it plus what they add less
lambda times what they cost); the best plan for every draft depth D at once is each request's best
k <= D (a running maximum over k) less ``lambda * (d + p * num_reqs) * D``; the best
depth's plan gives the next lambda, which converges in a few rounds (a handful of numpy
operations each, cheap next to a step). So k falls to 0 when tokens are expensive (a
compute-bound batch) or a request's drafts keep failing, and rises to k_max when
acceptance is high and extra tokens are nearly free.

Two guards keep a wrong estimate from costing throughput. The iteration starts from the
plan without drafts with its ratio raised by ``min_gain`` (10 %): a plan with drafts is
taken only if it promises that much more goodput — Dinkelbach's step finds such a plan
whenever one exists — so an estimate off by a few percent cannot trade tokens for a
slower step. And what is not observed is not trusted for ever: while a request sits at
k = 0 its estimates drift back towards the engine-wide ones (``DRIFT`` of the way each
step), so one whose drafts failed for a stretch (code editing: a copied span ends, new
text begins) drafts again once its stale estimate, pulled back, would pay — soon where
drafting is nearly free (a lone request), never in a compute-bound batch, where no
acceptance makes a draft worth its tokens. The engine-wide estimates, in turn, drift
slowly back to their optimistic start while no request drafts at all, so a workload that
turns from chat to code is tried again (a request or two drafting for a step or so every
few hundred steps, where nothing pays).

A model can still be wrong where it matters most: on a host-bound GPU step at a few
hundred requests, what drafting adds around the pass is hard to tell from what the batch
costs anyway, and the margin alone let drafts through that made serving ~20 % slower
(on the CPU, at 64 requests, a step with a few drafts costs ~1.7x one without: the
attention pads every short span to the longest). So the plan answers to what it
delivers. For each kind of step (padding, prefill or not, batch size within a factor of
two) a ``GoodputCheck`` compares the realised goodput — emitted tokens per second of
whole step — of the steps that ran drafts with that of the steps that ran none, and
vetoes drafts where they deliver less, by more than twice the comparison's standard
error. The plan's own steps without drafts are free samples; a step runs the other way
(drafts withheld, or let through under a veto) only when one side has gone unseen for a
while — a short while when the verdict is uncertain, up to 64 of its steps' durations
and at least half a second once it is clear — so the checks cost little either way.

The choice itself must stay cheap next to a GPU step at 256 requests: per-request state
lives in rows of a few arrays, a step's acceptance observations are applied in one
vectorised update, and each kind of step (same padding, prefill or not, batch size
within a factor of two) keeps its own plan for more of its steps: if it drafts nothing,
``IDLE_REPLAN`` - 1 more and, at 16 requests or more, as many more as fit
``IDLE_REPLAN_S`` seconds (at most ``IDLE_REPLAN_MAX``), ``DRAFT_REPLAN`` - 1 more if it drafts (each request keeps its
k), within twice as many steps of any kind, only planned steps being timed for the cost
model; a cost model's least-squares fit is solved again
only when a step surprises it or every few steps. On an H200 host the controller's
bookkeeping cost up to ~0.4 ms a step at 64 drafting requests when it planned every step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Container

import numpy as np

ACCEPT_SMOOTHING = 0.3      # per-request EMA weight of a new observation
PRIOR_SMOOTHING = 0.05      # engine-wide EMA weight
INITIAL_ACCEPTANCE = 0.6    # before any observation
PATH_GAIN_START = 0.3       # extra accepted tokens a further draft path adds, before any is observed
DRIFT = 0.05                # per idle step, how far a request's estimates move back to the engine's
PRIOR_DRIFT = 0.002         # per step without observations, how far the engine's move back to the start
IDLE_REPLAN = 16            # while the plan is to draft nothing, a full choice after this many steps
IDLE_REPLAN_S = 0.2         # and, for a batch of IDLE_REPLAN_BATCH or more, this many seconds of
IDLE_REPLAN_BATCH = 16      # steps (all kinds) since it was made,
IDLE_REPLAN_MAX = 128       # or after this many steps of its kind, however short
DRAFT_REPLAN = 2            # while it drafts, every this many (requests keep their k in between)
OUTLIER_RATIO = 2.0         # a measured cost is clipped at this multiple of the prediction
RESOLVE_ERROR = 0.25        # a cost model's fit is solved at once for a sample off by more than this
RESOLVE_EVERY = 8           # and else every this many samples
MIN_GAIN = 0.10             # drafts are planned only if they promise this much more goodput
CHECK_MIN = 4               # realised-goodput check: a side stale after CHECK_MIN to CHECK_MAX of
CHECK_MAX = 64              # its mean step durations without a step, the more by CHECK_SPREAD
CHECK_MAX_S = 0.5           # and once the verdict is clear (CHECK_MAX), this many seconds at least
CHECK_SPREAD = 8            # per standard error between the two sides' goodputs
CHECK_DECAY = 0.95          # per step of a side, how much of its sums is kept
CHECK_STALL = 3.0           # a step counts at most this many times its side's mean duration
VETO_HYSTERESIS = 0.02      # drafts are vetoed below -this log goodput ratio, allowed above +this
VETO_Z = 2.0                # and only if the ratio is this many standard errors below 1
CHECK_PRIOR_CV = 0.5        # a one-request step's goodput deviation assumed, plus
CHECK_JITTER_CV = 0.2       # any step's from the host's timing alone (a GPU host's vary by a fifth),
VERDICT_EVERY = 8           # the verdict is weighed at drafted and checked steps, and every this many plain ones
CHECK_PRIOR_STEPS = 2       # as if seen over this many steps, before a side's own steps show theirs


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
        self._unsolved = 0  # samples since the last solve

    def observe(self, x: list[float], y: float) -> None:
        """Learn one sample. The fit is solved again at once when the sample surprises it
        (off the prediction by more than ``RESOLVE_ERROR``, or clipped as a stall), else
        every ``RESOLVE_EVERY`` samples: a step that costs what was predicted teaches the
        plan nothing it needs now, and a GPU step is too short to solve after each."""
        x = np.asarray(x, dtype=float)
        predicted = self.predict(x)
        surprise = self.num_samples < 2 * len(x) or abs(y - predicted) > RESOLVE_ERROR * predicted
        if self.num_samples >= len(x) and predicted > 0:
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
        """The least-squares fit of every sample so far."""
        self._unsolved = 0
        # A ridge a billionth of the scale: the least-norm fit where the samples cannot tell
        # costs apart, ten times cheaper than an SVD.
        xtx = self.anchor_xtx + self.xtx
        ridge = 1e-9 * np.trace(xtx) / len(xtx) + 1e-12
        theta = np.linalg.solve(xtx + ridge * np.eye(len(xtx)), self.anchor_xty + self.xty)
        # Costs are never negative: clip, so a noisy fit cannot make tokens look free-er than free.
        self.theta = np.clip(theta, 0.0, None)

    def anchor(self, weight: float = 1.0) -> None:
        """Keep every sample observed so far unforgotten, at ``weight`` each."""
        self.anchor_xtx = self.anchor_xtx + weight * self.xtx
        self.anchor_xty = self.anchor_xty + weight * self.xty
        self.xtx = np.zeros_like(self.xtx)
        self.xty = np.zeros_like(self.xty)
        self.solve()

    def predict(self, x: list[float]) -> float:
        return float(np.dot(self.theta, x))


class GoodputCheck:
    """Whether the plan's drafts pay, from realised goodput, for one kind of step.

    Every step of the kind teaches one of two decayed sums of (steps, emitted tokens,
    seconds and their squares and product): steps that ran drafts, and steps that ran
    none — whether the plan chose none or the check withheld them. ``ratio`` is their
    goodputs' ratio (drafted / plain), each a ratio of sums: a drafted step's tokens vary
    a lot at small batches (nothing accepted, or all), and a mean of per-step ratios, or
    of their logarithms, would weigh that variance against drafting. The same sums give
    the ratio's standard error, and drafts are vetoed only when the ratio is below 1 by
    more than ``VETO_Z`` standard errors (and the hysteresis): where it is not clear, the
    plan stands. A veto is lifted once the ratio is above 1 again, or no longer clearly
    below it (half as many standard errors).

    Steps the plan leaves without drafts are free samples of the plain side; a step is
    run the other way (the plan's drafts withheld, or let through under a veto) only when
    one side has gone stale: no step for ``interval`` times its mean step duration — a
    short wait while the verdict is uncertain, a long one once it is clear, so a check's
    share of the time, which is what it costs, stays small where the verdict is known.
    A step slower than ``CHECK_STALL`` times its side's mean counts as that much (another
    process stalled the machine)."""

    def __init__(self, max_k: int, batch: int = 1) -> None:
        self.max_ratio = 1.0 + max_k
        # A step's tokens are the sum of its requests': their deviation shrinks as 1 / sqrt(batch).
        self.prior_cv = math.sqrt(CHECK_PRIOR_CV ** 2 / max(batch, 1) + CHECK_JITTER_CV ** 2)
        self._counts = [0, 0]                      # steps seen per side, undecayed
        self.vetoed = False
        self.num_checks = 0                        # steps run the other way
        # [drafted, plain] x [steps, tokens, seconds, tokens^2, tokens*seconds, seconds^2];
        # plain floats: this runs every step, and numpy scalars cost several times more.
        self._sums = [[0.0] * 6, [0.0] * 6]
        self._since = [0.0, 0.0]                   # seconds of this kind since each side's last step

    @property
    def ratio(self) -> float:
        """Goodput of the steps with drafts over that of the steps without (1: unknown)."""
        (_, drafted_tokens, drafted_s, *_), (_, plain_tokens, plain_s, *_) = self._sums
        if drafted_s == 0 or plain_s == 0 or plain_tokens == 0:
            return 1.0
        ratio = (drafted_tokens / drafted_s) / (plain_tokens / plain_s)
        return min(max(ratio, 1.0 / self.max_ratio), self.max_ratio)

    @property
    def z(self) -> float:
        """log(ratio) in standard errors (each side's goodput a ratio estimator)."""
        variance = 0.0
        for steps, tokens, seconds, tt, ts, ss in self._sums:
            if tokens <= 0 or seconds <= 0:
                return 0.0
            rate = tokens / seconds
            # A step's squared relative deviation from the side's rate, observed, shrunk
            # towards a prior: a few steps that happen to agree do not make a verdict.
            observed = steps * max(tt - 2.0 * rate * ts + rate * rate * ss, 0.0) / (tokens * tokens)
            per_step = (CHECK_PRIOR_STEPS * self.prior_cv ** 2 + steps * observed) / (CHECK_PRIOR_STEPS + steps)
            variance += per_step / steps
        return math.log(self.ratio) / max(math.sqrt(variance), 1e-3)

    @property
    def interval(self) -> int:
        """How stale a side may go, in its mean step durations."""
        return int(min(CHECK_MAX, CHECK_MIN + CHECK_SPREAD * abs(self.z)))

    def stale(self, drafted: bool) -> bool:
        """Whether the drafted (or plain) side needs a step: it has none yet while the
        other has ``CHECK_MIN``, or none for ``interval`` of its mean step durations —
        and, once the verdict is clear, for ``CHECK_MAX_S`` seconds of this kind's steps:
        on a GPU at 64 requests 64 steps last ~0.15 s, and with such checks ~2 % of the
        request-steps still drafted at max load on chat, where drafts were vetoed (H200,
        ``benchmarks/adaptive_check.py``)."""
        side = 0 if drafted else 1
        steps, _, seconds = self._sums[side][:3]
        if steps == 0:
            return self._sums[1 - side][0] >= CHECK_MIN
        interval = self.interval
        wait = interval * seconds / steps
        if interval >= CHECK_MAX:
            wait = max(wait, CHECK_MAX_S)
        return self._since[side] >= wait

    def observe(self, drafted: bool, checked: bool, tokens: int, seconds: float) -> None:
        """A step of this kind ran: ``drafted`` whether it ran drafts, ``checked``
        whether the check chose so (against the plan, or against the veto)."""
        if seconds <= 0:
            return
        side = 0 if drafted else 1
        sums, other = self._sums[side], self._sums[1 - side]
        if sums[0] >= CHECK_MIN:
            seconds = min(seconds, CHECK_STALL * sums[2] / sums[0])  # a stall, not the step
        elif other[0] >= CHECK_MIN:  # a side's first steps: the other side's steps tell a stall
            seconds = min(seconds, CHECK_STALL * self.max_ratio * other[2] / other[0])
        self._counts[side] += 1
        new = (1.0, tokens, seconds, tokens * tokens, tokens * seconds, seconds * seconds)
        self._sums[side] = [CHECK_DECAY * old + value for old, value in zip(sums, new)]
        self._since[1 - side] += seconds
        self._since[side] = 0.0
        self.num_checks += checked
        # The verdict moves with the drafted side and the checks; the plan's own plain steps
        # (every step of a kind without drafts) move it slowly: it is weighed at every
        # VERDICT_EVERY-th of them (its standard error cost ~1.5 µs at each under a veto).
        if not drafted and not checked and self._counts[1] % VERDICT_EVERY:
            return
        log_ratio = math.log(self.ratio)
        if self.vetoed:  # lifted once the ratio is not clearly below 1
            self.vetoed = log_ratio < VETO_HYSTERESIS and self.z < -VETO_Z / 2
        else:  # and never on a side's first few steps, however clear they look
            self.vetoed = log_ratio < -VETO_HYSTERESIS and self.z < -VETO_Z and min(self._counts) >= CHECK_MIN


class DraftLengthController:
    """Chooses k_i per request per step; learns from what each step cost and accepted.

    Per-request state lives in rows of a few arrays (acceptance per position, proposal
    rate, steps idle at k = 0), and a step's acceptance observations are applied
    together, in one vectorised update, when they are next needed: at 64 requests a
    step's bookkeeping is a handful of numpy operations, not a few hundred."""

    def __init__(self, max_k: int, min_gain: float = MIN_GAIN, check_goodput: bool = True,
                 forks: list[tuple[int, int]] = (), first_draft_in_catch_up: bool = False) -> None:
        """``forks``: the further draft paths' (depth, rank) (``Scheduler.draft_forks``):
        a request drafting k tokens may verify one path more for each fork above depth k.
        ``first_draft_in_catch_up``: the drafter catches its cache up every step, whatever
        k is, and that pass yields the first proposals (a draft model); its time is then
        the target's (the engine measures drafting without it), and a draft depth D costs
        D - 1 passes of the drafter, not D."""
        self.max_k = max_k
        self._first_free = int(first_draft_in_catch_up)
        # Draft paths per request at k = 0..max_k (1 at k = 0: none but its own).
        self._paths = np.array([1 + sum(depth < k for depth, _ in forks) for k in range(max_k + 1)])
        # Engine-wide: extra accepted tokens per request-step that verified m paths
        # (index m), over its own path's; and whether any was observed since the last plan.
        self._path_gain_start = PATH_GAIN_START * np.maximum(np.arange(len(forks) + 2) - 1, 0)
        self.path_gain = self._path_gain_start.copy()
        self._path_observed = False
        self.unforked: set[str] = set()  # the last choice's requests to verify their own path only
        self.min_gain = min_gain
        self.check_goodput = check_goodput  # False: the plan stands unchecked (benchmarks, tests)
        # [1, tokens, requests, context kilotokens, spans, padded, prefill tokens, prefill?] -> s
        self.target_cost = CostModel(8)
        self.draft_cost = CostModel(2)    # [depth, depth * drafting requests] -> seconds
        self.prior = np.full(max_k, INITIAL_ACCEPTANCE)
        self.prior_rate = 1.0                       # engine-wide share of planned drafts proposed
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._alpha = np.zeros((0, max_k))          # per row: P(position j accepted | all before were)
        self._rate = np.zeros(0)                    # per row: share of planned drafts proposed
        self._idle = np.zeros(0, dtype=bool)        # per row: chosen k = 0 (could draft) last step
        # (row, planned, proposed, accepted, paths, extra accepted)
        self._pending: list[tuple[int, int, int, int, int, int]] = []
        self._pending_rows: set[int] = set()
        self._releasing: list[int] = []  # rows of freed requests, reusable once their observation is applied
        self._observed = False  # any acceptance observed since the last choice
        self._steps_since_plan = 0   # choices since the last full plan (the rest repeated it)
        self._choices = 0            # choices made, all together
        self._planned = False        # whether the last choice was a full plan
        # Per kind of step, the plan that stands: [choices it served, its k > 0 per request
        # (empty: it drafted nothing), self._choices and self._clock when it was made].
        self._plans: dict[tuple, list] = {}
        self._clock = 0.0  # seconds of steps observed (observe_goodput), all kinds together
        self.idle_replan = IDLE_REPLAN    # a plan without drafts stands for this many steps
        self.idle_replan_s = IDLE_REPLAN_S  # (and seconds; at most IDLE_REPLAN_MAX steps)
        self.draft_replan = DRAFT_REPLAN  # and one with drafts for this many
        self.checks: dict[tuple, GoodputCheck] = {}  # per kind of step
        self._last: tuple[GoodputCheck, bool, bool] | None = None  # the last choice: check, drafted, checked

    # ------------------------------------------------------------------ learning
    @property
    def wants_step_cost(self) -> bool:
        """Whether the step just planned should be timed: every step the controller
        planned afresh (while k = 0 stands unplanned, a step teaches little the last did not)."""
        return self._planned

    def observe_step(self, num_tokens: int, num_spans: int, target_s: float | None,
                     depth: int, num_drafting: int, draft_s: float, num_padded: int = 0,
                     num_reqs: int = 1, context: int = 0, num_prefill: int = 0) -> None:
        """One step's measured cost: the verify pass and, if any drafting ran, the drafter.
        ``target_s`` None: the pass says nothing about what drafts cost. ``num_tokens``:
        decode and verify tokens; ``num_prefill``: prefill chunks' tokens (a step with
        any has its own fixed cost too: on a GPU it replays a ragged graph (or runs
        eagerly) where decode and verify steps replay padded ones, and at high load most
        steps admit a new request).
        ``num_padded``: the tokens the pass really ran where it padded every request to the
        longest query (a CUDA graph replay, the CPU attention's short spans; else 0).
        ``num_reqs`` / ``context``: the requests in the pass and their tokens in the KV
        cache after it, all together."""
        if target_s is not None:
            self.target_cost.observe(
                _features(num_tokens, num_reqs, context, num_spans, num_padded, num_prefill), target_s)
        passes = depth - self._first_free
        if passes > 0:
            self.draft_cost.observe([passes, passes * num_drafting], draft_s)

    def observe_goodput(self, num_tokens: int, seconds: float) -> None:
        """The step just chosen emitted ``num_tokens`` in ``seconds`` of wall time (the
        whole step, drafting included): its kind's realised-goodput check learns from it."""
        self._clock += seconds
        if self._last is not None and self.check_goodput:
            check, drafted, checked = self._last
            self._last = None
            check.observe(drafted, checked, num_tokens, seconds)

    def observe_acceptance(self, req_id: str, num_planned: int, num_proposed: int,
                           num_accepted: int, num_paths: int = 1, num_extra: int = 0) -> None:
        """A request was planned ``num_planned`` drafts, the drafter proposed
        ``num_proposed`` of them and the target accepted the first ``num_accepted`` of its
        own path; with ``num_paths`` > 1 draft paths verified, the best of them kept
        ``num_extra`` tokens more. Queued; applied with the rest of the step's observations."""
        if num_planned == 0:
            return
        row = self._row(req_id)
        if row in self._pending_rows:  # a second observation before the first was applied
            self._apply_pending()
        self._pending.append((row, num_planned, min(num_proposed, num_planned), num_accepted,
                              num_paths, num_extra))
        self._pending_rows.add(row)

    def _apply_pending(self) -> None:
        """Exponential smoothing of the queued observations, one array operation each:
        per request its proposal rate and, where anything was proposed, its acceptance at
        the positions verified (the accepted ones, then the first rejection); the
        engine-wide priors move by the batch's mean, weighted as that many observations."""
        if not self._pending:
            return
        rows, planned, proposed, accepted, paths, extra = np.array(self._pending, dtype=int).T
        self._observed = True
        for m in np.unique(paths[paths > 1]):  # what further paths added, per number of paths
            self._path_observed = True
            seen = paths == m
            self.path_gain[m] += _batch_weight(int(seen.sum())) * (extra[seen].mean() - self.path_gain[m])
        self._pending.clear()
        self._pending_rows.clear()
        if self._releasing:  # freed requests' rows: their last observation is read above
            self._free_rows += self._releasing
            self._releasing.clear()
        share = proposed / planned
        self._rate[rows] += ACCEPT_SMOOTHING * (share - self._rate[rows])
        self.prior_rate += _batch_weight(len(rows)) * (share.mean() - self.prior_rate)
        some = proposed > 0
        if not some.any():
            return
        rows, proposed, accepted = rows[some], proposed[some], accepted[some]
        positions = np.arange(self.max_k)[None, :]
        seen = positions < np.minimum(accepted + 1, proposed)[:, None]
        outcome = (positions < accepted[:, None]).astype(float)
        alpha = self._alpha[rows]
        self._alpha[rows] = alpha + ACCEPT_SMOOTHING * seen * (outcome - alpha)
        counts = seen.sum(axis=0)
        observed = counts > 0
        mean = (outcome * seen).sum(axis=0)[observed] / counts[observed]
        self.prior[observed] += _batch_weight(counts[observed]) * (mean - self.prior[observed])

    def _row(self, req_id: str) -> int:
        """The request's row, made on first sight from the engine-wide estimates."""
        row = self._rows.get(req_id)
        if row is not None:
            return row
        if not self._free_rows:
            old = len(self._rate)
            grow = max(16, old)
            self._alpha = np.concatenate((self._alpha, np.zeros((grow, self.max_k))))
            self._rate = np.concatenate((self._rate, np.zeros(grow)))
            self._idle = np.concatenate((self._idle, np.zeros(grow, dtype=bool)))
            self._free_rows = list(range(old + grow - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._apply_pending()  # the priors this row starts from include the step so far
        self._alpha[row] = self.prior
        self._rate[row] = self.prior_rate
        self._idle[row] = False
        self._rows[req_id] = row
        return row

    def acceptance(self, req_id: str) -> np.ndarray:
        """The request's acceptance per position (the engine-wide one if it is new)."""
        self._apply_pending()
        row = self._rows.get(req_id)
        return self.prior.copy() if row is None else self._alpha[row].copy()

    def set_estimates(self, req_id: str, alpha, rate: float) -> None:
        """Set a request's acceptance per position and proposal rate (tests, warm starts)."""
        self._apply_pending()
        row = self._row(req_id)
        self._alpha[row], self._rate[row] = alpha, rate

    def free(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is None:
            return
        if row in self._pending_rows:  # its queued observation still teaches the priors:
            self._releasing.append(row)  # the row is reused once that is applied
        else:
            self._free_rows.append(row)

    # ------------------------------------------------------------------ the choice
    def choose(self, caps: dict[str, int], num_other_tokens: int = 0,
               num_other_spans: int = 0, padded: bool = False,
               context: int | Callable[[], int] = 0, forkable: Container[str] = ()) -> dict[str, int]:
        """k_i for each decoding request (``caps``: req_id -> most drafts it may take), and
        in ``unforked`` those of ``forkable`` (requests that may verify further draft
        paths: greedy ones) whose drafts pay more without them.
        ``num_other_tokens`` / ``num_other_spans``: the prefill chunks the step runs anyway.
        ``context``: the tokens in the KV cache of every request in the step, all together,
        or a function that counts them, called only if a plan is made (most steps repeat
        a standing plan, and counting walks every request).
        ``padded``: the step will pad every request to the longest query (a CUDA graph
        replay; the CPU attention), so a draft depth D costs every request D tokens."""
        self._last = None
        self._planned = False
        self.unforked = set()
        if not caps or self.target_cost.num_samples == 0:
            return dict(caps)
        self._steps_since_plan += 1
        self._choices += 1
        regime = (padded, num_other_tokens > 0, len(caps).bit_length())
        check = self.checks.get(regime)
        if check is None:
            check = self.checks[regime] = GoodputCheck(self.max_k, batch=1 << (regime[2] - 1))
        standing = self._plans.get(regime)
        if standing is not None and self._expired(standing, regime[2] >= IDLE_REPLAN_BATCH.bit_length()):
            standing = None
        if (standing is not None and not standing[1]) or (check.vetoed and not check.stale(drafted=True)):
            # The kind's plan drafts nothing (same padding, prefill or not, batch within a
            # factor of two): it stands for a few steps (the drifts below catch up at the
            # next plan), so where drafting does not pay — large, host-bound batches — the
            # choice costs least. Each kind keeps its own: under load, steps that admit a
            # request and steps that do not take turns, and one plan for both was made
            # again at every turn (a plan and a cost sample: ~0.1 ms on the CPU machine).
            # Nor is a plan made where drafts are vetoed, but at the vetoed kind's next check.
            if standing is not None:
                standing[0] += 1
            self._last = (check, False, False)
            return dict.fromkeys(caps, 0)
        if standing is not None:
            # A plan with drafts stands for a step more: each request keeps its k (a new
            # one drafts nothing until the next plan). A GPU step at 64 requests lasts a
            # few milliseconds; planning every step cost a tenth of it on the host.
            standing[0] += 1
            get = standing[1].get
            k = np.fromiter((min(get(r, 0), cap) for r, cap in caps.items()), dtype=int, count=len(caps))
            self.unforked = standing[4]
        else:
            k, self.unforked = self._plan(caps, num_other_tokens, num_other_spans, padded, context, forkable)
            self._planned = True
            self._plans[regime] = [1, {r: kr for r, kr in zip(caps, k.tolist()) if kr},
                                   self._choices, self._clock, self.unforked]
        drafted = bool(k.any())
        checked = drafted and (check.vetoed or check.stale(drafted=False))
        if checked and not check.vetoed:
            k[:] = 0  # the check: this step runs without the plan's drafts
            drafted = False
        self._last = (check, drafted, checked)
        return dict(zip(caps, k.tolist()))

    def _expired(self, standing: list, large: bool) -> bool:
        """Whether a kind's plan has served its time, or was made too long ago (other
        kinds ran since). One with drafts serves ``draft_replan`` steps. One without serves
        ``idle_replan`` steps, and for a ``large`` batch (``IDLE_REPLAN_BATCH`` requests or
        more) more while less than ``idle_replan_s`` seconds have passed (up to
        ``IDLE_REPLAN_MAX`` steps): there a request that joins changes the step's goodput
        little, while for a lone request a new one (the next prompt at low load, code
        after chat) is the whole step, and its plan is cheap. Where steps are short and
        drafting does not pay (a host-bound GPU batch) planning every 16 steps was a cost of its own: at
        64 requests in a host-only run on the CPU machine (forward stubbed, ~1.3 ms steps)
        a plan took ~0.26 ms inside the step (0.06 ms warm, in a loop), 16 µs a step;
        where steps are long (a CPU forward) a plan stays every 16."""
        served, last_k, made, made_s, _ = standing
        age = self._choices - made
        if last_k:
            return served >= self.draft_replan or age >= 2 * self.draft_replan
        if served >= IDLE_REPLAN_MAX or age >= 2 * IDLE_REPLAN_MAX:
            return True
        return (served >= self.idle_replan or age >= 2 * self.idle_replan) and \
            (not large or self._clock - made_s >= self.idle_replan_s)

    def _plan(self, caps: dict[str, int], num_other_tokens: int, num_other_spans: int,
              padded: bool, context: int | Callable[[], int],
              forkable: Container[str] = ()) -> tuple[np.ndarray, set[str]]:
        """The goodput-maximising k per request (in ``caps``' order), from the estimates,
        and the forkable requests that should verify their own draft path only."""
        if callable(context):
            context = context()
        steps, self._steps_since_plan = self._steps_since_plan, 0
        self._apply_pending()
        if not self._observed:  # nobody drafted: the engine-wide estimates are not trusted for ever
            drift = 1.0 - (1.0 - PRIOR_DRIFT) ** steps
            self.prior += drift * (INITIAL_ACCEPTANCE - self.prior)
            self.prior_rate += drift * (1.0 - self.prior_rate)
        self._observed = False
        if not self._path_observed:  # nobody verified further paths: try them again in time
            drift = 1.0 - (1.0 - PRIOR_DRIFT) ** steps
            self.path_gain += drift * (self._path_gain_start - self.path_gain)
        self._path_observed = False
        req_ids = list(caps)
        get = self._rows.get
        rows = [get(r) for r in req_ids]
        if None in rows:  # new requests: rows from the engine-wide estimates
            rows = [self._row(r) if row is None else row for r, row in zip(req_ids, rows)]
        rows = np.array(rows)
        num_reqs, max_k = len(req_ids), self.max_k
        cap = np.minimum(np.fromiter(caps.values(), dtype=int, count=num_reqs), max_k)
        idle = rows[self._idle[rows]]  # not observed since the last choice: trust it a little less
        drift = 1.0 - (1.0 - DRIFT) ** steps
        self._alpha[idle] += drift * (self.prior - self._alpha[idle])
        self._rate[idle] += drift * (self.prior_rate - self._rate[idle])
        rate = self._rate[rows][:, None]
        _a, b, _q, _x, c, pad, _f, _m = self.target_cost.theta
        pad = pad if padded else 0.0
        d, e = self.draft_cost.theta
        fixed = self.target_cost.predict(_features(num_reqs, num_reqs + num_other_spans, context, 0,
                                                   num_reqs if padded else 0, num_other_tokens))
        depths = np.arange(max_k + 1)
        passes = np.maximum(depths - self._first_free, 0)  # the drafter's passes a depth costs
        depth_cost = d * passes + pad * num_reqs * depths
        # Per request and k = 0..max_k: expected accepted drafts (each position's chance,
        # times the share of planned drafts the drafter proposes) and the cost of its
        # verified tokens and span (a planned draft not proposed is not paid for): each
        # drafted token is verified and (roughly) drafted once.
        gain = np.zeros((num_reqs, max_k + 1))
        gain[:, 1:] = np.cumsum(rate * np.cumprod(self._alpha[rows], axis=1), axis=1)
        ks = depths[1:]
        cost_k = np.zeros((num_reqs, max_k + 1))
        cost_k[:, 1:] = rate * (b * ks + e * passes[1:] + c)
        cost_k[np.arange(max_k + 1)[None, :] > cap[:, None]] = np.inf  # over the request's cap
        # A forkable request's further paths at k: what they were seen to add, for 1 + k
        # more verified tokens, k more drafted and a span each.
        can_fork = np.fromiter((r in forkable for r in req_ids), dtype=bool, count=num_reqs) \
            if forkable and self._paths[-1] > 1 else None
        if can_fork is not None and can_fork.any():
            more = self._paths[1:] - 1
            path_gain = np.zeros((num_reqs, max_k + 1))
            path_cost = np.zeros((num_reqs, max_k + 1))
            path_gain[can_fork, 1:] = (rate * self.path_gain[self._paths[1:]])[can_fork]
            path_cost[can_fork, 1:] = (rate * (b * more * (1 + ks) + e * more * passes[1:]
                                               + c * more))[can_fork]
        else:  # nobody may fork: the plan is over k alone
            can_fork = None
        every = np.arange(num_reqs)
        k = np.zeros(num_reqs, dtype=int)
        fork = new_fork = None
        total_gain, total_cost = gain, cost_k
        # Start from the plan without drafts, raised by the margin a plan must beat.
        ratio = (1.0 + self.min_gain) * num_reqs / max(fixed, 1e-9)
        for _ in range(10):
            if can_fork is not None:
                new_fork = path_gain - ratio * path_cost > 0           # paths pay at this ratio
                total_gain = gain + new_fork * path_gain
                total_cost = cost_k + new_fork * path_cost
            net = total_gain - ratio * total_cost                      # value of k = 0..max_k drafts
            best_upto = np.maximum.accumulate(net, axis=1)             # best k <= D, per request
            depth = int(np.argmax(best_upto.sum(axis=0) - ratio * depth_cost))
            new_k = np.argmax(net[:, :depth + 1], axis=1)              # ties: the smaller k
            cost = fixed + depth_cost[new_k.max()] + total_cost[every, new_k].sum()
            new_ratio = (num_reqs + total_gain[every, new_k].sum()) / max(cost, 1e-9)
            if np.array_equal(new_k, k) or new_ratio <= ratio:
                break
            k, ratio, fork = new_k, new_ratio, new_fork
        self._idle[rows] = (k == 0) & (cap > 0)
        if can_fork is None:
            return k, set()
        chose_chain = can_fork & (k > 0) if fork is None else can_fork & (k > 0) & ~fork[every, k]
        return k, {req_ids[i] for i in np.flatnonzero(chose_chain)}


def _features(tokens: int, reqs: int, context: int, spans: int, padded: int, prefill: int = 0) -> list[float]:
    """The target cost model's inputs: decode/verify tokens, requests, context (in
    thousands of tokens, to keep the fit's columns alike in scale), verify spans, padded
    tokens, prefill tokens and whether the step has any."""
    return [1.0, tokens, reqs, context / 1000.0, spans, padded, prefill, 1.0 if prefill else 0.0]


def _batch_weight(count):
    """The weight of ``count`` observations in the engine-wide exponential average."""
    return 1.0 - (1.0 - PRIOR_SMOOTHING) ** count
