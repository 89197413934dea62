"""The speculator: the engine's one seam to speculation. It owns the drafter, the
draft-length controller and draft paths; the engine only asks it for k per request
(``plan``), for the drafts to verify (``propose``), to turn several verified paths into
one outcome per request (``keep_best_paths``), and tells it what each request's drafts came
to (``record``) and what the step cost (``observe``)."""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from specserve.batch import DeviceTokenIds
from specserve.config import EngineConfig
from specserve.errors import RanksOutOfStepError, SpecserveError
from specserve.kv_cache import KVCacheManager
from specserve.metrics import SpecDecodeStats
from specserve.model_runner import ModelRunner
from specserve.models.quantized import switch_rows
from specserve.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.scheduler import RequestUpdate, ScheduledRequest, Scheduler, SchedulerOutput, StepResult
from specserve.spec.acceptance import DraftOutcome
from specserve.spec.controller import Choice, DraftLengthController
from specserve.spec.cost_model import StepSample, draft_features
from specserve.spec.drafter import Drafter
from specserve.spec.paths import DRAFT_FORKS, DraftPaths, PathEntry, PathOutcome
from specserve.spec.running import DecodingRequests
from specserve.spec.tree import DraftTrees, TreeOutcome, drafted_rows
from specserve.transfer import to_device

logger = logging.getLogger("specserve")

# Steps in a row whose drafting raised before speculation is turned off for good.
MAX_DRAFTER_FAILURES = 3

# The most grammar-forced drafts a structured-output request verifies in one step (unless
# it sets its own k): a forced token is accepted wherever the target's tokenisation agrees.
FORCED_DRAFTS_MAX = 8

# The start-up profile weighs this much against a live step: it times passes alone, live
# steps the host work around them too, but it varies what a steady state does not.
PROFILE_WEIGHT = 0.1
PROFILE_PASSES = 4   # draft passes the start-up profile times back to back


@dataclass
class Drafts:
    """A step's drafts, as the verify pass and the rejection sampler read them, and what
    the speculator keeps of the step to learn from it."""

    scheduled: SchedulerOutput               # the step as verified: further paths included
    device_ids: DeviceTokenIds | None = None  # proposals still on the device
    probs: torch.Tensor | None = None        # q rows [Σ k_i, vocab]; None: one-hot on each proposal
    lookahead: list[int] = field(default_factory=list)  # k per sampling request (its own path)
    drafted: bool = False                    # whether any request drafted
    draft_s: float = 0.0                     # drafting time, the drafter's catch-up excluded
    backlog_s: float = 0.0                   # a lazy drafter's catch-up on earlier steps' tokens
    # A step without drafts whose drafter is fed once the target's pass is under way
    # (``Speculator.catch_up``): the requests it reads the tokens of, and on a GPU an event
    # after the work queued before that pass (what the feed may not run before).
    catch_up: tuple[Mapping[str, Request], torch.cuda.Event | None] | None = None
    paths: dict[str, PathOutcome] = field(default_factory=dict)  # set by keep_best_paths
    pass_rows: list[int] | None = None       # where a stopping rule cut drafting short: each drafter pass's rows
    confidence: dict[str, list[float]] = field(default_factory=dict)  # req_id -> its drafts' confidences
    dropped: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # req_id -> (depth, token, confidence)
    forced: dict[str, int] = field(default_factory=dict)  # req_id -> its grammar-forced drafts
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # req_id -> its grammar's row masks
    # Draft trees (spec/tree.py): the step as the sampler and the scheduler see it, each
    # tree replaced by the path its verification followed; and what each tree came to.
    grown: bool = False                      # some request's drafts grew into a tree this step
    settled: SchedulerOutput | None = None
    trees: dict[str, TreeOutcome] = field(default_factory=dict)
    decided: dict[int, list[int]] = field(default_factory=dict)  # id(settled entry) -> tokens verified in settling

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """``[Σ k_i]`` the proposals on the device, or None: they are the requests' lists."""
        return None if self.device_ids is None else self.device_ids.ids

    def to_host(self) -> None:
        """Bring the proposals still on the device into the requests' lists (a sync)."""
        ids, start = self.device_ids.ids.tolist(), 0
        for planned, count in zip(self.scheduled.scheduled, self.device_ids.counts):
            planned.draft_token_ids = ids[start:start + count]
            start += count
        self.device_ids = None

    def replace(self, tokens: dict[int, list[int]]) -> None:
        """Those entries' drafts become ``tokens[id(entry)]`` (host drafts), proposed with
        certainty: their rows of q are one-hot."""
        if self.probs is not None:
            parts, start, vocab = [], 0, self.probs.shape[1]
            for planned in self.scheduled.scheduled:
                k = drafted_rows(planned)
                new = tokens.get(id(planned))
                if new is None:
                    parts.append(self.probs[start:start + k])
                elif new:
                    (rows,) = to_device([new], torch.int64, self.probs.device)
                    parts.append(torch.nn.functional.one_hot(rows, vocab).to(self.probs.dtype))
                start += k
            self.probs = torch.cat(parts)
        for planned in self.scheduled.scheduled:
            new = tokens.get(id(planned))
            if new is not None:
                planned.draft_token_ids = list(new)
                self.forced[planned.req_id] = len(new)
        self.drafted = self.drafted or any(tokens.values())

    def cut(self, keep: dict[int, int]) -> None:
        """Keep only the first ``keep[id(entry)]`` drafts of those entries (host drafts), and
        their rows of q: the rest are never verified."""
        rows, start = [], 0
        for planned in self.scheduled.scheduled:
            k = drafted_rows(planned)
            n = keep.get(id(planned), k)
            rows += range(start, start + n)
            start += k
            if n < k:
                planned.draft_token_ids = planned.draft_token_ids[:n]
        if self.probs is not None:
            self.probs = self.probs.index_select(0, to_device([rows], torch.int64, self.probs.device)[0])


class Speculator:
    """Drafting, draft lengths and draft paths for one engine (speculation off: no drafter,
    k = 0 for every request)."""

    def __init__(self, config: EngineConfig, drafter: Drafter | None, runner: ModelRunner,
                 kv: KVCacheManager) -> None:
        self.config = config
        self.drafter = drafter
        self.runner = runner
        self.kv = kv
        self.max_k = config.max_draft_tokens if drafter else 0
        self.paths = DraftPaths(kv, self._forks(config.num_draft_paths))
        self.trees = None
        if config.draft_tree_nodes and drafter is not None:
            if not getattr(drafter, "can_grow_trees", False):
                raise SpecserveError(f"draft_tree_nodes: this drafter ({drafter.describe()}) does not grow "
                                     "draft trees yet (a draft model, layer-skip or the quantized self-draft does)")
            if any(layer.self_attn.sliding_window is not None for layer in runner.model.model.layers):
                raise SpecserveError("draft_tree_nodes: this model attends within a sliding window, which "
                                     "draft trees do not support yet")
            self.trees = DraftTrees(config.draft_tree_nodes, kv, runner, drafter, seed=config.seed)
            drafter.grows_trees = True
            drafter.fixed_trees = self._fixed_trees()
        self.stats = SpecDecodeStats()                       # over the engine's lifetime
        self.forced_stats = SpecDecodeStats()  # structured output's grammar-forced drafts
        self.draft_length_counts: Counter[int] = Counter()  # k verified per request-step
        self.tree_size_counts: Counter[int] = Counter()  # further nodes verified per request-step with a tree
        self.controller: DraftLengthController | None = None
        self._decoding = DecodingRequests(self.max_k)
        self._failures = 0  # steps in a row whose drafting raised
        self._ran_drafts = False  # whether the last step observed ran drafts (``observe``)
        # Feed a drafter that allows it after the target's pass in steps without drafts
        # (``catch_up``): on a GPU, where its host work then overlaps the target's pass (a
        # CPU runs the passes in turn either way, the catch-up a cost of every step). False
        # feeds it first, as steps with drafts do (kept for A/B runs).
        self.feed_after_target = runner.device.type == "cuda"
        self._learning: list[Callable[[], None]] = []  # what steps taught the controller, not yet learned
        self._choice: Choice | None = None  # the controller's choice for the step under way
        # The next step's choice, made while this one verified (``learn``): (running version, k, choice).
        self._next: tuple[int, dict[str, int], Choice] | None = None
        if drafter is not None:
            drafter.bind(runner)
            if config.speculative_adaptive:
                confidence = drafter.confidence and not self.paths.forks and self._stops_by_confidence()
                if confidence:
                    drafter.catch_up_lazily()  # drafting nothing then costs nothing
                self.controller = DraftLengthController(self.max_k, forks=tuple(self.paths.forks),
                                                        first_draft_in_catch_up=drafter.first_draft_in_catch_up,
                                                        confidence=confidence, switch_rows=switch_rows(runner.model),
                                                        lazy_from=drafter.lazy_from)

    def _stops_by_confidence(self) -> bool:
        """Whether drafting stops token by token (``draft_stopping``): ``auto`` does on a
        CPU, where reading each depth's confidences costs nothing, not on a GPU, where each
        read waits for the device and the host work per depth outweighs what it saves
        (``benchmarks/results/per_token_drafting/``)."""
        mode = self.config.draft_stopping
        return mode == "confidence" or (mode == "auto" and self.runner.device.type == "cpu")

    def _fixed_trees(self) -> bool:
        """Whether draft trees take a fixed shape (``DraftTrees.grow_fixed``): on a GPU.
        There a tree chosen from the candidates' chances waits for the device twice a step
        (for the candidates, then for the verify pass) and each expansion pass once more;
        a fixed shape waits once, as a chain does
        (``benchmarks/results/draft_tree_h200/fixed_2026-12-03/``). On a CPU, whose passes
        run in turn anyway, trees are chosen, expanded and priced."""
        return self.runner.device.type != "cpu"

    def _forks(self, num_paths: int) -> tuple[tuple[int, int], ...]:
        """Where further draft paths fork from a request's own (``num_paths`` - 1 of
        ``DRAFT_FORKS``); refused for a drafter that proposes one path only."""
        if self.drafter is None:  # speculation off (k = 0): nothing to fork
            return ()
        if num_paths > 1 and self.drafter.max_paths < num_paths:
            raise SpecserveError(f"num_draft_paths {num_paths}: this drafter ({self.drafter.describe()}) "
                                 f"proposes {self.drafter.max_paths} path(s) at most")
        return DRAFT_FORKS[:num_paths - 1]

    def set_num_draft_paths(self, num_paths: int) -> None:
        """Verify ``num_paths`` paths per greedy drafting request from the next step on
        (``specserve tune`` sweeps it on one loaded engine); fixed k only: the controller
        plans for the paths it was made with."""
        if self.controller is not None:
            raise SpecserveError("num_draft_paths can change on an engine with a fixed k only")
        self.paths.forks = list(self._forks(num_paths))

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """CUDA graphs for the drafter's own passes, where it has any."""
        if self.drafter is not None:
            self.drafter.enable_graphs(max_model_len, capture)

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.drafter is None:
            return "off"
        k = f"k {'adaptive, at most ' if self.controller else '= '}{self.max_k}"
        paths = f", {len(self.paths.forks) + 1} draft paths" if self.paths.forks else ""
        return f"{self.drafter.describe()}, {k}{paths}"

    # ------------------------------------------------------------------ the step
    def plan(self, scheduler: Scheduler) -> dict[str, int] | None:
        """k_i for the running requests (``_drafter_plan``), raised where a structured
        output's grammar forces the next tokens: those are the request's drafts this step
        (``Request.forced_drafts``), at most its own k if it set one, else
        ``FORCED_DRAFTS_MAX``. Their acceptance, kept apart from the drafter's, is in
        ``forced_stats``."""
        chosen = self._drafter_plan(scheduler)
        if not scheduler.num_constrained:
            return chosen
        raised = None
        for req in scheduler.running:
            if req.grammar is None:
                continue
            own = req.params.num_speculative_tokens
            req.forced_drafts = req.grammar.forced(FORCED_DRAFTS_MAX if own is None else own)
            if req.forced_drafts:
                raised = raised if raised is not None else dict(chosen or {})
                raised[req.req_id] = max(raised.get(req.req_id, 0), len(req.forced_drafts))
        return chosen if raised is None else raised

    def _drafter_plan(self, scheduler: Scheduler) -> dict[str, int] | None:
        """k_i for the running requests: the engine's k, lowered by the request's own cap;
        with adaptive speculation the controller chooses below that for every decoding
        request that did not set its own k (the API's override wins) or a seed: a seeded
        request's sampled tokens depend on where drafts were verified, and the controller's
        choice on measured step times, so it keeps the fixed k to stay reproducible. Only
        decoding requests draft: the scheduler gives a request in prefill none. None
        without a drafter."""
        if self.drafter is None:
            return None
        k = self.max_k
        if self.controller is None:
            return {r.req_id: k if (own := r.params.num_speculative_tokens) is None else min(k, own)
                    for r in scheduler.running}
        ahead, self._next = self._next, None
        if ahead is not None:
            if ahead[0] == scheduler.running_version and self._admits_none(scheduler):
                chosen, self._choice = ahead[1], ahead[2]  # made while the last step verified: still the same requests
                return chosen
            self.controller.withdraw(ahead[2])
        chosen = self._choose(scheduler)
        self._choice = self.controller.last
        return chosen

    def _choose(self, scheduler: Scheduler) -> dict[str, int]:
        """The controller's choice for the running requests as they are now."""
        decoding = self._decoding
        other_tokens, admitted = scheduler.prefill_estimate(decoding.refresh(scheduler))
        running = scheduler.running
        chosen = self.controller.choose(decoding.free, other_tokens, decoding.num_prefilling + admitted,
                                        self.runner.pads_short_spans(with_prefill=other_tokens > 0),
                                        lambda: sum([len(r.all_token_ids) for r in running]),
                                        decoding.greedy, decoding.joined)
        if decoding.pinned:
            chosen.update(decoding.pinned)
        return chosen

    def propose(self, scheduled: SchedulerOutput, scheduler: Scheduler) -> Drafts:
        """Fill each planned request's draft tokens (placeholders when the proposals are
        still on the device). First the step's further draft paths are forked from the
        budget it leaves and their first blocks copied in every cache."""
        if self.drafter is None:
            return Drafts(scheduled)
        # k per sampling request, its own entry's: further paths are added after them all.
        lookahead = [p.num_lookahead for p in scheduled.scheduled if p.sample]
        drafts = Drafts(scheduled, lookahead=lookahead, drafted=any(lookahead))
        forked = False
        if self.paths.forks:  # part of scheduling the step: not timed as drafting
            budget = scheduler.max_num_batched_tokens - scheduled.num_scheduled_tokens
            forked = self.paths.add(scheduled, budget, self.controller.unforked if self.controller else ())
        start = time.perf_counter()
        if forked:
            self.runner.copy_blocks(scheduled.block_copies)
            self.drafter.copy_blocks(scheduled.block_copies)
        if not drafts.drafted and not self.drafter.needs_every_step:
            drafts.draft_s = time.perf_counter() - start
            return drafts  # nobody drafts: the step is speculation off's
        if not drafts.drafted and self.feeds_after:
            ready = None
            if self.runner.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            drafts.catch_up = (scheduler.requests, ready)  # nobody drafts: fed in ``catch_up``
            return drafts
        stop = self.controller.stop if self.controller is not None else None
        try:
            proposal = self.drafter.propose(self._drafting(scheduled, scheduler), scheduler.requests, stop)
        except RanksOutOfStepError:
            raise  # the ranks cannot go on together: the engine ends
        except Exception:
            return self._drafting_failed(drafts, start)
        self._failures = 0
        for planned, draft in zip(scheduled.scheduled, proposal.draft_token_ids):
            planned.draft_token_ids = draft
        drafts.probs = proposal.draft_probs
        if proposal.candidates is not None:
            budget = scheduler.max_num_batched_tokens - scheduled.num_scheduled_tokens
            threshold = 0.0  # a fixed budget of nodes; where drafting stops by confidence, priced
            if stop is not None and proposal.goodput is not None:
                threshold = proposal.goodput * stop.prices.token
            drafts.grown = self.trees.grow(scheduled, proposal.candidates, budget, threshold, cut=drafts.cut)
        elif proposal.leaves is not None:
            budget = scheduler.max_num_batched_tokens - scheduled.num_scheduled_tokens
            drafts.grown = self.trees.grow_fixed(scheduled, proposal, budget)
        if proposal.confidence is not None:  # the stopping rule kept what it found worth verifying
            drafts.confidence = {p.req_id: c for p, c in zip(scheduled.scheduled, proposal.confidence) if c}
            if proposal.dropped is not None:
                drafts.dropped = {p.req_id: d for p, d in zip(scheduled.scheduled, proposal.dropped) if d is not None}
            drafts.lookahead = [len(p.draft_token_ids) for p in scheduled.scheduled if p.sample]
            drafts.drafted = any(drafts.lookahead)
            drafts.pass_rows = proposal.pass_rows
        if self.kv.draft_cache is not None and self.kv.enable_prefix_caching:
            self._mark_draft_cache(scheduled.scheduled)
        if proposal.draft_ids is not None:
            drafts.device_ids = DeviceTokenIds(proposal.draft_ids,
                                               [len(p.draft_token_ids) for p in scheduled.scheduled])
        # The catch-up is a cost of every step where steps without drafts wait for it too;
        # fed after the target's pass in those, it is what drafting at all costs (a lazy
        # drafter's backlog aside, ``record``).
        every_step_s = self.drafter.last_backlog_s if self.feeds_after else self.drafter.last_catch_up_s
        drafts.draft_s = time.perf_counter() - start - every_step_s
        drafts.backlog_s = self.drafter.last_backlog_s
        return drafts

    @property
    def feeds_after(self) -> bool:
        """Whether a step without drafts feeds the drafter after the target's pass (``catch_up``)."""
        return self.drafter is not None and self.drafter.feeds_after_target and self.feed_after_target

    def catch_up(self, drafts: Drafts) -> None:
        """Feed the drafter a step without drafts that ``propose`` left for here: called
        once the target's pass is under way. The drafter's catch-up reads only the step's
        tokens, not the pass, so on a GPU its host work (building and sending its own
        pass) runs while the device computes the target's, and its pass beside the
        target's (``Drafter.feed``): a step without drafts then costs about what
        speculation off's does, where fed first it waited for both."""
        if drafts.catch_up is None:
            return
        (requests, ready), drafts.catch_up = drafts.catch_up, None
        start = time.perf_counter()
        try:
            self.drafter.feed(drafts.scheduled.scheduled, requests, ready)
        except RanksOutOfStepError:
            raise
        except Exception:  # noqa: BLE001 - as in ``propose``: the step goes on without the drafter
            self._drafting_failed(drafts, start)
            return
        self._failures = 0
        if self.kv.draft_cache is not None and self.kv.enable_prefix_caching:
            self._mark_draft_cache(drafts.scheduled.scheduled)

    @staticmethod
    def _drafting(scheduled: SchedulerOutput, scheduler: Scheduler) -> list[ScheduledRequest]:
        """The entries as the drafter sees them: a request whose grammar forces its next
        tokens drafts those (``plan``), so the drafter only keeps up with it (k = 0) and
        never caches proposals that the forced tokens replace."""
        requests = scheduler.requests
        if not scheduler.num_constrained or not any(
                requests[p.req_id].forced_drafts for p in scheduled.scheduled if p.num_lookahead):
            return scheduled.scheduled
        return [replace(p, num_lookahead=0) if p.num_lookahead and requests[p.req_id].forced_drafts
                else p for p in scheduled.scheduled]

    def _drafting_failed(self, drafts: Drafts, start: float) -> Drafts:
        """The drafter raised: this step verifies no drafts (k = 0 for everyone, lossless as
        ever), and the step's requests are forgotten by the drafter, whose cache catches
        them up afresh next step. ``MAX_DRAFTER_FAILURES`` failed steps in a row turn
        speculation off for good: a drafter that cannot work costs every step its error."""
        logger.exception("the drafter failed; this step's requests go on without drafts")
        for planned in drafts.scheduled.scheduled:
            planned.draft_token_ids = []
            self.drafter.free(planned.req_id)
        drafts.drafted = False
        drafts.draft_s = time.perf_counter() - start
        self._failures += 1
        if self._failures >= MAX_DRAFTER_FAILURES:
            logger.error("the drafter failed %d steps in a row: speculation is off from now on",
                         self._failures)
            self.drafter.close()
            self.drafter = self.controller = None
            self._learning, self._next, self._choice = [], None, None  # lessons for a controller gone
            self.kv.draft_cache = None  # prefix hits no longer wait on a draft cache's entries
            self.max_k = 0
            self.paths.forks = []
        return drafts

    def _mark_draft_cache(self, scheduled: list[ScheduledRequest]) -> None:
        """Tell the prefix cache which blocks the drafter's own cache now holds: its entries
        up to each request's known tokens (not its drafts, which verification may reject)."""
        for planned in scheduled:
            if not isinstance(planned, PathEntry):  # a path's blocks are its own until it wins
                end = planned.start_pos + len(planned.token_ids)
                self.kv.mark_draft_valid(planned.req_id, min(self.drafter.cached_tokens(planned.req_id), end))

    def settle_trees(self, drafts: Drafts, logits: torch.Tensor) -> torch.Tensor:
        """Before sampling: each verified draft tree becomes the path its target followed
        (``DraftTrees.settle``); returns the logits rows of the step as settled."""
        if not drafts.grown:
            return logits
        return self.trees.settle(drafts, logits)

    def keep_best_paths(self, drafts: Drafts, result: StepResult) -> tuple[SchedulerOutput, StepResult]:
        """The step as the scheduler should apply it: for a request that verified further
        draft paths, its best path in its own entry's place (the others' blocks freed);
        draft trees as settled."""
        if drafts.settled is not None:
            return drafts.settled, result
        if not drafts.scheduled.block_copies:
            return drafts.scheduled, result  # every further path forks with a block copy
        # (Paths forked this step are settled even where paths were turned off since.)
        scheduled, result, drafts.paths = self.paths.keep_best(drafts.scheduled, result)
        return scheduled, result

    def record(self, drafts: Drafts, updates: list[RequestUpdate]) -> None:
        """What each request's drafts came to: counted (the tokens it kept: a stop cuts
        them) and, for the controller, queued to learn from (``learn``: its acceptance
        estimates or calibration map); grammar-forced drafts are counted apart and teach
        the controller nothing. Then the requests that finished are forgotten (by the
        controller once it has learned from their last step)."""
        controller, paths, trees = self.controller, drafts.paths, drafts.trees
        # Per-request estimates, where the controller keeps them (not with a calibration map).
        estimates = controller is not None and controller.estimates is not None
        outcomes: list[tuple[str, DraftOutcome]] = []
        finished: list[str] = []
        if trees:
            self.tree_size_counts.update(tree.nodes - tree.chain for tree in trees.values())
        for update in updates:
            if not update.num_draft_tokens and not update.num_planned:  # (most, under a veto)
                if self.drafter is not None and update.req.status is RequestStatus.FINISHED:
                    finished.append(update.req.req_id)
                continue
            accepted = min(update.num_accepted, len(update.new_token_ids))
            if update.req.req_id in drafts.forced:
                self.forced_stats.record(update.num_draft_tokens, accepted)
            elif self.drafter is not None:
                outcome = paths.get(update.req.req_id) if paths else None
                tree = trees.get(update.req.req_id) if trees else None
                own_accepted = update.num_accepted if outcome is None else outcome.own_accepted
                proposed, verified, path_won = update.num_draft_tokens, update.num_draft_tokens, False
                if tree is not None:  # the chain is what the controller planned; the tree is verified
                    own_accepted, proposed, verified = min(update.num_accepted, tree.prefix), tree.chain, tree.nodes
                    path_won = update.num_accepted > tree.prefix
                if estimates and update.num_planned:
                    outcomes.append((update.req.req_id, DraftOutcome(
                        update.num_planned, proposed, own_accepted,
                        1 if outcome is None else outcome.num_paths, update.num_accepted - own_accepted)))
                path_won = path_won or (outcome is not None and outcome.won)
                update.req.spec_stats.record(verified, accepted, path_won)
                self.stats.record(verified, accepted, path_won)
            if self.drafter is not None and update.req.status is RequestStatus.FINISHED:
                finished.append(update.req.req_id)
        for req_id in finished:
            self.drafter.free(req_id)
        if controller is None:
            return
        calibrate = drafts.confidence or drafts.dropped
        if outcomes or finished or calibrate:
            self._learning.append(lambda: self._learn_outcomes(drafts, updates, outcomes, finished, calibrate))

    def _learn_outcomes(self, drafts: Drafts, updates: list[RequestUpdate], outcomes: list[tuple[str, DraftOutcome]],
                        finished: list[str], calibrate: bool) -> None:
        """``record``'s lesson for the controller: the drafts' outcomes, each verified
        draft's confidence against its acceptance, then the finished requests forgotten."""
        controller = self.controller
        if calibrate:
            self._calibrate(drafts.confidence, drafts.dropped, updates, drafts.trees)
        for req_id, outcome in outcomes:
            controller.observe_acceptance(req_id, outcome)
        for req_id in finished:
            controller.free(req_id)

    def learn(self, scheduler: Scheduler | None = None) -> None:
        """Teach the controller what the steps since the last call came to (``record``,
        ``observe``); with the ``scheduler`` of a step under way, also make the next
        step's choice (a fresh plan where it wants one) for its requests, where nothing
        but the step's own update can change them (none is in prefill, none would be
        admitted). The next step takes that choice if no request joined or left ``running``
        and none would be admitted (``plan``), else it chooses again (the choice made ahead then
        counted as one more step of its plan; a fresh plan it made withdrawn).
        The engine calls it with the scheduler once a step's verify pass is under way: on
        a GPU that pass runs while the host learns and chooses, so the controller costs a
        step next to nothing (a choice reads the outcomes of all but the step just before);
        and without, before it forgets a request or idles. The outcomes it queued are
        applied to the estimates here too (``DraftLengthController.settle``), so that a
        choice made when the step is over (its requests changed) finds them applied."""
        learning, self._learning = self._learning, []
        for lesson in learning:
            lesson()
        if scheduler is None or self.controller is None:
            return
        self.controller.settle()
        self._decoding.refresh(scheduler)  # the requests this step admitted, in prefill
        if not self._decoding.num_prefilling and self._admits_none(scheduler):
            chosen = self._choose(scheduler)
            self._next = (scheduler.running_version, chosen, self.controller.last)

    @staticmethod
    def _admits_none(scheduler: Scheduler) -> bool:
        """Whether the next step would admit no waiting request (none waits, or no seat or
        budget is left: a full batch with a queue behind it)."""
        return not scheduler.waiting or scheduler.prefill_estimate(0) == (0, 0)

    def _calibrate(self, confidence: dict[str, list[float]], dropped: dict[str, tuple[int, int, float]],
                   updates: list[RequestUpdate], trees: dict[str, TreeOutcome]) -> None:
        """The calibration map learns from every verified draft token: per request, the
        accepted ones and the first rejected one (those after it were never judged). A
        tree's chain is judged, not the path its verification followed. And from the
        first draft the stopping rule dropped, where the request is greedy and every draft
        it kept was accepted: its next token is the target's choice at that draft's
        position. Without it the map would learn only from the drafts it kept, and a bin
        it predicts too low would never be verified to say so."""
        greedy, depth, seen, accepted = [], [], [], []
        for update in updates:
            req_id = update.req.req_id
            drafted, miss = confidence.get(req_id, ()), dropped.get(req_id)
            if not drafted and miss is None:
                continue
            num_accepted, proposed = update.num_accepted, update.num_draft_tokens
            if (tree := trees.get(req_id)) is not None:
                num_accepted, proposed, miss = min(num_accepted, tree.prefix), tree.chain, None
            judged = min(num_accepted + 1, proposed, len(drafted))
            greedy += [update.req.params.greedy] * judged
            depth += range(judged)
            seen += drafted[:judged]
            accepted += [j < num_accepted for j in range(judged)]
            if miss is not None and update.req.params.greedy and num_accepted == proposed == miss[0] \
                    and len(update.new_token_ids) > proposed:
                greedy.append(True)
                depth.append(miss[0])
                seen.append(miss[2])
                accepted.append(update.new_token_ids[proposed] == miss[1])
        self.controller.observe_confidence(greedy, depth, seen, accepted)

    def observe(self, drafts: Drafts, updates: list[RequestUpdate], elapsed: float) -> None:
        """What the step cost: ``elapsed`` seconds of whole step for its updates' tokens,
        queued for the controller's goodput check and, for a freshly planned step, its
        cost models (``learn``); the draft lengths verified are counted."""
        if self.drafter is None:
            return
        if drafts.drafted:
            self.draft_length_counts.update(drafts.lookahead)
        else:  # most steps under load when drafting does not pay: one count
            self.draft_length_counts[0] += len(drafts.lookahead)
        controller = self.controller
        if controller:
            # The whole step: the host work around the pass (verify lists, rollback,
            # detokenising more tokens) is part of what drafts cost, most of it on a GPU.
            # Without drafts each update is one token (the usual step where drafting does not pay).
            # A lazy drafter's backlog is not: a request's first drafts after its prompt, or
            # a check under a veto, would otherwise pay for every token the plain steps
            # before it left unfed, and the check would confirm the veto that caused it.
            emitted = sum([len(u.new_token_ids) for u in updates]) if drafts.drafted else len(updates)
            # Whether the step before ran drafts and this one none, as they ran (pinned k and
            # grammar-forced drafts included): at a large batch, of one kind, a switch.
            after, self._ran_drafts = self._ran_drafts and not drafts.drafted, drafts.drafted
            self._learning.append(lambda choice=self._choice: self._learn_cost(choice, drafts, emitted, elapsed,
                                                                               after))

    def _learn_cost(self, choice: Choice | None, drafts: Drafts, emitted: int, elapsed: float,
                    after_drafts: bool) -> None:
        """``observe``'s lesson for the controller, about the step ``choice`` chose (None:
        no ``plan`` ran before it: the controller's last)."""
        choice = choice or self.controller.last
        self.controller.observe_goodput(emitted, elapsed - drafts.backlog_s, choice, drafts.backlog_s,
                                        after_drafts)
        if choice.planned:
            self.controller.observe_step(self._step_sample(drafts, elapsed), choice)

    def _step_sample(self, drafts: Drafts, elapsed: float) -> StepSample:
        planned = drafts.scheduled.scheduled
        fed = [len(p.token_ids) for p in planned]
        drafted = [len(p.draft_token_ids) for p in planned]
        lengths = [n + d for n, d in zip(fed, drafted)]
        lookahead = [p.num_lookahead for p in planned]
        tokens = sum(lengths)
        prefill = tokens - sum(drafted) - fed.count(1)  # the chunks' tokens (fed > 1)
        # The rows of the passes the cost model counts (``StepCosts.drafter_passes``: a
        # catch-up that yields the first proposals is not one).
        first_free = self.controller.costs.first_free
        if drafts.pass_rows is None:  # each drafting request ran the passes of its own k
            depth, rows = max(lookahead), sum(max(k - first_free, 0) for k in lookahead)
        else:
            depth, rows = len(drafts.pass_rows), sum(drafts.pass_rows[first_free:])
        return StepSample(
            target_s=elapsed - drafts.draft_s - drafts.backlog_s, num_tokens=tokens - prefill,
            num_spans=len(drafted) - drafted.count(0),
            num_padded=self.runner.padded_tokens(drafts.scheduled, lengths), num_reqs=len(planned),
            context=sum([p.start_pos for p in planned]) + tokens, num_prefill=prefill,
            depth=depth, num_drafting=len(lookahead) - lookahead.count(0), draft_s=drafts.draft_s,
            draft_rows=rows)

    def free(self, req_id: str) -> None:
        """Forget a request that ended (what its steps teach learned first)."""
        self.learn()
        if self.drafter is not None:
            self.drafter.free(req_id)
        if self.controller is not None:
            self.controller.free(req_id)

    # ------------------------------------------------------------------ start-up
    def profile_step_cost(self) -> None:
        """Seed the adaptive controller's cost model (nothing without one): time a few
        verify passes of dummy requests (batch sizes x none or one of them drafting k tokens,
        or all drafting one; two context lengths) over scratch KV blocks, freed afterwards, and
        a draft pass per batch size where the drafter has one to time, and keep them for
        good at a small weight (``PROFILE_WEIGHT``). One drafter in a batch
        separates what padding costs (every request padded to 1 + k on a CUDA graph) from
        what real tokens cost."""
        if self.controller is None:
            return
        c = self.config
        k = self.max_k
        greedy = SamplingParams(temperature=0)
        batches = sorted({1, min(8, c.max_num_seqs), min(32, c.max_num_seqs)})
        # A longer context for the undrafted batches, so the fit can tell what a request
        # costs from what the tokens of its context cost, and one draft each besides k,
        # so it can tell a verify span's cost from its tokens'.
        # A batch where every request drafts k is left out: its batch x (1 + k) rows cross
        # the row count where a CPU's quantized layers turn to another kernel (8 x 5 rows
        # cost 2.5-4.6 ms a token at start-up where 1 to 5 rows cost ~1.5), and a linear fit
        # pulled to that slope priced a lone request's drafts at two to four times their
        # cost. The steps that run such batches teach the fit what they cost.
        plans = [(batch, num_drafting, 4 * c.block_size, k) for batch in batches for num_drafting in (0, 1)]
        plans += [(batch, 0, 16 * c.block_size, k) for batch in batches[1:]]
        plans += [(batch, batch, 4 * c.block_size, 1) for batch in batches[1:] if k > 1]
        logger.info("timing %d verify passes to seed adaptive speculation's cost model", len(plans))
        began = time.perf_counter()
        for batch, num_drafting, context, each in plans:
            drafts = [each if i < num_drafting else 0 for i in range(batch)]
            if batch + sum(drafts) > c.max_num_batched_tokens:
                continue
            ids = [f"__profile_{i}" for i in range(batch)]
            # (slots for the draft passes timed over the same requests too)
            if not all(self.kv.allocate_slots(i, context + 1 + max(d, PROFILE_PASSES)) for i, d in zip(ids, drafts)):
                for i in ids:
                    if self.kv.holds(i):
                        self.kv.free(i)
                continue
            step = SchedulerOutput([ScheduledRequest(i, [0], context, list(self.kv.block_table(i)),
                                                     greedy, num_lookahead=d, draft_token_ids=[0] * d)
                                    for i, d in zip(ids, drafts)], [])
            times = []
            for _ in range(3):  # the first run warms up; the faster of the others (a busy host slows one)
                start = time.perf_counter()
                self.runner.execute(step).argmax(-1).tolist()
                times.append(time.perf_counter() - start)
            elapsed = min(times[1:])
            self.controller.observe_step(StepSample(
                target_s=elapsed, num_tokens=batch + sum(drafts), num_spans=num_drafting if k else 0,
                num_padded=self.runner.padded_tokens(step), num_reqs=batch,
                context=batch * (context + 1) + sum(drafts)))
            if num_drafting == 0 and context == 4 * c.block_size:
                # What a draft pass for the same requests adds to a step, before any step
                # drafts (learned from drafted steps only, a first one slowed by one-off
                # work would otherwise keep drafting off for good).
                passes = [self.drafter.time_pass(step.scheduled, PROFILE_PASSES) for _ in range(2)]
                if passes[-1] is not None:
                    self.controller.costs.draft.observe(draft_features(1, batch, drafting=False), passes[-1])
            for i in ids:
                self.kv.free(i)
        self.controller.costs.target.anchor(weight=PROFILE_WEIGHT)
        if self.controller.costs.draft.num_samples:
            self.controller.costs.draft.anchor(weight=PROFILE_WEIGHT)
        logger.info("cost model seeded in %.1f s", time.perf_counter() - began)

