"""The drafter protocol: what the speculator asks of every way of proposing draft tokens
(the implementations live in ``specserve.drafts``)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.request import Request
from specserve.scheduler import ScheduledRequest
from specserve.spec.stopping import StopRule


@dataclass
class DraftProposal:
    """Proposals for one step, one list per scheduled request (empty where k_i = 0).

    ``draft_probs`` holds q, the distribution each proposal was drawn from, one row per
    proposed token in schedule order (``[Σ len(draft_token_ids[i]), vocab]``); None means
    every proposal is deterministic and q is one-hot on it.

    ``draft_ids`` set means the proposals are still on the device (a model drafter never
    waits for its own tokens): ``draft_token_ids`` then hold placeholders of the right
    lengths, the target's verify pass reads the ids from the device, and the rejection
    sampler brings their values back with the sampled tokens, in the step's one copy.
    """

    draft_token_ids: list[list[int]]
    draft_probs: torch.Tensor | None = None
    draft_ids: torch.Tensor | None = None    # [Σ len(draft_token_ids[i])] int64, on the device
    # With a stopping rule (``spec.stopping``): each proposal's confidence, per request,
    # and the rows each of the drafter's passes ran (the first included); None: every
    # planned draft proposed, each pass over the rows still drafting.
    confidence: list[list[float]] | None = None
    pass_rows: list[int] | None = None
    # And per request the first draft the rule did not keep, (depth, token, confidence), or
    # None: its target token tells the calibration map whether it would have been accepted.
    dropped: list[tuple[int, int, float] | None] | None = None
    # The stopping rule's expected goodput of the step as drafted (emitted tokens per
    # second), which further tree nodes must pay at; None without one.
    goodput: float | None = None
    # For a draft tree (``spec.tree``), per request, per depth of its drafts: its drafter's
    # likeliest tokens there, best first, and their probabilities (empty: no tree; None:
    # the drafter grows none). The proposals are then on the host.
    candidates: list[list[tuple[list[int], list[float]]]] | None = None
    # Or, where the tree's shape is fixed (``DraftTrees.grow_fixed``): its drafter's
    # likeliest tokens at each pass, best first, still on the device (``[Σ rows of every
    # pass, TREE_RANKS + 1]``), the first of each pass's rows among them, and each drafting
    # entry's row within a pass (by index in the schedule). The proposals stay on the device.
    leaves: tuple[torch.Tensor, list[int], dict[int, int]] | None = None


class Drafter(Protocol):
    """Proposes up to ``planned.num_lookahead`` tokens for each scheduled request.

    The speculator calls ``propose`` once per step with the whole schedule (prefill chunks
    included, so a drafter with its own KV cache can keep up in lockstep), then the engine
    verifies every proposal in the target's single ragged pass.
    """

    name: str
    # Whether ``propose`` must see every step, drafts or not (a drafter with its own KV
    # cache keeps up in lockstep); one that does not is skipped when no request drafts.
    needs_every_step: bool
    # Whether a step without drafts may feed it once the target's pass is under way (its
    # catch-up reads nothing of that pass: a draft model's own cache does, an EAGLE head,
    # fed the target's features of that pass, does not): on a GPU its host work then runs
    # while the device computes the target's pass, not before it (``Speculator.catch_up``).
    feeds_after_target: bool
    # Whether it knows its confidence in each proposal and can stop drafting by it
    # (``spec.stopping``): a model drafter by its q, n-gram lookup by its match's length.
    confidence: bool
    # The most draft paths it proposes per request: 1, or more for a drafter that ranks
    # candidates and follows a further path's fork (``spec.paths.PathEntry``).
    max_paths: int
    # Whether its catch-up runs at every step, drafts or not, and yields the first
    # proposals: a draft depth D then costs D - 1 passes more (``spec.cost_model.StepCosts``).
    first_draft_in_catch_up: bool
    # Seconds the last ``propose`` spent catching its cache up (a drafter that sees every
    # step): where steps without drafts feed it first, work that runs whatever k is, so
    # the step's cost model counts it with the target's pass, not with the drafts;
    # where they feed it after the target's pass, what drafting at all costs
    # (``Speculator.catch_up``). 0 for a drafter without a cache.
    last_catch_up_s: float
    # Seconds of the last ``propose``'s catch-up over tokens that earlier steps left unfed
    # (a drafter that catches up lazily: the prompt, and the tokens of the steps it did not
    # draft): what starting to draft costs once, not what a drafted step costs, so neither
    # the goodput check nor the cost model counts it (0 for any other drafter).
    last_backlog_s: float
    # Steps of at least this many requests leave a request that drafts nothing unfed
    # (``catch_up_lazily``): inf where every step keeps its cache up, 0 without a cache.
    lazy_from: float
    # How a KV cache of the drafter's own (same block ids as the target's) uses cached
    # prefix blocks: None (it has none), "tokens" (it catches up from the blocks its entries
    # are valid for) or "features" (its entries need the target's hidden states): see
    # ``KVCacheManager``.
    draft_cache: str | None

    def kv_bytes_per_block(self) -> int:
        """Bytes of the drafter's own KV cache per block (0 when it has none)."""

    def bind(self, runner) -> None:
        """Called once the target runner (and so the number of KV blocks) exists."""

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Run the drafter's own forward passes as CUDA graphs where it can (see
        ``ModelRunner.enable_graphs``); a drafter without a model does nothing."""

    def feed(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
             ready: torch.cuda.Event | None = None) -> None:
        """(A drafter that ``feeds_after_target``.) What ``propose`` does for ``scheduled``
        when no request drafts, called once the target's pass is under way: it may run
        beside that pass (on a GPU stream of its own, after ``ready``, an event recorded
        before the target's pass was queued), as long as its next use waits."""

    def catch_up_lazily(self, from_requests: float = 1) -> bool:
        """(A drafter with ``confidence``.) From now on, in steps of at least
        ``from_requests`` requests, feed its own cache only for the requests that draft,
        catching each up when it next does (``lazy_from``); False where it cannot."""

    def time_pass(self, scheduled: list[ScheduledRequest], passes: int = 4) -> float | None:
        """Seconds one of its draft passes over ``scheduled`` (a token each) adds to a step
        whose passes run back to back (timed over ``passes`` of them), for the start-up
        profile of the cost model; None where it has no pass to time alone."""

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy blocks (source, destination) in the drafter's own KV cache, if it has one:
        the step forked draft paths (only where ``max_paths`` > 1)."""

    def propose(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
                stop: StopRule | None = None) -> DraftProposal:
        """Proposals for ``scheduled``. A request admitted this step
        (``draft_cache_valid`` set) starts with its own cache valid that far: its cached blocks'.
        ``stop`` (only for a drafter with ``confidence``): the step's per-token stopping
        rule, which may keep fewer drafts than planned."""

    def cached_tokens(self, req_id: str) -> int:
        """How many first positions of ``req_id`` the drafter's own cache holds entries for
        (0 without a cache)."""

    def free(self, req_id: str) -> None:
        """Forget a finished request."""

    def close(self) -> None:
        """Let go of the drafter's model and cache (the engine is shutting down)."""

    def describe(self) -> str:
        """One line for the start-up log."""
