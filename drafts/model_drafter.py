"""Drafting with a model: an independent draft checkpoint, or the target's own first layers.

Both run the same loop over the ragged batch: one forward that catches each drafting
request up on the tokens its draft cache has not seen yet and yields the first proposal,
then one single-token forward per further proposal, all drafting requests together.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from specserve.drafts.base import DraftProposal
from specserve.model_runner import ModelRunner, kv_bytes_per_block
from specserve.request import Request
from specserve.sampler import SamplingMetadata, Uniforms, sample_from_probs, target_probs
from specserve.scheduler import ScheduledRequest, SchedulerOutput

class ModelDrafter:
    """Proposes tokens by running a model autoregressively over the paged cache.

    With ``shares_target_cache`` (layer-skip) the draft is the target's first
    ``num_layers`` layers: it reads and writes the target's own cache for those layers,
    whose entries for computed tokens are exactly what the draft would compute, so it
    holds no memory of its own and only ever feeds the pending token. Otherwise (a draft
    checkpoint) it owns a cache with the same block ids as the target's, prefills in
    lockstep with the target's prefill chunks and tracks how far its cache is valid;
    after a rollback that length is clamped to the target's accepted length.
    """

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

    # ------------------------------------------------------------------ set-up
    def kv_bytes_per_block(self) -> int:
        if self.shares_target_cache:
            return 0
        return kv_bytes_per_block(self.model, self.config.block_size, self.dtype)

    def bind(self, target_runner: ModelRunner) -> None:
        if self.shares_target_cache:
            self.runner = target_runner
        else:
            self.runner = ModelRunner(self.model, self.config, self.device, self.dtype,
                                      num_blocks=target_runner.num_blocks)
            if target_runner.graphs is not None:  # its one-token steps replay graphs too
                self.runner.enable_graphs(1, target_runner.graphs.max_model_len)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def free(self, req_id: str) -> None:
        self._fed.pop(req_id, None)
        self.uniforms.free(req_id)

    def describe(self) -> str:
        if self.shares_target_cache:
            return f"layerskip (first {self.num_layers} target layers + norm + LM head)"
        cfg = self.model.config
        params = self.model.num_parameters / 1e6
        shared = " + the target's embeddings and LM head" if self.model.shared_modules else ""
        return (f"draft_model ({cfg.architectures[0]}, {cfg.num_hidden_layers} layers, "
                f"{params:.0f}M parameters{shared})")

    # ------------------------------------------------------------------ the step
    def propose(self, scheduled: list[ScheduledRequest],
                requests: Mapping[str, Request]) -> DraftProposal:
        entries, drafting, ends = [], [], {}
        for planned in scheduled:
            k = planned.num_lookahead
            if k == 0 and self.shares_target_cache:
                continue  # nothing to keep up with: the target fills the shared cache
            end = planned.start_pos + len(planned.token_ids)
            fed = planned.start_pos if self.shares_target_cache else min(
                self._fed.get(planned.req_id, 0), planned.start_pos)
            tokens = requests[planned.req_id].all_token_ids[fed:end]
            entries.append(ScheduledRequest(planned.req_id, tokens, fed, planned.block_table,
                                            planned.params, sample=k > 0))
            if not self.shares_target_cache:
                self._fed[planned.req_id] = end
            if k:
                drafting.append(planned)
                ends[planned.req_id] = end
        proposals: dict[str, list[int]] = {p.req_id: [] for p in drafting}
        q_rows: dict[str, list[torch.Tensor]] = {p.req_id: [] for p in drafting}
        need_q = any(not p.params.greedy for p in drafting)
        logits = self._forward(entries) if entries else None
        active = drafting
        while active:
            positions = [ends[p.req_id] + len(proposals[p.req_id]) for p in active]
            tokens, q = self._choose(logits, active, positions, need_q)
            for row, (planned, token) in enumerate(zip(active, tokens)):
                proposals[planned.req_id].append(token)
                if q is not None:
                    q_rows[planned.req_id].append(q[row])
            active = [p for p in active if len(proposals[p.req_id]) < p.num_lookahead]
            if not active:
                break
            step = [ScheduledRequest(p.req_id, [proposals[p.req_id][-1]],
                                     ends[p.req_id] + len(proposals[p.req_id]) - 1,
                                     p.block_table, p.params) for p in active]
            logits = self._forward(step)
            if not self.shares_target_cache:
                for p in active:
                    self._fed[p.req_id] += 1
        draft_ids = [proposals.get(p.req_id, []) for p in scheduled]
        draft_probs = None
        if need_q:
            draft_probs = torch.stack([row for p in scheduled for row in q_rows.get(p.req_id, [])])
        return DraftProposal(draft_ids, draft_probs)

    def _forward(self, entries: list[ScheduledRequest]) -> torch.Tensor:
        return self.runner.execute(SchedulerOutput(entries, []), self.num_layers)

    def _choose(self, logits: torch.Tensor, active: list[ScheduledRequest], positions: list[int],
                need_q: bool):
        """Greedy requests take the argmax; sampling ones draw from q, which is returned
        (``[len(active), vocab]``) for the rejection sampler. ``positions``: the index of
        the token each row drafts, which keys its random number."""
        greedy = logits.argmax(dim=-1)
        if not need_q:
            return greedy.tolist(), None
        meta = SamplingMetadata.build([p.params for p in active], logits.device)
        q = target_probs(logits, meta)
        uniforms = [0.0 if p.params.greedy else
                    self.uniforms.at(p.req_id, p.params, range(pos, pos + 1), Uniforms.DRAFT)[0]
                    for p, pos in zip(active, positions)]
        sampled = sample_from_probs(q, torch.tensor(uniforms, device=logits.device))
        tokens = torch.where(meta.temperature > 0, sampled, greedy)
        return tokens.tolist(), q
