"""Drafting with Medusa heads (``models/medusa.py``): every proposal of a step from one
hidden state, with no cache and no pass of its own beyond the heads.

A request computed up to position s (its pending token x_s sampled from the target's
logits at s - 1) drafts d_{i+1} = head i (h_{s-1}), the target's final hidden state at s - 1,
for i < k. That row comes from the target's last pass (``ModelRunner.keep_hidden``): the
verify pass of the step before (s - 1 is its last accepted position), or the last prompt
chunk. A request the last pass did not compute there (just admitted, say) drafts nothing
this step. The heads do not see each other's proposals, so head i's q does not depend on
the earlier drafts; rejection sampling needs only that each draft was drawn from the q it
is checked against, so verification stays exact. One chain per request: Medusa's tree of
candidates (its ``medusa_choices``) is not run.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from specserve.drafts.model_drafter import ModelDrafter, _head
from specserve.logits_process import LogitsProcess
from specserve.model_runner import ModelRunner
from specserve.request import Request
from specserve.sampler import SamplingMetadata
from specserve.scheduler import ScheduledRequest
from specserve.spec.drafter import DraftProposal
from specserve.spec.stopping import StopRule
from specserve.transfer import to_device


class MedusaDrafter(ModelDrafter):
    needs_every_step = False  # it reads the target's last pass, whichever step ran it
    feeds_after_target = False  # (never fed in a step without drafts)
    confidence = False  # its drafts come from one pass: nothing to stop between
    max_paths = 1
    can_grow_trees = False

    def __init__(self, heads, config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__("draft_model", heads, config, device, dtype)
        self.draft_cache = None  # no cache of its own
        self.lazy_from = 0
        self.target_runner: ModelRunner | None = None

    def kv_bytes_per_block(self) -> int:
        return 0

    def bind(self, target_runner: ModelRunner) -> None:
        self.target_runner = target_runner
        target_runner.keep_hidden = True

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Nothing: the heads run eagerly, a few matrix products a step."""

    @property
    def max_positions(self) -> int | None:
        return None

    @property
    def first_draft_in_catch_up(self) -> bool:
        return False

    def catch_up_lazily(self, from_requests: float = 1) -> bool:
        return False

    def time_pass(self, scheduled: list[ScheduledRequest], passes: int = 4) -> float | None:
        return None

    def close(self) -> None:
        self.target_runner = self.model = None

    def describe(self) -> str:
        params = sum(p.numel() for p in self.model.parameters()) / 1e6
        return (f"draft_model (Medusa: {self.model.num_heads} heads of {self.model.num_layers} block(s) over the "
                f"target's final hidden state, {params:.0f}M parameters; one chain, at most "
                f"{self.model.num_heads} drafts)")

    def _last_rows(self, drafting: list[ScheduledRequest]) -> list[int | None]:
        """Each drafting request's row of position s - 1 in the target's last pass, or None."""
        runner = self.target_runner
        if runner.last_pass is None or runner.last_hidden is None:
            return [None] * len(drafting)
        where, row = {}, 0
        for planned in runner.last_pass:
            n = len(planned.token_ids) + len(planned.draft_token_ids)
            where[planned.req_id] = (planned.start_pos, row, n)
            row += n
        rows = []
        for planned in drafting:
            first, offset, n = where.get(planned.req_id, (0, 0, 0))
            rows.append(offset + planned.start_pos - 1 - first if first <= planned.start_pos - 1 < first + n
                        else None)
        return rows

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
                stop: StopRule | None = None) -> DraftProposal:
        drafting = [i for i, p in enumerate(scheduled) if p.num_lookahead]
        rows = dict(zip(drafting, self._last_rows([scheduled[i] for i in drafting])))
        drafting = [i for i in drafting if rows[i] is not None]
        if not drafting:
            return DraftProposal([[] for _ in scheduled])
        # Longest k first, as the model drafters: head j's rows are a prefix of head j-1's.
        heads = self.model.num_heads
        order = sorted(drafting, key=lambda i: -scheduled[i].num_lookahead)
        active = [scheduled[i] for i in order]
        lengths = [min(p.num_lookahead, heads) for p in active]
        (index,) = to_device([[rows[i] for i in order]], torch.int64, self.device)
        hidden = self.target_runner.last_hidden.index_select(0, index).to(self.dtype)
        ends = [p.start_pos + len(p.token_ids) for p in active]
        meta = None
        if any(not p.params.greedy for p in active):
            meta = SamplingMetadata.build([p.params for p in active], self.device)
        process = LogitsProcess.for_drafting([requests[p.req_id].history(end) for p, end in zip(active, ends)],
                                             [p.params for p in active], self.model.lm_heads[0].out_features,
                                             self.device, [requests[p.req_id].grammar for p in active])
        columns, q_columns, tokens = [], [], None
        for j in range(lengths[0]):
            n = sum(k > j for k in lengths)
            if j and process is not None:
                process = process.head(n)
                process.advance(tokens[:n])
            logits = self.model(hidden[:n], j)
            tokens, q, _, _ = self._choose(logits, active[:n], [end + j for end in ends[:n]],
                                        meta and _head(meta, n), process=process)
            columns.append(tokens)
            q_columns.append(q)
        kept = dict(zip(order, lengths))
        lengths_all = [kept.get(i, 0) for i in range(len(scheduled))]
        draft_ids, draft_probs = self._in_schedule_order(scheduled, order, columns, q_columns, lengths_all)
        return DraftProposal([[0] * k for k in lengths_all], draft_probs, draft_ids)
