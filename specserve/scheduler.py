"""Iteration-level scheduler: one token budget per step, continuous batching, chunked
prefill, preemption by recompute. Python lists in, python lists out — no tensors here."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from specserve.kv_cache import ROOT_HASH, KVCacheManager, PrefixHit
from specserve.logprobs import TokenLogprob
from specserve.request import FinishReason, Request, RequestStatus
from specserve.sampling_params import SamplingParams

RUNNING_LOG_MAX = 1024  # joins and leaves kept for running_changes' reader
LONG_ROPE_ROOT = b"long-rope"  # the hash chain root of LongRoPE long-mode blocks


@dataclass
class ScheduledRequest:
    """One request's share of a step. Set by the scheduler, read by the runner."""

    req_id: str
    token_ids: list[int]          # known tokens fed this step (prefill chunk or last token)
    start_pos: int                # position of token_ids[0] == num_computed_tokens before the step
    block_table: list[int]
    params: SamplingParams
    sample: bool = True           # True when the chunk reaches the end of the known tokens
    num_lookahead: int = 0        # k_i: draft slots reserved in the budget and the KV cache
    # Set by the speculator before the forward pass: at most num_lookahead proposals, fed
    # after token_ids and verified in the same pass.
    draft_token_ids: list[int] = field(default_factory=list)
    # A draft tree instead of a chain: each draft's parent, an earlier draft or -1 for the
    # last fed token (``batch.tree_rows``); None: the drafts are one chain.
    draft_parents: list[int] | None = None
    # A drafter's pass over draft tree nodes (``spec.tree``): the fed tokens' positions and
    # visibility masks (``batch.tree_rows``), where they are not consecutive and causal.
    tree_nodes: tuple[list[int], list[int]] | None = None
    # Set when the request was admitted this step: how many of its first tokens a draft
    # cache holds valid entries for (cached blocks it shares; 0 without any).
    draft_cache_valid: int | None = None
    # Logits for each fed prompt token too, before the sampling rows: the request wants
    # its prompt's log-probabilities (``Request.needs_prompt_logits``).
    prompt_logits: bool = False
    # LongRoPE: the request's positions are rotated with the long factors (``Request.long_rope``).
    long_rope: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_lookahead


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_req_ids: list[str]
    # (source, destination) block ids to copy in every KV cache before the step's first
    # pass (a branch's first own block gets its request's tokens: KVCacheManager.fork).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepResult:
    """What the runner (and, with speculation, the rejection sampler) hands back.

    new_token_ids[i] belongs to the i-th scheduled request with ``sample`` set: the accepted
    draft tokens followed by one bonus/recovered token (just one token without drafts).
    """

    new_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob] | None] | None = None  # parallel to new_token_ids, where asked


class RequestUpdate(NamedTuple):
    """What one sampling request got from a step (returned by ``Scheduler.update``)."""

    req: Request
    new_token_ids: list[int]    # appended to the request, cut at a stop token
    num_draft_tokens: int       # proposals verified this step
    num_accepted: int           # of which the target accepted (before any stop cut)
    num_planned: int = 0        # draft slots planned (k_i); a drafter may propose fewer


# Most rows of logits a prefill chunk keeps for prompt log-probabilities (each row is a
# vocabulary of float32s: 256 rows of a 128k vocabulary are 128 MiB, copied twice).
PROMPT_LOGITS_CHUNK = 256


class Scheduler:
    """Chooses each step's work under ``max_num_batched_tokens`` and ``max_num_seqs``.

    Budget policy: running requests come first, decode/verify before ongoing prefill
    chunks, because their latency is what users feel; each gets 1 + k tokens. Waiting
    requests are then admitted in arrival order and their prefill fills what is left of the
    budget — a prompt longer than the budget is split over several steps. A request is
    admitted only when its chunk's KV blocks can be allocated. With prefix caching it starts
    after the longest run of cached blocks its tokens begin with, and the blocks its
    committed tokens fill are hashed for later requests after every step. When a running
    request cannot get blocks, the newest running request is preempted (its blocks freed,
    the committed ones staying cached) and put back at the front of the waiting queue to be
    recomputed from what is still cached.

    LongRoPE (``long_rope_from``: the model's original length L): as transformers does, a
    sequence longer than L is rotated with the long factors at every position. A request
    admitted with more than L tokens runs in long mode. One admitted shorter drafts no
    further than position L - 1, and once its pending token sits at position L it is
    recomputed from scratch in long mode (counted in ``num_rope_restarts``). Long-mode
    blocks are cached under their own hash chain, so the modes never share a block.
    """

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, long_rope_from: int | None = None) -> None:
        self.kv = kv
        self.long_rope_from = long_rope_from
        self.num_rope_restarts = 0
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_constrained = 0  # requests with a grammar (structured output): steps skip that work at 0
        self.running_version = 0  # changes whenever a request joins or leaves ``running``
        # The joins (True) and leaves (False) that made the versions after _log_start, for a
        # caller that keeps its own view of ``running`` up to date (running_changes); kept
        # once someone asked.
        self._running_log: list[tuple[Request, bool]] | None = None
        self._log_start = 0

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.requests[req.req_id] = req
        self.waiting.append(req)
        self.num_constrained += req.grammar is not None

    def finish_request(self, req_id: str, reason: FinishReason) -> Request | None:
        """End a request (abort, stop string, error); frees its blocks. Idempotent."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        self.num_constrained -= req.grammar is not None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._log_running(req, False)
        else:
            self.waiting.remove(req)
            self.kv.forget(req_id)
        self._release(req, reason)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def running_changes(self, since: int) -> list[tuple[Request, bool]] | None:
        """The requests that joined (True) or left (False) ``running`` after version
        ``since``, in order; None if that is older than the log keeps, or at the first
        call (look at ``running`` itself then). Entries up to ``since`` are dropped: the
        caller has seen them."""
        if self._running_log is None:
            self._running_log, self._log_start = [], self.running_version
            return None
        if since < self._log_start:
            return None
        del self._running_log[:since - self._log_start]
        self._log_start = since
        return self._running_log[:]

    def _log_running(self, req: Request, joined: bool) -> None:
        self.running_version += 1
        log = self._running_log
        if log is None:
            return
        log.append((req, joined))
        if len(log) > RUNNING_LOG_MAX:  # its reader stopped reading: keep it short
            del log[:RUNNING_LOG_MAX // 2]
            self._log_start += RUNNING_LOG_MAX // 2

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_queued(self) -> int:
        """Waiting requests beyond the free sequence slots: those that must wait for a
        running one to end (the others can start at the next step, blocks allowing)."""
        return max(0, len(self.waiting) - max(0, self.max_num_seqs - len(self.running)))

    # ------------------------------------------------------------------ the step
    def schedule(self, num_draft_tokens: dict[str, int] | None = None) -> SchedulerOutput:
        """Plan one step. ``num_draft_tokens`` maps a decoding request to its k_i."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        drafts = num_draft_tokens or {}

        # Decoding requests first, then running requests still in (chunked) prefill.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if req.status is not RequestStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or out of budget this step
            if self._long_rope(req) and not req.long_rope:  # grew past LongRoPE's original length
                self._preempt(req, restart=True)
                preempted.append(req.req_id)
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_limit(req))
            k = drafts.get(req.req_id, 0) if num_new == 1 else 0
            if k:
                k = min(k, budget - num_new, self._max_drafts(req))
            if not self._allocate_or_preempt(req, num_new + k, scheduled, preempted):
                continue
            scheduled.append(self._plan(req, num_new, k))
            budget -= num_new + k

        # Admit waiting requests while budget, sequence slots and blocks allow.
        # A choice that waits for its first's prompt is passed over, the queue's order kept.
        position = 0
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs \
                and not preempted:
            req = self.waiting[position]
            if self._waits_for_prompt(req):
                position += 1
                continue
            hit = self._find_prefix(req)
            num_cached = len(hit.block_ids) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget, self._chunk_limit(req))
            if not self.kv.allocate_slots(req.req_id, num_cached + num_new, hit):
                break
            del self.waiting[position]
            self.kv.record_admission(req.num_tokens, num_cached)
            if req.num_preemptions == 0:
                req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
            req.num_computed_tokens = num_cached
            req.long_rope = self._long_rope(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._log_running(req, True)
            planned = self._plan(req, num_new, 0)
            planned.draft_cache_valid = hit.num_draft_valid * self.kv.block_size
            scheduled.append(planned)
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    @staticmethod
    def _chunk_limit(req: Request) -> int:
        """Tokens a request may feed this step beyond the budget's share: a chunk whose
        every row's logits are kept (prompt log-probabilities) is held to
        ``PROMPT_LOGITS_CHUNK`` rows, so their memory is bounded whatever the budget."""
        return PROMPT_LOGITS_CHUNK if req.needs_prompt_logits else 2**31

    def _find_prefix(self, req: Request) -> PrefixHit:
        """The cached blocks ``req`` may start from: none where it wants the logits of its
        prompt's tokens (its prompt log-probabilities), which a cached block has not kept."""
        if req.needs_prompt_logits:
            return PrefixHit([], 0)
        return self.kv.find_prefix(req.req_id, req.all_token_ids, self._cache_root(self._long_rope(req)))

    def _long_rope(self, req: Request) -> bool:
        """Whether ``req``'s sequence is past LongRoPE's original length (its long mode)."""
        return self.long_rope_from is not None and req.num_tokens > self.long_rope_from

    @staticmethod
    def _cache_root(long_rope: bool) -> bytes:
        """The root of a request's hash chain: long-mode KV is another cache's."""
        return LONG_ROPE_ROOT if long_rope else ROOT_HASH

    def _waits_for_prompt(self, req: Request) -> bool:
        """Whether ``req`` waits for the request it shares its prompt with to have the
        prompt's whole blocks cached (for every cache that must hold them), so that it
        takes them from there; not where there is nothing to share."""
        if req.prompt_from is None or req.num_computed_tokens or req.num_preemptions or req.needs_prompt_logits:
            return False  # (one that wants its prompt's logits computes the prompt itself)
        first = self.requests.get(req.prompt_from)
        return first is not None and not self.kv.prefix_ready(first.req_id, req.num_prompt_tokens)

    def prefill_estimate(self, running_prefill: int) -> tuple[int, int]:
        """The prefill tokens the next step will run beside its decoding requests, and the
        waiting requests it will admit, by ``schedule``'s rule (each running request takes
        a token first; admission stops at the budget or the sequence limit and passes over
        a choice that waits for another's prompt; a cached prefix is not computed again), given
        ``running_prefill`` tokens still to compute for running requests in prefill. An
        estimate: blocks may run short first."""
        num_running = len(self.running)
        room = max(self.max_num_batched_tokens - num_running, 0)
        seats = self.max_num_seqs - num_running
        tokens, admitted = running_prefill, 0
        for req in self.waiting:  # only those that can be admitted: the queue may be long
            if tokens >= room or admitted >= seats:
                break
            if self._waits_for_prompt(req):
                continue
            cached = len(self._find_prefix(req).block_ids) * self.kv.block_size
            tokens += req.num_tokens - cached
            admitted += 1
        return min(tokens, room), admitted

    def _max_drafts(self, req: Request) -> int:
        """Drafts past the request's last possible token would be wasted work: k accepted
        drafts plus the bonus token must fit max_model_len and max_tokens."""
        room = self.max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        if self.long_rope_from is not None and not req.long_rope:
            # A short-mode row must sit below the original length: a draft at position L
            # would be verified in the wrong mode.
            room = min(room, self.long_rope_from - req.num_tokens)
        return max(room, 0)

    def _allocate_or_preempt(self, req: Request, num_new: int,
                             scheduled: list[ScheduledRequest], preempted: list[str]) -> bool:
        """Allocate ``req``'s slots, preempting the newest request not yet planned this step
        (possibly ``req`` itself) until they fit."""
        if self.kv.allocate_slots(req.req_id, req.num_computed_tokens + num_new):
            return True
        planned = {s.req_id for s in scheduled}
        while not self.kv.allocate_slots(req.req_id, req.num_computed_tokens + num_new):
            victim = next(r for r in reversed(self.running) if r.req_id not in planned)
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, restart: bool = False) -> None:
        """Back to the front of the waiting queue, to be recomputed. ``restart``: not for
        want of blocks, but to recompute it in LongRoPE's long mode."""
        self.running.remove(req)
        self._log_running(req, False)
        if self.kv.holds(req.req_id):
            self.kv.free(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        if restart:
            self.num_rope_restarts += 1
        else:
            self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _plan(self, req: Request, num_new: int, k: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        token_ids = req.all_token_ids[start:start + num_new]
        return ScheduledRequest(
            req_id=req.req_id, token_ids=token_ids, start_pos=start,
            block_table=list(self.kv.block_table(req.req_id)), params=req.params,
            sample=start + num_new == req.num_tokens, num_lookahead=k,
            prompt_logits=req.needs_prompt_logits and start < req.num_prompt_tokens - 1,
            long_rope=req.long_rope)

    # ------------------------------------------------------------------ after the forward
    def update(self, output: SchedulerOutput, result: StepResult) -> list[RequestUpdate]:
        """Apply a step's result: advance computed tokens, append accepted + bonus tokens,
        rewind KV past rejected drafts, hash the blocks the committed tokens filled, finish
        requests on token-level stop conditions.

        Returns an update for every request that sampled.
        """
        new_tokens = iter(result.new_token_ids)
        logprobs = iter(result.logprobs) if result.logprobs is not None else None
        updates: list[RequestUpdate] = []
        for planned in output.scheduled:
            req = self.requests.get(planned.req_id)
            sampled = next(new_tokens) if planned.sample else None
            sampled_logprobs = next(logprobs) if planned.sample and logprobs is not None else None
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            num_accepted = len(sampled) - 1 if sampled else 0
            req.num_computed_tokens = planned.start_pos + len(planned.token_ids) + num_accepted
            if planned.num_lookahead:  # rollback: free blocks wholly past the accepted length
                self.kv.truncate(req.req_id, req.num_computed_tokens)
            if sampled is None:
                self.kv.commit(req.req_id, req.all_token_ids, req.num_computed_tokens,
                               self._cache_root(req.long_rope))
                continue
            appended, reason = self._append(req, sampled)
            if req.logprobs is not None and sampled_logprobs is not None:
                req.logprobs += sampled_logprobs[:len(appended)]
            # Accepted drafts are committed; the bonus token is not computed yet.
            self.kv.commit(req.req_id, req.all_token_ids, req.num_computed_tokens,
                           self._cache_root(req.long_rope))
            if reason is not None:
                self.finish_request(req.req_id, reason)
            updates.append(RequestUpdate(req, appended, len(planned.draft_token_ids), num_accepted,
                                         planned.num_lookahead))
        return updates

    def _append(self, req: Request, token_ids: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append tokens up to the first that stops the request; returns them and why it stops."""
        appended: list[int] = []
        for token_id in token_ids:
            req.all_token_ids.append(token_id)
            appended.append(token_id)
            reason = self._stop_reason(req, token_id)
            if reason is not None:
                return appended, reason
        return appended, None

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        if token_id in req.stop_token_ids:
            return FinishReason.STOP
        max_tokens = req.params.max_tokens
        if max_tokens is not None and req.num_output_tokens >= max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _release(self, req: Request, reason: FinishReason) -> None:
        if self.kv.holds(req.req_id):
            self.kv.free(req.req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

