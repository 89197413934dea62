"""Drafting with a model: an independent draft checkpoint, or the target's own first layers.

Both run the same loop over the ragged batch: one forward that catches each drafting
request up on the tokens its draft cache has not seen yet and yields the first proposal,
then one single-token forward per further proposal, all drafting requests together.

The proposals never leave the device while drafting: each step's tokens are the next
step's inputs, scattered into its input buffer on the device (their positions and slots
depend only on k, so the host plans every step without waiting). The speculator hands the
tokens to the target's verify pass the same way, and the rejection sampler brings them
back with its one copy: a step with a draft model synchronises once. With CUDA graphs
the single-token steps and the catch-up (one token, or two after a fully accepted draft)
are graph replays.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from itertools import accumulate

import torch

from specserve.batch import DeviceTokenIds
from specserve.cuda_graphs import stream_of_its_own
from specserve.logits_process import LogitsProcess
from specserve.model_runner import ModelRunner, kv_bytes_per_block
from specserve.models.rotary import position_limit
from specserve.request import Request
from specserve.sampler import (SamplingMetadata, Uniforms, greedy_confidence, greedy_tokens, sample_from_probs,
                               target_probs, token_probability)
from specserve.scheduler import ScheduledRequest, SchedulerOutput
from specserve.spec.drafter import DraftProposal
from specserve.spec.paths import DRAFT_FORKS, PathEntry
from specserve.spec.stopping import DraftStop, StopRule
from specserve.spec.tree import TREE_RANKS, grows
from specserve.transfer import to_device

# A lazy catch-up longer than this many tokens (a prompt) feeds all but its last token
# in a pass of its own (``ModelDrafter.catch_up_lazily``).
LAZY_APART = 16


class ModelDrafter:
    """Proposes tokens by running a model autoregressively over the paged cache.

    With ``shares_target_cache`` (layer-skip) the draft is the target's first
    ``num_layers`` layers: it reads and writes the target's own cache for those layers,
    whose entries for computed tokens are exactly what the draft would compute, so it
    holds no memory of its own and only ever feeds the pending token. Otherwise (a draft
    checkpoint) it owns a cache with the same block ids as the target's, prefills in
    lockstep with the target's prefill chunks (or, ``catch_up_lazily``, when a request
    first drafts) and tracks how far its cache is valid; after a rollback that length is
    clamped to the target's accepted length.
    """

    needs_every_step = True  # it prefills in lockstep, or takes note of what an admission's cache holds
    feeds_after_target = True  # its own cache's catch-up reads only the step's tokens
    max_paths = 1 + len(DRAFT_FORKS)
    confidence = True  # q at every depth: drafting stops by it (``spec.stopping``)
    grows_trees = False  # set by the speculator: report runner-up candidates (``spec.tree``)
    fixed_trees = False  # and leave them on the device, for a tree of fixed shape (``DraftTrees.grow_fixed``)
    can_grow_trees = True  # it can (``propose`` reports candidates)
    expands_trees = True   # and ``expand`` reads nodes

    def __init__(self, name: str, model, config, device: torch.device, dtype: torch.dtype,
                 num_layers: int | None = None, shares_target_cache: bool = False) -> None:
        self.name = name
        self.model = model
        self.config = config
        self.device, self.dtype = device, dtype
        self.num_layers = num_layers
        self.shares_target_cache = shares_target_cache
        self.uniforms = Uniforms(config.seed)
        self.runner: ModelRunner | None = None
        self._fed: dict[str, int] = {}   # draft-cache length per request (own cache only)
        # Cached blocks: the draft's own cache catches up from where its entries are valid.
        self.draft_cache = None if shares_target_cache else "tokens"
        self.last_catch_up_s = 0.0
        self.last_backlog_s = 0.0  # the lazy catch-up's pass of its own (``catch_up_lazily``)
        self.lazy_from = math.inf  # steps of this many requests or more feed lazily (``catch_up_lazily``)
        self._tree_rng: torch.Generator | None = None  # a sampling request's tree candidates
        # ``feed``'s CUDA stream, and whether work on it may still be running (``_join``).
        self.own_stream = True  # False: ``feed`` runs on the target's stream (kept for A/B runs)
        # A catch-up that feeds exactly the target's step replays on the target's inputs
        # (``_catch_up_pass``): a step without drafts then costs about what an unfed one
        # does (benchmarks/results/per_token_drafting/plain_steps_2026-12-06/). Off, the
        # old goodput check let more drafts through; beside the plain regime's check it
        # is on (plain_regime_2026-12-06; not measured apart from that change).
        self.shares_target_inputs = True
        self.target_runner: ModelRunner | None = None
        self._stream: torch.cuda.Stream | None = None
        self._behind = False

    # ------------------------------------------------------------------ set-up
    def kv_bytes_per_block(self) -> int:
        if self.shares_target_cache:
            return 0
        return kv_bytes_per_block(self.model, self.config.block_size, self.dtype)

    def bind(self, target_runner: ModelRunner) -> None:
        self.target_runner = target_runner
        if self.shares_target_cache:
            self.runner = target_runner
        else:
            self.runner = ModelRunner(self.model, self.config, self.device, self.dtype,
                                      num_blocks=target_runner.num_blocks)

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Graphs for the draft checkpoint's steps: its single-token draft steps and its
        catch-up, which feeds at most two tokens per request once the prompt is in (the
        pending token, after a step that accepted every draft also the last draft). The
        layer-skip draft runs a prefix of the target's layers and stays eager."""
        if not self.shares_target_cache:
            self.runner.enable_graphs(2, max_model_len, capture)

    @property
    def max_positions(self) -> int | None:
        return position_limit(self.model.config)[0]

    def free(self, req_id: str) -> None:
        self._fed.pop(req_id, None)
        self.uniforms.free(req_id)

    def close(self) -> None:
        if self._behind:
            self._stream.synchronize()  # its cache may still be written there
            self._behind = False
        if self.runner is not None and not self.shares_target_cache:
            self.runner.close()  # its own cache (the shared one is the target runner's)
        target_graphs = self.target_runner.graphs if self.target_runner is not None else None
        if target_graphs is not None:  # the target no longer keeps its inputs for it
            target_graphs.share_inputs, target_graphs.last_inputs = 0, None
        self.runner = self.model = None

    def follow_settled(self, verified: list, settled: list) -> None:
        """The target's last pass over ``verified`` now reads as ``settled`` (a draft
        tree replaced by its path, ``spec.tree``); nothing to do for a draft model."""

    def rewind(self, req_id: str, num_tokens: int) -> None:
        """The own cache's entries from position ``num_tokens`` on are no longer the
        request's (a draft tree's path left the chain there): they are fed again."""
        if req_id in self._fed:
            self._fed[req_id] = min(self._fed[req_id], num_tokens)

    def cached_tokens(self, req_id: str) -> int:
        """Positions of ``req_id`` whose entries the drafter's own cache holds (drafted ones
        included until the next step clamps them to what the target accepted)."""
        return self._fed.get(req_id, 0)

    def describe(self) -> str:
        if self.shares_target_cache:
            return f"layerskip (first {self.num_layers} target layers + norm + LM head)"
        cfg = self.model.config
        params = self.model.num_parameters / 1e6
        if self.name == "quantized":
            formats = sorted({f for m in self.model.modules() for f in getattr(m, "formats", ())})
            return f"quantized (the target's weights in {'+'.join(formats)}, {params:.0f}M parameters)"
        shared = " + the target's embeddings and LM head" if self.model.shared_modules else ""
        formats = sorted({f for m in self.model.model.layers.modules() for f in getattr(m, "formats", ())})
        layers = f" in {'+'.join(formats)}" if formats else ""
        return (f"draft_model ({cfg.architectures[0]}, {cfg.num_hidden_layers} layers{layers}, "
                f"{params:.0f}M parameters{shared}{self._among()})")

    def _among(self) -> str:
        vocab = self.model.vocab_ids
        return "" if vocab is None else f", drafting among its {len(vocab)} most written tokens"

    @property
    def first_draft_in_catch_up(self) -> bool:
        """Whether a draft depth D costs D - 1 passes after the catch-up's: unless every
        step feeds lazily. Where small steps keep up in lockstep and large ones feed
        lazily (``catch_up_lazily`` from more than one request), a large step's first
        draft pass is its drafting requests' catch-up, priced as the lockstep catch-up of
        a step with drafts is on a GPU: by the draft cost model's terms per drafting step
        and request."""
        return self.lazy_from > 1

    def catch_up_lazily(self, from_requests: float = 1) -> bool:
        """From now on, in a step of at least ``from_requests`` requests, leave a request
        that does not draft unfed, its prompt chunks included: its cache catches up when
        it next drafts, so such a step that drafts nothing runs no draft pass, a request
        that never drafts (a veto, a workload where drafting does not pay) costs the draft
        nothing, and the catch-up is a draft pass, not a fixed cost of every step. A
        catch-up longer than ``LAZY_APART`` tokens (a prompt, or the tokens of many steps
        without drafts) feeds all but its last token in a pass of its own, timed apart
        (``last_backlog_s``): what starting to draft costs once. A smaller step feeds
        every request in lockstep, a backlog included. (From 1 where drafting stops by
        confidence, which then prices every pass it runs. A GPU's default stops by the
        plan and feeds every step in lockstep: fed lazily from 8 requests on, code-edit
        under load ran slower on an H100,
        ``benchmarks/results/per_token_drafting/by_batch_2026-12-07/``.)"""
        self.lazy_from = from_requests
        return True

    def time_pass(self, scheduled: list[ScheduledRequest], passes: int = 4) -> float | None:
        """Seconds a draft pass over ``scheduled`` (a token each, over their blocks) adds to
        a step: the start-up profile of what a draft depth costs. ``passes`` passes run
        as a step's do, each fed the last one's tokens on the device and one wait at the
        end, less one pass alone, over the passes added: on a GPU a pass alone waits for
        the device, which the passes of a step do not (the host prepares the next while
        the device runs the last), so timed alone it counts the device's time besides what
        it adds. Its positions run from each request's ``start_pos`` on: ``passes`` slots."""
        def run(count: int) -> float:
            start = time.perf_counter()
            tokens = None
            for j in range(count):
                step = [ScheduledRequest(p.req_id, [0], p.start_pos + j, p.block_table, p.params) for p in scheduled]
                tokens = greedy_tokens(self._forward(step, None if tokens is None else
                                                     DeviceTokenIds(tokens, [1] * len(step))))
            tokens.tolist()
            return time.perf_counter() - start

        if passes < 2:
            return run(1)
        alone = run(1)
        return max(run(passes) - alone, 0.0) / (passes - 1)

    # ------------------------------------------------------------------ the step
    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        self._join()
        if not self.shares_target_cache:  # the shared cache is the target runner's, copied there
            self.runner.copy_blocks(block_copies)

    def propose(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
                stop: StopRule | None = None) -> DraftProposal:
        began = time.perf_counter()
        entries, drafting, ends, fed_before, backlog = [], [], {}, {}, []
        lazy = len(scheduled) >= self.lazy_from
        for i, planned in enumerate(scheduled):
            k = planned.num_lookahead
            if k == 0 and self.shares_target_cache:
                continue  # nothing to keep up with: the target fills the shared cache
            req_id = planned.req_id
            end = planned.start_pos + len(planned.token_ids)
            if planned.draft_cache_valid is not None:  # admitted: its cached blocks' entries
                self._fed[req_id] = planned.draft_cache_valid
            if k == 0 and lazy:
                # A prompt chunk, or decoding without drafts: its cache catches up when it
                # next drafts (the entries past this step's start may be rejected drafts':
                # not valid).
                self._fed[req_id] = min(self._fed.get(req_id, 0), planned.start_pos)
                continue
            # A request's further draft paths catch up from where the request's own does.
            fed = planned.start_pos if self.shares_target_cache else fed_before.setdefault(
                req_id, min(self._fed.get(req_id, 0), planned.start_pos))
            tokens = requests[req_id].all_token_ids[fed:end]
            if k and len(tokens) > LAZY_APART:
                # A long catch-up (its prompt at a request's first drafts, or the tokens of
                # the lazy steps it did not draft): all but the last token in a pass of
                # their own, the step's cost rather than drafting's.
                backlog.append(ScheduledRequest(req_id, tokens[:-1], fed, planned.block_table, planned.params,
                                                sample=False, long_rope=planned.long_rope))
                fed, tokens = end - 1, tokens[-1:]
            entries.append((i, ScheduledRequest(req_id, tokens, fed, planned.block_table,
                                                planned.params, sample=k > 0, long_rope=planned.long_rope)))
            if not self.shares_target_cache:
                self._fed[req_id] = end
            if k:
                drafting.append(i)
                ends[i] = end
        self.last_backlog_s = 0.0
        if not drafting:
            if entries:
                self._catch_up_pass(scheduled, [e for _, e in entries])
            self.last_catch_up_s = time.perf_counter() - began
            return DraftProposal([[] for _ in scheduled])
        # Longest k first, so the requests still drafting at step j are always a prefix
        # and each step's inputs are a slice of the previous step's outputs. The catch-up
        # batch puts them first, in that order, so its logits rows are in it too.
        order = sorted(drafting, key=lambda i: -scheduled[i].num_lookahead)
        rank = {i: r for r, i in enumerate(order)}
        if backlog:
            # Long catch-ups are a cost of starting to draft, not of this step's drafts:
            # their own pass, timed apart; the drafting requests' last tokens are their
            # first draft pass.
            self._forward(backlog)
        backlog_s = time.perf_counter() - began if backlog else 0.0
        self.last_backlog_s = backlog_s
        entries.sort(key=lambda e: rank.get(e[0], len(order)))
        active = [scheduled[i] for i in order]
        meta = None
        if any(not p.params.greedy for p in active):
            meta = SamplingMetadata.build([p.params for p in active], self.device)
        # Further draft paths take their fork's candidate at its depth (None: the best everywhere).
        forks = [p.fork if isinstance(p, PathEntry) else None for p in active]
        forking = any(forks)
        logits = self._forward([e for _, e in entries])
        # Lazily, the catch-up is the first draft pass; else every request's catch-up runs
        # whatever k is (it yields the first proposals too): the cost of drafting is what
        # comes after it.
        self.last_catch_up_s = backlog_s if lazy else time.perf_counter() - began
        # Penalties, a grammar and the like process q from the same history as the target's p.
        process = LogitsProcess.for_drafting([requests[p.req_id].history(ends[i]) for i, p in zip(order, active)],
                                             [p.params for p in active], logits.shape[1], self.device,
                                             [requests[p.req_id].grammar for p in active])
        # A draft tree grows from its greedy rows' runner-up candidates (spec/tree.py).
        ranks = TREE_RANKS if self.grows_trees and not forking else 0
        # Where the stopping rule judges each row and nothing else follows the rows'
        # order (no logits processing, no tree), a pass runs only the rows still drafting
        # (``passes_rows``: each pass's rows, as ranks in ``order``), as the rule prices
        # it; else the rows up to the last one still drafting, a prefix, as the rows
        # were sorted for.
        compact = stop is not None and not forking and process is None and not ranks
        session = None if stop is None or forking else stop.begin(active, compact)
        tokens, q, confidence, top = self._choose(logits, active, [ends[i] for i in order], meta,
                                                  forks if forking else None, 0, process, session is not None,
                                                  ranks)
        columns, q_columns, tops = [tokens], [q], [top]
        n = len(active)
        everyone, alive = active, list(range(n))
        passes_rows = [alive] if compact else None
        for j in range(1, active[0].num_lookahead):
            if session is None:
                n = sum(p.num_lookahead > j for p in active)
            else:
                n = session.after(j - 1, _by_rank(confidence, alive) if compact else confidence[:n].tolist())
            if n == 0:
                break
            alive, active, rows_meta, pick = _next_rows(session.running if compact else None, n, alive, everyone,
                                                        meta, self.device)
            n, inputs = len(alive), pick(tokens)
            if compact:
                passes_rows.append(alive)
            if process is not None:
                process = process.head(n)
                process.advance(inputs)
            # Feed the step-(j-1) proposal d_j at position end + j - 1; its id is on the device.
            step = [ScheduledRequest(p.req_id, [0], ends[order[r]] + j - 1, p.block_table, p.params,
                                     long_rope=p.long_rope) for r, p in zip(alive, active)]
            logits = self._forward(step, DeviceTokenIds(inputs, [1] * n))
            tokens, q, confidence, top = self._choose(logits, active, [ends[order[r]] + j for r in alive],
                                                      rows_meta, forks[:n] if forking else None, j,
                                                      process, session is not None, ranks)
            columns.append(tokens)
            q_columns.append(q)
            tops.append(top)
            if not self.shares_target_cache:
                for p, fork in zip(active, forks):
                    if fork is None:  # a request's paths feed the same positions
                        self._fed[p.req_id] += 1
        proposal = self._proposal(scheduled, order, columns, q_columns, session, confidence, n, passes_rows)
        if ranks:
            self._tree_material(proposal, scheduled, order, tops)
        return proposal

    def expand(self, entries: list[ScheduledRequest]) -> tuple[list[list[int]], list[list[float]]]:
        """One draft pass over draft tree nodes (``spec.tree``: each entry's fed tokens at
        their positions, with their visibility masks): for each node, its ``TREE_RANKS`` + 1
        likeliest next tokens and their probabilities under q (raw logits: a tree grows for
        greedy requests), on the host."""
        indices, probs = _likeliest(self._forward(entries), TREE_RANKS + 1)
        return indices.tolist(), probs.tolist()

    def _proposal(self, scheduled, order, columns, q_columns, session: DraftStop | None,
                  confidence: torch.Tensor | None, n: int, passes_rows: list[list[int]] | None = None) -> DraftProposal:
        """The step's proposals: every planned draft, or with ``session`` the ones its
        stopping rule kept (its last pass's ``n`` rows' ``confidence`` judged first).
        ``passes_rows``: each pass's rows as ranks in ``order`` (None: a prefix of it)."""
        if session is None:
            draft_ids, draft_probs = self._in_schedule_order(scheduled, order, columns, q_columns)
            return DraftProposal([[0] * p.num_lookahead for p in scheduled], draft_probs, draft_ids)
        if session.judged < len(columns):  # the last pass's tokens are still to be judged
            session.after(len(columns) - 1, confidence[:n].tolist() if passes_rows is None else
                          _by_rank(confidence, passes_rows[-1]))
        rank = {i: r for r, i in enumerate(order)}
        lengths = [session.kept[rank[i]] if i in rank else 0 for i in range(len(scheduled))]
        draft_ids, draft_probs = self._in_schedule_order(scheduled, order, columns, q_columns, lengths, passes_rows)
        dropped: list[tuple[int, int, float] | None] = [None] * len(scheduled)
        depths = {miss[0] for miss in session.dropped if miss is not None}
        if depths:  # their tokens, from the device (a CPU's, where drafting stops by confidence)
            tokens = {d: columns[d].tolist() for d in depths}
            for r, miss in enumerate(session.dropped):
                if miss is not None:
                    at = r if passes_rows is None else passes_rows[miss[0]].index(r)
                    dropped[order[r]] = (miss[0], tokens[miss[0]][at], miss[1])
        return DraftProposal([[0] * k for k in lengths], draft_probs, draft_ids,
                             [session.confidence[rank[i]] if i in rank else [] for i in range(len(scheduled))],
                             session.pass_rows, dropped, goodput=session.gain / session.time)

    def _tree_material(self, proposal: DraftProposal, scheduled, order, tops) -> None:
        """What a draft tree grows from: with ``fixed_trees`` (a tree of fixed shape,
        ``DraftTrees.grow_fixed``) each pass's likeliest tokens left on the device
        (``DraftProposal.leaves``), else the candidates on the host (``_add_candidates``)."""
        if not self.fixed_trees:
            self._add_candidates(proposal, scheduled, order, tops)
            return
        if all(isinstance(t, torch.Tensor) for t in tops):  # tokens only: a fixed tree needs no chances
            tokens = (torch.cat(tops) if len(tops) > 1 else tops[0]).topk(TREE_RANKS + 1, dim=-1).indices
        else:  # (sampling rows beside: every pass ranked already; their rows grow no fixed tree)
            tokens = torch.cat([t[0] for t in tops])
        proposal.leaves = (tokens, _pass_firsts(tops)[:-1], {i: r for r, i in enumerate(order)})

    def _add_candidates(self, proposal: DraftProposal, scheduled, order, tops) -> None:
        """A draft tree's material, in two copies to the host: the proposals themselves, and
        for each row that may grow a tree (``spec.tree.grows``), per depth it kept, its
        ``TREE_RANKS`` + 1 candidates and their probabilities under q: a greedy row's
        likeliest tokens, a sampling row's drawn token and more drawn without replacement
        (``DraftProposal.candidates``). ``tops``: each pass's candidates from ``_choose``,
        or where it left them to this point, its rows of logits: those of every pass are
        ranked in one go (each op has a cost of its own, a GPU's host's most of all)."""
        counts = [len(d) for d in proposal.draft_token_ids]
        firsts = _pass_firsts(tops)
        if all(isinstance(t, torch.Tensor) for t in tops):
            tokens_t, probs_t = _likeliest(torch.cat(tops) if len(tops) > 1 else tops[0], TREE_RANKS + 1)
        else:
            tops = [_likeliest(t, TREE_RANKS + 1) if isinstance(t, torch.Tensor) else t for t in tops]
            tokens_t, probs_t = torch.cat([t for t, _ in tops]), torch.cat([p for _, p in tops])
        num_ids = proposal.draft_ids.shape[0]
        ints = torch.cat([proposal.draft_ids.to(tokens_t.dtype), tokens_t.flatten()]).tolist()
        ids, flat_tokens = ints[:num_ids], ints[num_ids:]
        flat_probs = probs_t.flatten().tolist()
        width = TREE_RANKS + 1
        proposal.draft_token_ids, start = [], 0
        for count in counts:
            proposal.draft_token_ids.append(ids[start:start + count])
            start += count
        proposal.draft_ids = None
        proposal.candidates = [[] for _ in scheduled]
        for r, i in enumerate(order):
            if not grows(scheduled[i].params):
                continue
            at = [(firsts[j] + r) * width for j in range(counts[i])]
            proposal.candidates[i] = [(flat_tokens[a:a + width], flat_probs[a:a + width]) for a in at]

    def _in_schedule_order(self, scheduled, order, columns, q_columns, lengths: list[int] | None = None,
                           passes_rows: list[list[int]] | None = None):
        """Proposals ``[Σ k_i]`` (and q rows ``[Σ k_i, vocab]``) request by request in
        schedule order, from the per-step ``columns`` over (a prefix of) ``order``, the
        drafting entries' indices in ``scheduled``, or over each pass's ``passes_rows``
        (ranks in ``order``); ``lengths``: how many of its drafts each entry keeps (None: its k)."""
        sampled = q_columns[0] is not None
        if lengths is None:
            lengths = [p.num_lookahead for p in scheduled]
        if all(lengths[i] == len(columns) for i in order) and order == sorted(order):
            q = torch.stack(q_columns, dim=1).flatten(0, 1) if sampled else None
            return torch.stack(columns, dim=1).view(-1), q
        starts = [0, *accumulate(len(c) for c in columns)]
        rank = {i: r for r, i in enumerate(order)}
        at = None if passes_rows is None else [{r: p for p, r in enumerate(rows)} for rows in passes_rows]
        (index,) = to_device([[starts[j] + (rank[i] if at is None else at[j][rank[i]])
                               for i, k in enumerate(lengths) for j in range(k)]], torch.int64, self.device)
        q = torch.cat(q_columns).index_select(0, index) if sampled else None
        return torch.cat(columns).index_select(0, index), q

    def feed(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
             ready: torch.cuda.Event | None = None) -> None:
        """Feed a step in which no request drafts, its target pass under way
        (``feeds_after_target``): ``propose``'s catch-up. On a GPU its pass runs on a
        stream of its own, after ``ready`` (the work queued before the target's pass, its
        own earlier passes included) and beside the target's, so the step's wait for the
        target's tokens does not wait for it too; the next use of the drafter's cache or
        buffers waits for it first (``_join``), also after a pass that raised midway."""
        if self.device.type != "cuda" or not self.own_stream:
            self.propose(scheduled, requests)
            return
        if self._stream is None:
            self._stream = stream_of_its_own(self.device, self)  # (no graphs were captured on it)
        if ready is not None:
            self._stream.wait_event(ready)
        try:
            with torch.cuda.stream(self._stream):
                self.propose(scheduled, requests)
        finally:
            self._behind = True

    def _catch_up_pass(self, scheduled: list[ScheduledRequest], entries: list[ScheduledRequest]) -> None:
        """The draft pass of a step in which nobody drafts. Where it feeds exactly the
        target's step (each request its pending tokens or its prompt chunk, from where the
        target's pass starts, through the same block ids), the draft's graph replays on the target's
        inputs (``GraphRunner.replay_inputs_of``), which the host then built once for both
        (``shares_target_inputs``; the target keeps them from the first such step on)."""
        graphs = self.runner.graphs
        target = self.target_runner.graphs
        if (self.shares_target_inputs and graphs is not None and target is not None
                and len(entries) == len(scheduled)
                and all(e.start_pos == p.start_pos and len(e.token_ids) == len(p.token_ids)
                        and not p.draft_token_ids and not p.long_rope for e, p in zip(entries, scheduled))):
            if not target.share_inputs:
                target.share_inputs = graphs.max_query_len
            self._join()
            if graphs.replay_inputs_of(target, scheduled):
                return
        self._forward(entries)

    def _join(self) -> None:
        """The current stream waits for what ``feed`` left running on its own."""
        if self._behind:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._behind = False

    def _forward(self, entries: list[ScheduledRequest], device_ids: DeviceTokenIds | None = None) -> torch.Tensor:
        self._join()
        return self.runner.execute(SchedulerOutput(entries, []), self.num_layers, device_ids)

    def _choose(self, logits: torch.Tensor, active: list[ScheduledRequest], positions: list[int],
                meta: SamplingMetadata | None, forks: list | None = None, depth: int = 0,
                process: LogitsProcess | None = None, confident: bool = False, runner_ups: int = 0):
        """Each row's proposal, on the device ``[len(active)]``: greedy requests take the
        argmax (a row whose fork, ``forks[i]`` = (depth, rank), is at this ``depth`` its
        rank-th candidate; ``forks`` None: no row forks), sampling ones draw from q, which is returned too
        (``[len(active), vocab]``, else None) for the rejection sampler. ``positions``:
        the index of the token each row drafts, which keys its random number; ``meta``:
        the rows' sampling settings (None: all greedy); ``process``: their logits processing.
        With ``confident``, third: each row's confidence, the top probability of q (of
        its greedy distribution for a greedy row), else None. Fourth, with ``runner_ups``: each
        row's ``runner_ups`` + 1 likeliest tokens and their probabilities (of its greedy
        distribution: softmax of the processed logits), on the device, or where every row
        is greedy (``meta`` None) a copy of the processed logits to rank them from
        (``_add_candidates``); else None."""
        if process is not None:
            logits = process.apply(logits)
        # Greedy rows' candidates are ranked after the last pass, for every pass at once
        # (``_add_candidates``): this pass's logits are kept (a graph's next replay
        # overwrites its output).
        top = None if not runner_ups else _likeliest(logits, runner_ups + 1) if meta is not None else logits.clone()
        ranks = [] if forks is None else [fork[1] if fork and fork[0] == depth else 0 for fork in forks]
        confidence = None
        if confident and not any(ranks):
            greedy, confidence = greedy_confidence(logits)
        else:
            greedy = greedy_tokens(logits)
        if any(ranks):
            greedy = _runner_up(logits, greedy, ranks, self.device)
            if confident:  # the chosen token's probability, a runner-up's where a row forks
                confidence = token_probability(logits, greedy)
        if meta is None:
            return greedy, None, confidence, top
        q = target_probs(logits, meta)
        uniforms = [0.0 if p.params.greedy else
                    self.uniforms.at(p.req_id, p.params, range(pos, pos + 1), Uniforms.DRAFT)[0]
                    for p, pos in zip(active, positions)]
        (uniforms_t,) = to_device([uniforms], torch.float32, self.device)
        sampled = sample_from_probs(q, uniforms_t)
        if confident:
            confidence = torch.where(meta.temperature > 0, q.amax(dim=-1).float(), confidence)
        if top is not None:  # a sampling row's runner-ups: drawn from q without replacement
            top = self._without_replacement(q, sampled, runner_ups, top, meta.temperature > 0)
        return torch.where(meta.temperature > 0, sampled, greedy), q, confidence, top

    def _without_replacement(self, q: torch.Tensor, drawn: torch.Tensor, count: int, top, sampling: torch.Tensor):
        """For sampling rows, in ``top``'s place: the drawn token, then ``count`` more drawn
        from q without replacement (Gumbel top-k with the drawn token removed; a token q
        cannot draw comes with probability 0), and their probabilities under q."""
        if self._tree_rng is None:
            self._tree_rng = torch.Generator(device=q.device).manual_seed(self.config.seed)
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=self._tree_rng, device=q.device)
                                       .clamp_(1e-20, 1.0 - 1e-7)))
        keys = (q.float().log() + gumbel).scatter_(1, drawn[:, None], float("-inf"))
        others = keys.topk(count, dim=-1).indices
        tokens = torch.cat([drawn[:, None], others], dim=1)
        probs = q.float().gather(1, tokens)
        return (torch.where(sampling[:, None], tokens, top[0]), torch.where(sampling[:, None], probs, top[1]))


def _pass_firsts(tops: list) -> list[int]:
    """Each draft pass's first row among every pass's rows put together, and their count
    last (``tops``: per pass its kept logits, or its ranked candidates)."""
    return [0, *accumulate(t.shape[0] if isinstance(t, torch.Tensor) else t[0].shape[0] for t in tops)]


def _likeliest(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``count`` likeliest tokens and their probabilities (softmax of ``logits``):
    ranked by probability, two ops where ranking the logits and normalising their top
    values apart takes several (each op costs a GPU's host more than the device)."""
    values, indices = torch.softmax(logits.float(), dim=-1).topk(count, dim=-1)
    return indices, values


def _runner_up(logits: torch.Tensor, best: torch.Tensor, ranks: list[int], device: torch.device) -> torch.Tensor:
    """Each row's ``ranks[i]``-th likeliest token (0: ``best``, its argmax): the best ones
    masked out, argmax again (on a GPU a few cheap ops beat one ``topk`` over the vocabulary)."""
    chosen, masked, candidate = best, None, best
    (ranks_t,) = to_device([ranks], torch.int64, device)
    for rank in range(1, max(ranks) + 1):
        masked = logits.scatter(1, candidate[:, None], float("-inf")) if masked is None else \
            masked.scatter_(1, candidate[:, None], float("-inf"))
        candidate = masked.argmax(dim=-1)
        chosen = torch.where(ranks_t == rank, candidate, chosen)
    return chosen


def _next_rows(going: list[int] | None, n: int, alive: list[int], everyone: list, meta: SamplingMetadata | None,
               device: torch.device):
    """The rows a further draft pass runs, as ranks in the drafter's order: ``going`` (a
    compact pass: the rows still drafting, among the last pass's ``alive``), or None: the
    first ``n``. Returns them, their entries of ``everyone``, their sampling settings and
    a function that takes their rows of a tensor of the last pass's (its proposals, its
    features): a slice where they are its first rows, else a gather on the device."""
    if going is None:
        return list(range(n)), everyone[:n], meta and _head(meta, n), lambda rows: rows[:n]
    where = {r: p for p, r in enumerate(alive)}
    picks = [where[r] for r in going]
    settings = meta and _rows(meta, going)
    if picks == list(range(len(picks))):
        return going, [everyone[r] for r in going], settings, lambda rows: rows[:len(picks)]
    (index,) = to_device([picks], torch.int64, device)
    return going, [everyone[r] for r in going], settings, lambda rows: rows.index_select(0, index)


def _by_rank(confidence: torch.Tensor, rows: list[int]) -> list[float]:
    """A pass's confidences (one per row it ran, ``rows`` as ranks) as the stopping rule
    reads them, by rank: 0 for the rows it did not run (no longer drafting)."""
    values = confidence.tolist()
    out = [0.0] * (max(rows) + 1)
    for r, c in zip(rows, values):
        out[r] = c
    return out


def _rows(meta: SamplingMetadata, rows: list[int]) -> SamplingMetadata:
    """Those ``rows``' settings."""
    (index,) = to_device([rows], torch.int64, meta.temperature.device)
    return dataclasses.replace(meta, temperature=meta.temperature.index_select(0, index),
                               top_k=meta.top_k.index_select(0, index), top_p=meta.top_p.index_select(0, index),
                               min_p=meta.min_p.index_select(0, index))


def _head(meta: SamplingMetadata, n: int) -> SamplingMetadata:
    """The first ``n`` rows' settings."""
    return dataclasses.replace(meta, temperature=meta.temperature[:n], top_k=meta.top_k[:n],
                               top_p=meta.top_p[:n], min_p=meta.min_p[:n])
