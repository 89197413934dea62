"""Draft paths: a greedy request verifies its draft's best guesses and up to three further
drafts in one step, a static draft tree.

Each further path takes the drafter's runner-up candidate at one depth (its fork) and
the drafter's best everywhere else. It is one more request-shaped entry of the ragged
pass, fed the request's own tokens over a block table of its own for the step
(``KVCacheManager.fork``): blocks before the fork are shared with the request, the rest
are the path's, the first of them a copy of the request's. After verification the
longest accepted path wins (a tie keeps the request's own): its blocks replace the
request's from the fork on (``KVCacheManager.merge``) and the others are freed, so the
scheduler only ever sees the winner, as if it had been the request's one draft.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import NamedTuple

from specserve.kv_cache import KVCacheManager
from specserve.scheduler import ScheduledRequest, SchedulerOutput, StepResult

# Where a greedy request's further draft paths leave its own, in the order they are
# added: (depth, rank), the path taking the drafter's rank-th candidate (0: its best) at
# that depth. The order is the one in which each fork added most to the built-in draft's
# acceptance on held-out chat (docs/speculation.md).
DRAFT_FORKS = ((0, 1), (1, 1), (0, 2))


@dataclass
class PathEntry(ScheduledRequest):
    """A further draft path of a scheduled request: the same tokens, its own block table
    and drafts that follow ``fork`` = (depth, rank)."""

    path: int = 1                    # 1, 2, ...: the request's own entry is path 0
    fork: tuple[int, int] = (0, 1)


class PathOutcome(NamedTuple):
    """What a request's paths came to in a step."""

    won: bool           # a further path's tokens were kept
    num_paths: int      # paths verified, its own included
    own_accepted: int   # drafts its own path had accepted


class DraftPaths:
    """Forks further paths into a step's schedule and keeps each request's best."""

    def __init__(self, kv: KVCacheManager, forks: tuple[tuple[int, int], ...] = ()) -> None:
        self.kv = kv
        self.forks = list(forks)

    def add(self, output: SchedulerOutput, budget: int, unforked: Container[str] = ()) -> bool:
        """Further paths for ``output``'s greedy drafting requests (except ``unforked``), each
        1 + k tokens of ``budget`` (what the step leaves), first paths of every request
        before second ones, while budget and free blocks last; a path forks only at a
        depth below its request's k and never preempts. Their block copies join
        ``output.block_copies``. Returns whether any path was added."""
        if not self.forks or budget <= 0:
            return False
        drafting = [p for p in output.scheduled  # (a grammar's drafts are checked on one path)
                    if p.num_lookahead and p.params.greedy and p.req_id not in unforked
                    and p.params.structured_outputs is None]
        added = False
        for path, (depth, rank) in enumerate(self.forks, start=1):
            for p in drafting:
                k = p.num_lookahead
                if depth >= k:
                    continue
                if 1 + k > budget:
                    return added
                # From the last computed token on: a draft cache may be a token behind the
                # target's (after a step that accepted every draft) and write it this step.
                copy = self.kv.fork(p.req_id, path, max(p.start_pos - 1, 0), p.start_pos + 1 + k)
                if copy is None:
                    return added
                output.block_copies.append(copy)
                output.scheduled.append(PathEntry(
                    p.req_id, p.token_ids, p.start_pos, self.kv.branch_block_table(p.req_id, path),
                    p.params, num_lookahead=k, long_rope=p.long_rope, path=path, fork=(depth, rank)))
                budget -= 1 + k
                added = True
        return added

    def keep_best(self, output: SchedulerOutput, result: StepResult
                  ) -> tuple[SchedulerOutput, StepResult, dict[str, PathOutcome]]:
        """The step as if each request had verified only its best path: the winner's entry
        and tokens in its own entry's place, the paths' entries gone; the winner's blocks
        kept and the others freed (for a request still alive). Returns the outcome per
        request that verified further paths."""
        best = _best_paths(output, result)
        scheduled: list[ScheduledRequest] = []
        new_token_ids: list[list[int]] = []
        logprobs: list = []
        outcomes: dict[str, PathOutcome] = {}
        sampled_tokens = iter(result.new_token_ids)
        sampled_logprobs = iter(result.logprobs or ())
        for planned in output.scheduled:
            sampled = next(sampled_tokens) if planned.sample else None
            lps = next(sampled_logprobs, None) if planned.sample else None
            if isinstance(planned, PathEntry):
                continue
            if planned.req_id in best:
                path, path_sampled, path_lps, num_paths = best[planned.req_id]
                won = len(path_sampled) > len(sampled)  # a tie keeps the request's own
                outcomes[planned.req_id] = PathOutcome(won, num_paths, len(sampled) - 1)
                if self.kv.holds(planned.req_id):  # not aborted while the step ran
                    self.kv.merge(planned.req_id, path.path if won else None)
                if won:
                    planned, sampled, lps = path, path_sampled, path_lps
            scheduled.append(planned)
            if sampled is not None:
                new_token_ids.append(sampled)
                logprobs.append(lps)
        return (SchedulerOutput(scheduled, output.preempted_req_ids, output.block_copies),
                StepResult(new_token_ids, logprobs if result.logprobs is not None else None), outcomes)


def _best_paths(output: SchedulerOutput, result: StepResult
                ) -> dict[str, tuple[PathEntry, list[int], list | None, int]]:
    """Per request with further draft paths, the one that emitted most tokens (the first
    of equals), its tokens and their log-probabilities (None: not asked), and how many
    paths the request verified (its own included)."""
    best: dict[str, tuple[PathEntry, list[int], list | None, int]] = {}
    sampling = (planned for planned in output.scheduled if planned.sample)
    logprobs = result.logprobs or [None] * len(result.new_token_ids)
    for planned, sampled, lps in zip(sampling, result.new_token_ids, logprobs):
        if isinstance(planned, PathEntry):
            previous, tokens, previous_lps, count = best.get(planned.req_id, (None, (), None, 1))
            if len(sampled) > len(tokens):
                previous, tokens, previous_lps = planned, sampled, lps
            best[planned.req_id] = (previous, tokens, previous_lps, count + 1)
    return best
