"""How often drafts are accepted, learned online per request (``AcceptanceEstimates``).

Per request, ``alpha[j]`` is the probability that draft position j is accepted given that
all before it were (exponentially smoothed; a new request starts from the engine-wide
estimate). A request drafting k tokens then emits ``E(k) = 1 + sum_{j<k} prod_{m<=j}
alpha[m]`` tokens in expectation. Only proposed positions teach ``alpha``; how often the
drafter proposes at all (n-gram lookup often finds nothing) is a second smoothed rate per
request, which scales both what its drafts gain and what their tokens cost.

With draft paths, a request's acceptance is learned from its own path only (what a chain
of k would get) and, apart and engine-wide, how many tokens more the best of m verified
paths kept (``path_gain[m]``).

A position a request's drafts did not reach in a step (it drafted fewer, or an earlier
one was rejected) learns nothing of its own, so it moves towards the request's acceptance
over the positions they did reach (``pooled``, and engine-wide ``prior_pooled``):
acceptance given the drafts before were accepted varies little with the position
(fixed-k runs: ``benchmarks/results/per_token_drafting/``). Else a
request that drafts one token learns its first position only, and its deeper ones keep
the estimates it started with (the last workload's, chat's after chat) for good: the plan
never drafts deeper, where code would pay.

How fast a request's estimates move is its own (``weight``): a new request's, and one
whose outcomes just changed, move ``ACCEPT_SMOOTHING`` of the way to each step's
outcomes; each step that agrees with them slows them, as a running mean would, down to
``ACCEPT_SMOOTHING_SETTLED``. A fixed weight serves one kind of text only: fast, an
acceptance of 0.6 swings by about 0.2 from step to step, and the plan, whose k a low
estimate pulls down further than a high one pushes up against the cap, drafts less
than pays; slow, it follows copied spans and fresh text taking turns (n-gram lookup)
too late. A change is told apart from chance by a two-sided CUSUM test of the outcomes
against the request's pooled acceptance (``CHANGE_SLACK`` of slack an outcome,
``CHANGE_THRESHOLD`` to raise it), which makes the estimates fast again.

What is not observed is not trusted for ever: while a request sits at k = 0 its
estimates drift back towards the engine-wide ones (``DRIFT`` of the way each step), so
one whose drafts failed for a stretch (a copied span ends, new text begins) drafts again
once its stale estimate, pulled back, would pay. The engine-wide estimates in turn drift
slowly back to their optimistic start while no request drafts at all (and the path gains
while none verifies paths), so a workload that changes is tried again.

Per-request state lives in rows of a few arrays. Observations are queued and applied step
by step, each step's in one vectorised update (at batch 1 one short loop in Python floats):
the engine applies them while the next step's verify pass runs
(``DraftLengthController.settle``), and whatever is still queued is applied when the
estimates are next read (a plan).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

ACCEPT_SMOOTHING = 0.3      # per-request EMA weight of a step's outcomes, at first and after a change
ACCEPT_SMOOTHING_SETTLED = 0.1  # the least, once the outcomes agreed with the estimates for a while
CHANGE_SLACK = 0.25         # CUSUM: slack an outcome (accepted 1, rejected 0) may differ from the pooled estimate by
CHANGE_THRESHOLD = 2.0      # CUSUM: summed surprise that tells a change of acceptance (estimates fast again)
PRIOR_SMOOTHING = 0.05      # engine-wide EMA weight
INITIAL_ACCEPTANCE = 0.6    # before any observation
PATH_GAIN_START = 0.3       # extra accepted tokens a further draft path adds, before any is observed
DRIFT = 0.05                # per idle step, how far a request's estimates move back to the engine's
PRIOR_DRIFT = 0.002         # per step without observations, how far the engine's move back to the start
MAX_PENDING = 4096          # outcomes queued at most before they are applied unasked


class DraftOutcome(NamedTuple):
    """What one request's drafts came to in a step."""

    num_planned: int    # draft slots planned (its k)
    num_proposed: int   # of which the drafter proposed
    num_accepted: int   # of which the target accepted, on the request's own path
    num_paths: int = 1  # draft paths verified (1: its own only)
    num_extra: int = 0  # tokens the best of them kept beyond its own path's


class AcceptanceEstimates:
    """Acceptance per position and proposal rate per request, the engine-wide priors both
    start from and drift back to, and what further draft paths add."""

    def __init__(self, max_k: int, max_paths: int = 1) -> None:
        self.max_k = max_k
        self.prior = np.full(max_k, INITIAL_ACCEPTANCE)
        self.prior_pooled = INITIAL_ACCEPTANCE    # engine-wide acceptance at any position
        self.prior_rate = 1.0                     # engine-wide share of planned drafts proposed
        # Engine-wide: extra accepted tokens per request-step that verified m paths (index m).
        self.path_gain_start = PATH_GAIN_START * np.maximum(np.arange(max_paths + 1) - 1, 0)
        self.path_gain = self.path_gain_start.copy()
        self.alpha = np.zeros((0, max_k))         # per row: P(position j accepted | all before were)
        self.pooled = np.zeros(0)                 # per row: the same at any position it reached
        self.rate = np.zeros(0)                   # per row: share of planned drafts proposed
        self.idle = np.zeros(0, dtype=bool)       # per row: chosen k = 0 (could draft) last plan
        self.weight = np.zeros(0)                 # per row: how far its next outcomes move its estimates
        self.rise = np.zeros(0)                   # per row: CUSUM of outcomes above its pooled estimate
        self.fall = np.zeros(0)                   # per row: and below it
        self._rows: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._pending: list[tuple[int, ...]] = []  # (row, *DraftOutcome)
        self._pending_rows: set[int] = set()
        self._steps: list[int] = []  # where in the queue each step after the first begins
        self._releasing: list[int] = []  # rows of freed requests, reusable once their observation is applied
        self._observed = False       # any acceptance observed since the last drift
        self._path_observed = False  # any further path verified since then

    # ------------------------------------------------------------------ learning
    def observe(self, req_id: str, outcome: DraftOutcome) -> None:
        """Queue one request's outcome; applied with the rest of the step's."""
        if outcome.num_planned == 0:
            return
        row = self._row(req_id)
        planned, proposed, accepted, paths, extra = outcome
        self._pending.append((row, planned, min(proposed, planned), accepted, paths, extra))
        self._pending_rows.add(row)
        if len(self._pending) >= MAX_PENDING:  # nothing asked for a while (drafts vetoed)
            self.apply_pending()

    def apply_pending(self) -> None:
        """Exponential smoothing of the queued observations, step by step: per request its
        proposal rate and, where anything was proposed, its acceptance at the positions
        verified (the accepted ones, then the first rejection), pooled over them, and at
        the positions not reached, towards that pooled acceptance; the engine-wide priors
        move by the batch's mean, weighted as that many observations. A step's outcomes
        (one per request) are applied in one array operation each; where the queue holds
        several steps' (nothing applied them in between: a caller that only plans), they
        are applied in their order, and steps of distinct requests with no step boundary
        between them (``new_step``) as one."""
        pending, steps = self._pending, self._steps
        if not pending:
            return
        self._observed = True
        if len(self._pending_rows) == 1:  # batch 1: one request's, step after step
            self._apply_one(pending[0][0], pending)
        elif not steps and len(self._pending_rows) == len(pending):  # one step's outcomes
            self._apply_many(pending)
        else:  # step by step (and a row's later outcome after its earlier one, whatever the steps)
            bounds, start, rows = set(steps), 0, set()
            for i, item in enumerate(pending):
                if i in bounds or item[0] in rows:
                    self._apply_some(pending[start:i])
                    start, rows = i, set()
                rows.add(item[0])
            self._apply_some(pending[start:])
        pending.clear()
        steps.clear()
        self._pending_rows.clear()
        if self._releasing:  # freed requests' rows: their last observation is read above
            self._free_rows += self._releasing
            self._releasing.clear()

    def new_step(self) -> None:
        """Outcomes observed from now on are a new step's (applied after the earlier ones,
        as a group of their own)."""
        if self._pending and (not self._steps or self._steps[-1] != len(self._pending)):
            self._steps.append(len(self._pending))

    def _apply_some(self, outcomes: list[tuple[int, ...]]) -> None:
        """Outcomes of distinct rows, applied together."""
        if len(outcomes) == 1:
            self._apply_one(outcomes[0][0], outcomes)
        else:
            self._apply_many(outcomes)

    def _apply_many(self, outcomes: list[tuple[int, ...]]) -> None:
        """``apply_pending`` for outcomes of distinct rows, over the arrays."""
        rows, planned, proposed, accepted, paths, extra = np.array(outcomes, dtype=int).T
        if (paths > 1).any():  # what further paths added, per number of paths
            self._path_observed = True
            for m in np.unique(paths[paths > 1]):
                seen = paths == m
                self.path_gain[m] += _batch_weight(int(seen.sum())) * (extra[seen].mean() - self.path_gain[m])
        share = proposed / planned
        self.rate[rows] += ACCEPT_SMOOTHING * (share - self.rate[rows])
        self.prior_rate += _batch_weight(len(rows)) * (share.mean() - self.prior_rate)
        some = proposed > 0
        if not some.any():
            return
        rows, proposed, accepted = rows[some], proposed[some], accepted[some]
        positions = np.arange(self.max_k)[None, :]
        seen = positions < np.minimum(accepted + 1, proposed)[:, None]
        outcome = (positions < accepted[:, None]).astype(float)
        judged = seen.sum(axis=1)
        weight = self._weights(rows, np.minimum(accepted, judged), judged > accepted)
        # Pooled over positions: each judged one is an observation.
        pooled = self.pooled[rows] + (1.0 - (1.0 - weight) ** judged) * (
            (outcome * seen).sum(axis=1) / judged - self.pooled[rows])
        self.pooled[rows] = pooled
        # Seen positions learn their outcome, the others the request's pooled acceptance.
        alpha = self.alpha[rows]
        self.alpha[rows] = alpha + weight[:, None] * (np.where(seen, outcome, pooled[:, None]) - alpha)
        counts = seen.sum(axis=0)
        observed = counts > 0
        mean = (outcome * seen).sum(axis=0)[observed] / counts[observed]
        self.prior[observed] += _batch_weight(counts[observed]) * (mean - self.prior[observed])
        self.prior_pooled += _batch_weight(judged.sum()) * (
            (outcome * seen).sum() / judged.sum() - self.prior_pooled)
        unseen = ~observed
        self.prior[unseen] += _batch_weight(len(rows)) * (self.prior_pooled - self.prior[unseen])

    def _apply_one(self, row: int, outcomes: list[tuple[int, ...]]) -> None:
        """``apply_pending`` for one request's outcomes, in their order, in Python floats:
        the same updates, where at batch 1 (every step's) some fifty numpy calls on one
        row cost more than the arithmetic. Its state is read once and written once."""
        one = _batch_weight(1)
        rate, prior_rate, prior_pooled = float(self.rate[row]), self.prior_rate, self.prior_pooled
        pooled, alpha, prior = float(self.pooled[row]), self.alpha[row].tolist(), self.prior.tolist()
        weight, rise, fall = float(self.weight[row]), float(self.rise[row]), float(self.fall[row])
        for _, planned, proposed, accepted, paths, extra in outcomes:
            if paths > 1:
                self._path_observed = True
                self.path_gain[paths] += one * (extra - self.path_gain[paths])
            share = proposed / planned
            rate += ACCEPT_SMOOTHING * (share - rate)
            prior_rate += one * (share - prior_rate)
            if proposed == 0:
                continue
            seen = min(accepted + 1, proposed)
            ones = min(accepted, seen)
            weight, rise, fall = _weight(weight, rise, fall, pooled, ones, seen > ones)
            mean = ones / seen
            pooled += (1.0 - (1.0 - weight) ** seen) * (mean - pooled)
            prior_pooled += _batch_weight(seen) * (mean - prior_pooled)
            for j in range(self.max_k):
                if j < seen:
                    outcome = 1.0 if j < accepted else 0.0
                    alpha[j] += weight * (outcome - alpha[j])
                    prior[j] += one * (outcome - prior[j])
                else:
                    alpha[j] += weight * (pooled - alpha[j])
                    prior[j] += one * (prior_pooled - prior[j])
            weight = max(ACCEPT_SMOOTHING_SETTLED, weight / (1.0 + weight))
        self.rate[row], self.prior_rate, self.prior_pooled = rate, prior_rate, prior_pooled
        self.pooled[row], self.alpha[row], self.prior[:] = pooled, alpha, prior
        self.weight[row], self.rise[row], self.fall[row] = weight, rise, fall

    def _weights(self, rows: np.ndarray, ones: np.ndarray, rejected: np.ndarray) -> np.ndarray:
        """``_weight`` over rows (one step's outcomes of distinct rows): the weights this
        step's outcomes move their estimates by; the rows' next ones are set."""
        pooled = self.pooled[rows]
        rise = np.maximum(self.rise[rows] + ones * (1.0 - pooled - CHANGE_SLACK), 0.0)
        peak = rise
        rise = np.where(rejected, np.maximum(rise - pooled - CHANGE_SLACK, 0.0), rise)
        fall = np.maximum(self.fall[rows] + ones * (pooled - 1.0 - CHANGE_SLACK), 0.0)
        fall = np.where(rejected, np.maximum(fall + pooled - CHANGE_SLACK, 0.0), fall)
        change = (peak > CHANGE_THRESHOLD) | (fall > CHANGE_THRESHOLD)
        weight = np.where(change, ACCEPT_SMOOTHING, self.weight[rows])
        self.rise[rows] = np.where(change, 0.0, rise)
        self.fall[rows] = np.where(change, 0.0, fall)
        self.weight[rows] = np.maximum(ACCEPT_SMOOTHING_SETTLED, weight / (1.0 + weight))
        return weight

    def drift_priors(self, steps: int) -> None:
        """``steps`` steps have passed since the last drift: the queued observations are
        applied, and the engine-wide estimates nobody observed since move back to where
        they started (``PRIOR_DRIFT`` a step)."""
        self.apply_pending()
        if not self._observed:
            drift = 1.0 - (1.0 - PRIOR_DRIFT) ** steps
            self.prior += drift * (INITIAL_ACCEPTANCE - self.prior)
            self.prior_pooled += drift * (INITIAL_ACCEPTANCE - self.prior_pooled)
            self.prior_rate += drift * (1.0 - self.prior_rate)
        self._observed = False
        if not self._path_observed:
            drift = 1.0 - (1.0 - PRIOR_DRIFT) ** steps
            self.path_gain += drift * (self.path_gain_start - self.path_gain)
        self._path_observed = False

    def drift_idle(self, rows: np.ndarray, steps: int) -> None:
        """Of ``rows``, those idle at the last plan (they could have drafted and did not)
        move back towards the engine-wide estimates, ``DRIFT`` a step for ``steps`` steps."""
        idle = rows[self.idle[rows]]
        drift = 1.0 - (1.0 - DRIFT) ** steps
        self.alpha[idle] += drift * (self.prior - self.alpha[idle])
        self.pooled[idle] += drift * (self.prior_pooled - self.pooled[idle])
        self.rate[idle] += drift * (self.prior_rate - self.rate[idle])

    # ------------------------------------------------------------------ rows
    def rows(self, req_ids: list[str]) -> np.ndarray:
        """The requests' rows, made from the engine-wide estimates for new ones."""
        get = self._rows.get
        rows = [get(r) for r in req_ids]
        if None in rows:
            rows = [self._row(r) if row is None else row for r, row in zip(req_ids, rows)]
        return np.array(rows)

    def _row(self, req_id: str) -> int:
        """The request's row, made on first sight from the engine-wide estimates."""
        row = self._rows.get(req_id)
        if row is not None:
            return row
        if not self._free_rows:
            old = len(self.rate)
            grow = max(16, old)
            self.alpha = np.concatenate((self.alpha, np.zeros((grow, self.max_k))))
            self.pooled = np.concatenate((self.pooled, np.zeros(grow)))
            self.rate = np.concatenate((self.rate, np.zeros(grow)))
            self.idle = np.concatenate((self.idle, np.zeros(grow, dtype=bool)))
            self.weight = np.concatenate((self.weight, np.zeros(grow)))
            self.rise = np.concatenate((self.rise, np.zeros(grow)))
            self.fall = np.concatenate((self.fall, np.zeros(grow)))
            self._free_rows = list(range(old + grow - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.apply_pending()  # the priors this row starts from include the step so far
        self.alpha[row] = self.prior
        self.pooled[row] = self.prior_pooled
        self.rate[row] = self.prior_rate
        self.idle[row] = False
        self.weight[row], self.rise[row], self.fall[row] = ACCEPT_SMOOTHING, 0.0, 0.0
        self._rows[req_id] = row
        return row

    def acceptance(self, req_id: str) -> np.ndarray:
        """The request's acceptance per position (the engine-wide one if it is new)."""
        self.apply_pending()
        row = self._rows.get(req_id)
        return self.prior.copy() if row is None else self.alpha[row].copy()

    def set(self, req_id: str, alpha, rate: float) -> None:
        """Set a request's acceptance per position and proposal rate (tests, warm starts)."""
        self.apply_pending()
        row = self._row(req_id)
        self.alpha[row], self.rate[row] = alpha, rate
        self.pooled[row] = np.mean(alpha)

    def free(self, req_id: str) -> None:
        row = self._rows.pop(req_id, None)
        if row is None:
            return
        if row in self._pending_rows:  # its queued observation still teaches the priors:
            self._releasing.append(row)  # the row is reused once that is applied
        else:
            self._free_rows.append(row)

    def __contains__(self, req_id: str) -> bool:
        """Whether the request has estimates of its own (a row)."""
        return req_id in self._rows


def _weight(weight: float, rise: float, fall: float, pooled: float, ones: int, rejected: bool
            ) -> tuple[float, float, float]:
    """A request's step of outcomes (``ones`` accepted, then one rejection or none) against
    its pooled estimate: the weight they move its estimates by, and its CUSUM sums after
    them. Past ``CHANGE_THRESHOLD`` either way (the rise at its peak, after the accepted
    ones), acceptance changed: the weight is ``ACCEPT_SMOOTHING`` again and the sums start
    over."""
    rise = max(rise + ones * (1.0 - pooled - CHANGE_SLACK), 0.0)
    peak = rise
    fall = max(fall + ones * (pooled - 1.0 - CHANGE_SLACK), 0.0)
    if rejected:
        rise = max(rise - pooled - CHANGE_SLACK, 0.0)
        fall = max(fall + pooled - CHANGE_SLACK, 0.0)
    if peak > CHANGE_THRESHOLD or fall > CHANGE_THRESHOLD:
        return ACCEPT_SMOOTHING, 0.0, 0.0
    return weight, rise, fall


def _batch_weight(count):
    """The weight of ``count`` observations in the engine-wide exponential average."""
    return 1.0 - (1.0 - PRIOR_SMOOTHING) ** count
