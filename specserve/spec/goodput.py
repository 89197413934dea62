"""Whether a plan's drafts pay, from the goodput they deliver (``GoodputCheck``).

A cost model can be wrong where it matters most: on a host-bound GPU step at a few
hundred requests, what drafting adds around the pass is hard to tell from what the batch
costs anyway. So the plan answers to what it delivers: for each kind of step, the
realised goodput (emitted tokens per second of whole step) of the steps that ran drafts
is compared with that of the steps that ran none, and drafts are vetoed where they
deliver less, by more than twice the comparison's standard error. At a large batch the
plain side is the plain regime's: a step without drafts right after one of its kind with
drafts (the switch) teaches neither side (``observe``), and a check of that side chosen
there runs the kind's next step without drafts too (``continues``). The same steps tell
how far the plan's promises fall short of what its drafts deliver, or beyond it
(``promise``): where they deliver more than promised, the plan's bar is lowered as much.
"""
from __future__ import annotations

import math

CHECK_MIN = 4               # a side stale after CHECK_MIN to CHECK_MAX of its mean step
CHECK_MAX = 64              # durations without a step, the more by CHECK_SPREAD
CHECK_MAX_S = 0.5           # and once the verdict is clear (CHECK_MAX), this many seconds at least
CHECK_SPREAD = 16           # per standard error between the two sides' goodputs
CHECK_DECAY = 0.95          # per step of a side, how much of its sums is kept
CHECK_STALL = 3.0           # a step counts at most this many times its side's mean duration
VETO_HYSTERESIS = 0.02      # drafts are vetoed below -this log goodput ratio, allowed above +this
VETO_Z = 2.0                # and only if the ratio is this many standard errors below 1
CHECK_PRIOR_CV = 0.5        # a one-request step's goodput deviation assumed, plus
CHECK_JITTER_CV = 0.2       # any step's from the host's timing alone,
VERDICT_EVERY = 8           # the verdict is weighed at drafted and checked steps, and every this many plain ones
CHECK_PRIOR_STEPS = 2       # as if seen over this many steps, before a side's own steps show theirs
VETO_NEW_BATCH = 0.5        # under a veto, what the drafted side keeps when most of a lone request's batch is new
LARGE_BATCH = 8             # from this batch a step's cost is the machine's (``stale``, ``observe``)
CHECK_SHARE = 0.01          # there, what a veto's checks add: at most this share of the kind's time
INHERIT = 0.5               # what a kind new to the check takes of its neighbour's evidence
PLAIN_SLOPE_PRIOR = 0.01    # a plain step's slope taken as proportional, weighed as steps this spread (x batch^2)
PROMISE_PRIOR_STEPS = 4     # drafts delivering what their plans promised, as if seen over this many steps,
PROMISE_MAX = 2.0           # and at most this many times it


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
    below it (half as many standard errors); at a large batch the latter only at a step
    with drafts (``stale``).

    A veto is a verdict on the requests it was formed on. When most of a step's requests
    are new since the kind's last step (at batch 1, the next request: chat after code, or
    code after chat), the drafted side keeps ``VETO_NEW_BATCH`` of its sums at batch 1, more
    at larger batches (``saw``): with its own decay alone, under a veto its steps being the
    rare checks, a verdict formed on chat would take hundreds of steps of code, where drafts
    pay, to turn.

    Steps the plan leaves without drafts are free samples of the plain side; a step is
    run the other way (the plan's drafts withheld, or let through under a veto) only when
    one side has gone stale: no step for ``interval`` times its mean step duration — a
    short wait while the verdict is uncertain, a long one once it is clear, so a check's
    share of the time, which is what it costs, stays small where the verdict is known.
    A step slower than ``CHECK_STALL`` times its side's mean counts as that much (another
    process stalled the machine)."""

    def __init__(self, max_k: int, batch: int = 1) -> None:
        self.max_ratio = 1.0 + max_k
        self.large = batch >= LARGE_BATCH          # a step's tokens a mean over many requests (``stale``, ``observe``)
        # A step's tokens are the sum of its requests': their deviation shrinks as 1 / sqrt(batch).
        self.prior_cv = math.sqrt(CHECK_PRIOR_CV ** 2 / max(batch, 1) + CHECK_JITTER_CV ** 2)
        self._counts = [0, 0]                      # steps seen per side, undecayed
        self.vetoed = False
        self.num_checks = 0                        # steps run the other way
        # [drafted, plain] x [steps, tokens, seconds, tokens^2, tokens*seconds, seconds^2];
        # plain floats: this runs every step, and numpy scalars cost several times more.
        self._sums = [[0.0] * 6, [0.0] * 6]
        self._since = [0.0, 0.0]                   # seconds of this kind since each side's last step
        self._running: list[int | None] = [None, None]  # per side, a check's step chosen (``running``)
        self._observed = 0                         # steps observed
        self._joined: int | None = None            # requests joined by the last step, while vetoed
        self._z: float | None = None               # ``z`` of the sums as they are (None: to compute)
        self._check_extra_s = 0.0                  # what the last check under a veto added to a plain step
        self._promises = [0.0, 0.0, 0.0]           # drafted steps with a promise: decayed steps, tokens, tokens promised
        self._continuing = False                   # the kind's next step goes on with a plain check (``continues``)

    @property
    def steps_seen(self) -> tuple[int, int]:
        """Steps counted per side (drafted, plain), undecayed; where the kind started from a
        neighbour's evidence (``inherit``), its share of the neighbour's count included."""
        return self._counts[0], self._counts[1]

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
        """log(ratio) in standard errors (each side's goodput a ratio estimator); kept
        until the sums change (``stale`` asks for it at every choice, ``observe`` at every
        drafted step)."""
        if self._z is None:
            self._z = self._compute_z()
        return self._z

    def _compute_z(self) -> float:
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
    def promise(self) -> float:
        """How many times the tokens their plans promised the kind's drafted steps delivered
        (in the seconds they took), where that is more than 1: the factor by which the bar a
        plan with drafts must clear is lowered (``Prices.promise``). Shrunk towards 1 as if
        ``PROMISE_PRIOR_STEPS`` steps had kept their promise, and at most ``PROMISE_MAX``.

        The plan prices a step without drafts as the kind's own plain steps showed, but a
        step with drafts by the cost fit and the acceptance estimates. Where those are
        pessimistic (on a GPU under load a batch's drafted steps delivered more than its plain
        ones, while the plan chose no drafts for most of its steps), nothing else corrects
        them: the veto acts only against drafts. Where they are optimistic (a plan whose
        drafter stops by its confidence promises its best case) the veto stays the safety
        net, and the bar is left as it is."""
        steps, tokens, promised = self._promises
        if promised <= 0:
            return 1.0
        prior = PROMISE_PRIOR_STEPS * promised / steps
        return min(max((tokens + prior) / (promised + prior), 1.0), PROMISE_MAX)

    @property
    def interval(self) -> int:
        """How stale a side may go, in its mean step durations: the longer the clearer the
        verdict, but always the shortest while the evidence leans against what the kind
        does now (drafting while drafts look slower, or vetoed while they look faster),
        so a verdict that is forming forms in a few checks, not ever more rarely."""
        z = self.z
        if (z < 0) != self.vetoed and z != 0:
            return CHECK_MIN
        return int(min(CHECK_MAX, CHECK_MIN + CHECK_SPREAD * abs(z)))

    def plain_step(self, num_reqs: int) -> float | None:
        """Seconds a step of ``num_reqs`` requests without drafts takes, as this kind's own
        such steps showed (None before ``CHECK_MIN`` of them). The bar a plan with drafts
        must clear: the cost model is a linear fit over every kind, and where a step's
        cost bends with the batch (a CPU's per-token cost falls as rows share the weights
        they read) its extrapolation to a large batch can be far off, which no check's
        verdict would correct before the drafts it let through were paid.

        A line through the plain steps' (requests, seconds), one token a request: their
        mean step, and a slope between none and their seconds per request (a step never
        costs less for more requests, nor more than in proportion), shrunk towards the
        latter where their batch sizes barely differ (``PLAIN_SLOPE_PRIOR``). A kind spans
        a factor of two in batch size, and on a CPU a plain step costs about the same from
        17 requests to 24: priced in proportion, the bar was under what a fresh burst's
        plain steps deliver, where drafts lost, and above what a draining batch's do,
        where they paid."""
        steps, tokens, seconds, tt, ts, _ = self._sums[1]
        if self._counts[1] < CHECK_MIN or tokens <= 0:
            return None
        mean_n, mean_s = tokens / steps, seconds / steps
        proportional = mean_s / mean_n
        spread = max(tt - tokens * mean_n, 0.0)  # the batch sizes' decayed sum of squared deviations
        prior = PLAIN_SLOPE_PRIOR * mean_n * mean_n
        slope = (ts - tokens * mean_s + prior * proportional) / (spread + prior)
        return mean_s + min(max(slope, 0.0), proportional) * (num_reqs - mean_n)

    def stale(self, drafted: bool) -> bool:
        """Whether the drafted (or plain) side needs a step: it has none yet while the
        other has ``CHECK_MIN``, or none for ``interval`` of its mean step durations and,
        once the verdict is clear, for ``CHECK_MAX_S`` seconds of this kind's steps at
        least (where steps are short, ``CHECK_MAX`` of them alone would check often).

        At batches of ``LARGE_BATCH`` or more, where a step's tokens are a mean over many
        requests' and its cost is the machine's:
        - the plain side's first ``CHECK_MIN`` steps are taken once the kind has drafted,
          one after another (a step chosen and not yet observed counts). They are the bar
          the plan's drafts must clear (``plain_step``) and half of any verdict; where drafts
          lose (a large CPU batch, which the cost fit prices from smaller ones) every step
          drafted before them is paid, and spaced out as later checks are they come late;
        - under a veto, a check's drafts come no more often than keeps what the last such
          check added to a step (its seconds over the plain side's mean) at
          ``CHECK_SHARE`` of the kind's time. On a CPU such a check also feeds the lazily
          fed draft every token since its last, which the drafted side's mean does not
          tell, and spaced by the interval alone one came in every new burst of requests.
          The veto meanwhile stands unless the plain steps turn the ratio (``observe``):
          as a burst drains within its kind (24 requests to 16), the plain steps deliver
          less and the drafted side's evidence, formed at 24, looks better than it is;
          lifted or checked for that alone, a veto was tried again in nearly every burst.
        Not at small batches: there a drafted step's tokens vary most (all accepted, or
        none), a verdict formed on a step's first few would be a coin's, and a lone request
        new to a veto (code after chat) must get its chance within its first steps."""
        side = 0 if drafted else 1
        running = self._running[side]
        if not drafted and self.large and not self.vetoed and self._counts[0] \
                and self._counts[1] + (running is not None) < CHECK_MIN:
            return True  # the kind's first steps without drafts, back to back (``stale``)
        if running is not None and self._observed - running < 3:
            return False
        steps, _, seconds = self._sums[side][:3]
        if steps == 0:
            return self._sums[1 - side][0] >= CHECK_MIN
        interval = self.interval
        wait = interval * seconds / steps
        if interval >= CHECK_MAX:
            wait = max(wait, CHECK_MAX_S)
        if drafted and self.vetoed and self.large:
            wait = max(wait, self._check_extra_s / CHECK_SHARE)
        return self._since[side] >= wait

    def running(self, drafted: bool, switch: bool = False) -> tuple[int | None, int]:
        """A step of the drafted (or plain) side was chosen to check it: that side is not
        stale until the step is observed (where the engine learns from a step while the
        next one runs, after the next choice: one check, not two), or two more steps were
        (a step that failed is never observed). ``switch``: a plain one, chosen right after
        a step of this kind with drafts; at a large batch it teaches neither side
        (``observe``), and the kind's next step goes on with the check (``continues``).
        Returns the side's mark before and the one set (``unchoose``)."""
        side = 0 if drafted else 1
        before, self._running[side] = self._running[side], self._observed
        if switch and not drafted and self.large:
            self._continuing = True
        return before, self._observed

    def continues(self) -> bool:
        """Whether this kind's step now to be chosen goes on with a plain check begun at a
        switch (then it is that check's step, without drafts: after a plain step of its
        kind, or after another kind's, in the regime the kind runs in)."""
        continuing, self._continuing = self._continuing, False
        return continuing

    def unchoose(self, continued: bool, started: tuple[int | None, int] | None) -> None:
        """A choice made ahead was withdrawn: what it did here is undone. ``continued``: it
        took a plain check's step (``continues``), which is still to come; ``started``: it
        began a plain check at a switch, the side's mark before it and the one it set,
        which goes back unless a step's lesson has cleared it since."""
        if continued:
            self._continuing = True
        if started is not None:
            before, mark = started
            self._continuing = False
            if self._running[1] == mark:
                self._running[1] = before

    def inherit(self, other: "GoodputCheck") -> None:
        """Start from a neighbouring kind's evidence and verdict, at ``INHERIT`` of its
        weight (the controller's kinds differ in batch size by a factor of two): where a
        batch shrinks through the kinds as its requests finish (a burst draining), each
        would otherwise try drafts afresh until its own checks agree with the last."""
        self._sums = [[INHERIT * value for value in side] for side in other._sums]
        self._z = None
        self._counts = [int(INHERIT * count) for count in other._counts]
        self._promises = [INHERIT * value for value in other._promises]
        self.vetoed = other.vetoed

    def saw(self, joined: int, batch: int) -> None:
        """A step of this kind under a veto, of ``batch`` requests, ``joined`` of them ever
        (a running count): if more than half the batch joined since the last such step, the
        drafted side's evidence (formed on other requests) weighs less: half at batch 1,
        ``VETO_NEW_BATCH ** (1 / sqrt(batch))`` of it at larger ones. A lone request is the
        whole step (chat, then code); a batch's acceptance is a mean over its requests,
        which varies between batches of one workload as 1 / sqrt(batch), and what the step
        costs is the machine's. Halved at every new batch (a burst after a burst), a clear
        veto was checked again in each, at several plain steps' cost on a CPU."""
        if self._joined is not None and 2 * (joined - self._joined) > batch:
            kept = VETO_NEW_BATCH ** (1.0 / math.sqrt(max(batch, 1)))
            self._sums[0] = [kept * value for value in self._sums[0]]
            self._z = None
        self._joined = joined

    def observe(self, drafted: bool, checked: bool, tokens: int, seconds: float, backlog_s: float = 0.0,
                promised: float = 0.0, after_drafts: bool = False) -> None:
        """A step of this kind ran: ``drafted`` whether it ran drafts, ``checked``
        whether the check chose so (against the plan, or against the veto). ``backlog_s``:
        what it spent besides ``seconds`` on earlier steps' tokens (a lazily fed draft's
        catch-up): not the drafts' goodput, but what a check under a veto costs.
        ``promised``: the goodput (tokens per second) the plan behind its drafts expected
        (0: none known), for ``promise``. ``after_drafts``: the engine's step before it
        was of this kind and ran drafts, and this one ran none. At a large batch such a
        step is the switch between the regimes, which teaches neither side: it costs more
        than a run of plain steps' (likely: a plan is made, and after a step that accepted
        every draft the draft's catch-up feeds that draft too, which the target's inputs do
        not hold), and priced at it, the plain side made drafts that
        lose to speculation off look better. Its time counts only towards the drafted
        side's staleness, and a check of the plain side it was chosen for stays running
        (``continues``). After another kind's drafts a step is taught as any: that is the
        regime this kind runs in while the other drafts."""
        side = 0 if drafted else 1
        self._observed += 1
        if not drafted and after_drafts and self.large:
            self._since[0] += max(seconds, 0.0)
            return
        if checked:
            self._running[side] = None
        if seconds <= 0:
            return
        sums, other = self._sums[side], self._sums[1 - side]
        if sums[0] >= CHECK_MIN:
            seconds = min(seconds, CHECK_STALL * sums[2] / sums[0])  # a stall, not the step
        elif other[0] >= CHECK_MIN:  # a side's first steps: the other side's steps tell a stall
            seconds = min(seconds, CHECK_STALL * self.max_ratio * other[2] / other[0])
        if drafted and checked and self.vetoed and other[0]:
            extra = seconds + backlog_s - other[2] / other[0]
            if sums[0]:  # a stall in the backlog is not what a check costs either
                extra = min(extra, CHECK_STALL * sums[2] / sums[0])
            self._check_extra_s = max(extra, 0.0)
        self._counts[side] += 1
        if drafted and promised > 0:
            self._promises = [CHECK_DECAY * old + value
                              for old, value in zip(self._promises, (1.0, tokens, promised * seconds))]
        new = (1.0, tokens, seconds, tokens * tokens, tokens * seconds, seconds * seconds)
        self._sums[side] = [CHECK_DECAY * old + value for old, value in zip(sums, new)]
        self._z = None
        self._since[1 - side] += seconds
        self._since[side] = 0.0
        self.num_checks += checked
        # The verdict moves with the drafted side and the checks; the plan's own plain steps
        # (every step of a kind without drafts) move it slowly: it is weighed at every
        # VERDICT_EVERY-th of them (its standard error is not free at every step under a veto).
        if not drafted and not checked and self._counts[1] % VERDICT_EVERY:
            return
        log_ratio = math.log(self.ratio)
        if self.vetoed:  # lifted once the ratio is not clearly below 1
            # At a large batch, by a drafted step's evidence, or by the plain steps' only if
            # they turn the ratio: theirs shifts as the batch drains within the kind (fewer
            # requests deliver less), which is not evidence about drafts (``stale``).
            unclear = self.z >= -VETO_Z / 2 and (drafted or not self.large)
            self.vetoed = log_ratio < VETO_HYSTERESIS and not unclear
            if not self.vetoed:
                self._joined = None  # a later veto counts from its own steps
        else:  # and never on a side's first few steps, however clear they look
            self.vetoed = log_ratio < -VETO_HYSTERESIS and self.z < -VETO_Z and min(self._counts) >= CHECK_MIN
