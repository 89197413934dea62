"""Where a request's drafting stops, token by token (``StopRule``, ``DraftStop``).

The controller plans each request's k as the most it may draft this step (slots and
budget reserved). A drafter that knows its confidence (a draft model, an EAGLE head, by
q; n-gram lookup, by its match's length) then decides depth by depth, after each pass
(a lookup's proposals are judged the same way, all found at once), with the step's prices
from the cost model and the calibration map:

* **Keep a drafted token** if its chance of being emitted, P = the product of the
  calibrated acceptance of it and every kept token before it, pays for what verifying
  it costs at the step's goodput so far: P >= G * (token [+ span for a first draft]),
  G = expected emitted tokens / expected step time. That time counts the drafter's first
  pass and what drafting at all costs: they are spent before any choice and paid even by
  a step that drops its drafts, so leaving them out overstates G and drops drafts that
  pay. A depth no request kept before also pads every request on a padded pass; the
  tokens kept there pay for that together.
* **Run one more pass** for the requests whose next token would pay: its chance is
  estimated as P times this token's calibrated acceptance (confidence runs in streaks),
  against its verify and draft cost; those together must pay for the pass itself.

Each accepted choice raises G, so the next token must promise more: the rule climbs the
goodput curve and stops at its top. A draft whose confidence says nothing stops at depth
0 where tokens are dear, and drafts to its plan where they are nearly free. Requests
whose k is not the controller's (their own k, a seed, a further draft path) draft what
they planned; their tokens count in G all the same.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from specserve.scheduler import ScheduledRequest
from specserve.spec.calibration import ConfidenceCalibration
from specserve.spec.planner import Prices


@dataclass(frozen=True)
class StopRule:
    """One step's stopping rule: the map, the step's prices and which requests it may stop."""

    calibration: ConfidenceCalibration
    prices: Prices
    num_reqs: int            # decoding requests in the step (each emits a token anyway)
    free: Container[str]     # requests whose k the controller chose
    padded: bool = False     # the verify pass pads every request to the longest query

    def begin(self, rows: list[ScheduledRequest], compact: bool = False,
              caps: list[int] | None = None) -> "DraftStop":
        """The step's drafting rows, in the drafter's order. ``compact``: the drafter's
        further passes run only the rows still drafting (``DraftStop.running``), else the
        first rows up to the last of them. ``caps``: the most drafts each row has (a
        lookup's proposals, fewer than planned where its match's continuation ends; None:
        each row's k)."""
        return DraftStop(self, rows, compact, caps)


class DraftStop:
    """Per row: how many drafts it keeps, and the confidences of those it drafted."""

    def __init__(self, rule: StopRule, rows: list[ScheduledRequest], compact: bool = False,
                 caps: list[int] | None = None) -> None:
        self.rule = rule
        self.compact = compact  # (``StopRule.begin``): what a further pass is charged for
        self.greedy = [p.params.greedy for p in rows]
        self.caps = [p.num_lookahead for p in rows] if caps is None else caps
        self.free = [p.req_id in rule.free and getattr(p, "fork", None) is None for p in rows]
        self.kept = [0] * len(rows)
        self.going = [cap > 0 for cap in self.caps]
        self.chance = [1.0] * len(rows)   # P(every kept draft is accepted)
        self.confidence: list[list[float]] = [[] for _ in rows]
        # The first draft it drafted and did not keep: (depth, confidence), or None. Where
        # every kept draft is accepted, a greedy request's next token says whether this one
        # would have been (``Speculator._calibrate``), so the map learns where it drops too.
        self.dropped: list[tuple[int, float] | None] = [None] * len(rows)
        self.gain = float(rule.num_reqs)  # expected emitted tokens of the step so far
        # Its expected seconds so far: the step without drafts, drafting at all and the
        # first pass, spent.
        prices = rule.prices
        self.time = max(prices.fixed, 1e-9) + prices.draft_fixed + prices.draft_pass + \
            (prices.draft_request + prices.draft_token) * len(rows)
        self.pass_rows = [len(rows)]      # rows each pass ran, the first included (it yields depth 0)
        self.depth = 0                    # deepest kept draft so far
        self.judged = 0                   # depths judged so far
        self.running: list[int] = []      # the rows the next pass runs (``_next_pass``)

    def after(self, depth: int, confidence: list[float]) -> int:
        """The rows still drafting among ``[0, len(confidence))`` drafted their token at
        ``depth`` with these confidences (the other rows' entries are not read): which
        keep it, and how many first rows hold those that draft on (0: drafting ends;
        ``running`` names them)."""
        rule, prices = self.rule, self.rule.prices
        cal = rule.calibration
        self.judged = depth + 1
        pad = prices.padded_token * rule.num_reqs if rule.padded else 0.0
        token = prices.token + (prices.span if depth == 0 else 0.0)
        ratio = self.gain / self.time
        keep, chances, acceptance = [], {}, {}
        rows = [r for r in range(len(confidence)) if self.going[r]]
        for greedy in (True, False):  # one lookup per kind of request, not per row
            of_kind = [r for r in rows if self.greedy[r] == greedy]
            if of_kind:
                predicted = cal.predict(greedy, depth, [confidence[r] for r in of_kind])
                acceptance.update(zip(of_kind, predicted))
        for r in rows:
            chances[r] = self.chance[r] * acceptance[r]
            if not self.free[r] or chances[r] >= ratio * token:
                keep.append(r)
        free_kept = [r for r in keep if self.free[r]]
        if free_kept and depth >= self.depth and not any(not self.free[r] for r in keep):
            # The first row at this depth pads every request: the kept rows pay together.
            if sum(chances[r] for r in free_kept) < ratio * (token * len(free_kept) + pad):
                keep = [r for r in keep if not self.free[r]]
        for r in list(chances):
            if r not in keep:
                self.going[r] = False
                self.dropped[r] = (depth, confidence[r])
        for r in keep:
            self.kept[r] = depth + 1
            self.chance[r] = chances[r]
            self.confidence[r].append(confidence[r])
            self.gain += chances[r]
            self.time += token
        if keep and depth + 1 > self.depth:
            self.depth = depth + 1
            self.time += pad
        return self._next_pass(depth, keep, acceptance, pad)

    def _next_pass(self, depth: int, keep: list[int], acceptance: dict[int, float], pad: float) -> int:
        """Which kept rows draft one more token; the number of first rows the pass runs."""
        prices = self.rule.prices
        ratio = self.gain / self.time
        pinned = [r for r in keep if not self.free[r] and self.caps[r] > depth + 1]
        candidates = [r for r in keep if self.free[r] and self.caps[r] > depth + 1]
        each = prices.token + prices.draft_token
        going = [r for r in candidates if self.chance[r] * acceptance[r] >= ratio * each]
        shared = 0.0 if pinned else prices.draft_pass + pad
        if going and not pinned and \
                sum(self.chance[r] * acceptance[r] for r in going) < ratio * (each * len(going) + shared):
            going = []
        for r in set(candidates) - set(going):
            self.going[r] = False
        for r in keep:
            if self.caps[r] <= depth + 1:
                self.going[r] = False
        running = sorted(pinned + going)
        self.running = running
        if not running:
            return 0
        n = running[-1] + 1
        self.pass_rows.append(len(running) if self.compact else n)
        self.time += prices.draft_pass + prices.draft_token * self.pass_rows[-1]
        return n
