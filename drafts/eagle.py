"""Drafting with an EAGLE-style head (``models/eagle.py``): a layer or a few that read the
target's final hidden states.

The head's cache entry at position j pairs the target's hidden state h_j with token
x_{j+1}; its output there predicts x_{j+2}. The head runs before the target in a step, so
it only ever has the features of positions the target computed in earlier passes: the
target runner keeps each pass's hidden states (``ModelRunner.keep_hidden``), and at the
next step the drafter takes each request's rows of that pass — its prefill chunk's, or its
verify span's, of which the accepted part is exactly what it needs.

A request computed up to position s (its pending token x_s not yet in the cache) has head
entries up to s - 1 once caught up: the catch-up forward feeds the entries from where the
head's cache is valid to s - 1, for every scheduled request (prefill chunks too, one step
behind the target), and its last row gives a drafting request's first proposal d_1. Each
further draft step feeds the previous proposal at the next position with the head's own
output as its feature. Those entries (s … s + k - 2) are never counted as valid: after
verification the next catch-up rewrites them from the target's features, so rollback is
the same clamp as a draft model's, and blocks are the target's (same ids).

Like the draft model it never waits for its own proposals (they stay on the device). The
target's CUDA graphs hand back the hidden states with the logits; the head's own passes are
graph replays too, their feature rows copied into the graph's buffer (an EAGLE-3 head's
``fc`` fuses the target's rows first, so every pass reads rows of the head's width).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from itertools import accumulate

import torch

from specserve.batch import DeviceTokenIds
from specserve.drafts.model_drafter import ModelDrafter, _by_rank, _next_rows
from specserve.logits_process import LogitsProcess
from specserve.model_runner import ModelRunner
from specserve.request import Request
from specserve.sampler import SamplingMetadata
from specserve.scheduler import ScheduledRequest, SchedulerOutput
from specserve.spec.drafter import DraftProposal
from specserve.spec.stopping import StopRule
from specserve.spec.tree import TREE_RANKS
from specserve.transfer import to_device


class EagleDrafter(ModelDrafter):
    needs_every_step = True  # the head's cache follows every pass of the target
    feeds_after_target = False  # it is fed the features of the target's last pass
    first_draft_in_catch_up = True  # (its features are the target's of that step)

    def catch_up_lazily(self, from_requests: float = 1) -> bool:
        return False  # its entries need the target's features of every step
    max_paths = 1  # its features follow each request's pass by request id
    # A tree of runner-ups (``spec.tree``), its features following the path that settles
    # it (``follow_settled``); not expanded (a pass over nodes needs their features).
    expands_trees = False

    def __init__(self, model, config, device: torch.device, dtype: torch.dtype,
                 feature_layers: tuple[int, ...] | None = None) -> None:
        super().__init__("draft_model", model, config, device, dtype)
        # The target layers an EAGLE-3 head reads (None: the final hidden states), and the
        # width of the target's rows it is fed.
        self.feature_layers = feature_layers
        self.feature_width = getattr(model, "feature_width", model.config.hidden_size)
        self.draft_cache = "features"  # its entries need the target's hidden states
        self._seen: list | None = None  # the scheduled list of the last step proposed for
        # req_id -> (first position, [n, hidden] target hidden states of positions first …)
        self._features: dict[str, tuple[int, torch.Tensor]] = {}

    def bind(self, target_runner: ModelRunner) -> None:
        super().bind(target_runner)
        target_runner.keep_hidden = True
        target_runner.model.feature_layers = self.feature_layers  # before any graph captures them
        self.runner.keep_hidden = True

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Graphs for the head's passes: its draft steps (one token each) and its catch-up,
        which feeds at most 1 + k tokens per request once the prompt is in (the accepted
        drafts and the target's token); prompt chunks take the ragged graphs. Each graph
        reads the feature rows from a buffer of its own (``GraphRunner.run``)."""
        self.runner.enable_graphs(1 + self.config.max_draft_tokens, max_model_len, capture)

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self._features.pop(req_id, None)

    def close(self) -> None:
        super().close()
        if self.target_runner is not None and self.target_runner.model is not None:
            self.target_runner.model.feature_layers = None
        self.target_runner, self._seen = None, []
        self._features.clear()

    def describe(self) -> str:
        cfg = self.model.config
        if self.feature_layers is not None:
            return (f"draft_model (EAGLE-3 head: {cfg.num_hidden_layers} layer(s) over target layers "
                    f"{', '.join(map(str, self.feature_layers))}, {self.model.num_parameters / 1e6:.0f}M "
                    f"parameters + the target's embeddings{self._among()})")
        if self.model.weights_layout == "mtp":
            return (f"mtp (the target's own multi-token-prediction layer 0 of {cfg.num_nextn_predict_layers}, "
                    f"{self.model.num_parameters / 1e6:.0f}M parameters + the target's embeddings and LM head)")
        layout = " in the published EAGLE-1/2 layout" if self.model.weights_layout == "eagle1" else ""
        return (f"draft_model (EAGLE head{layout}: {cfg.num_hidden_layers} layer(s) over the target's hidden "
                f"states, {self.model.num_parameters / 1e6:.0f}M parameters + the target's "
                f"embeddings and LM head{self._among()})")

    # ------------------------------------------------------------------ features
    def _collect(self, requests: Mapping[str, Request]) -> None:
        """Keep each live request's rows of the target's last pass, if it was the pass of
        the step this drafter last proposed for (not, say, a profiling pass)."""
        runner = self.target_runner
        if self._seen is None or runner.last_pass is not self._seen or runner.last_hidden is None:
            return
        hidden, start = runner.last_hidden, 0
        for planned in self._seen:
            n = len(planned.token_ids) + len(planned.draft_token_ids)
            req = requests.get(planned.req_id)
            if req is not None and not req.is_finished:
                self._features[planned.req_id] = (planned.start_pos, hidden[start:start + n])
            start += n

    def _feature_rows(self, req_id: str, lo: int, hi: int) -> torch.Tensor:
        """The target's hidden states of positions [lo, hi); zeros where none was kept (the
        head then drafts worse, never wrongly: verification decides)."""
        first, rows = self._features.get(req_id, (0, None))
        if rows is not None and first <= lo and hi <= first + rows.shape[0]:
            return rows[lo - first:hi - first]
        out = torch.zeros(hi - lo, self.feature_width, dtype=self.dtype, device=self.device)
        if rows is not None:
            a, b = max(lo, first), min(hi, first + rows.shape[0])
            if a < b:
                out[a - lo:b - lo] = rows[a - first:b - first]
        return out

    def time_pass(self, scheduled: list[ScheduledRequest], passes: int = 4) -> None:
        """No start-up timing: a pass needs the target's features (its first draft comes
        with the catch-up every step, counted with the target's)."""
        return None

    # ------------------------------------------------------------------ the step
    def propose(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
                stop: StopRule | None = None) -> DraftProposal:
        began = time.perf_counter()
        self._collect(requests)
        self._seen = scheduled
        entries, features, drafting, ends = [], [], [], {}
        for planned in scheduled:  # one entry per request: the head drafts one path
            k, start = planned.num_lookahead, planned.start_pos
            if planned.draft_cache_valid is not None:  # admitted: its cached blocks' entries
                self._fed[planned.req_id] = planned.draft_cache_valid
            # Entries below ``fed`` are valid; a drafting request re-feeds at least its last
            # one (s - 1), whose output is the first proposal.
            fed = max(0, min(self._fed.get(planned.req_id, 0), start - 1 if k else start))
            if fed < start:
                tokens = requests[planned.req_id].all_token_ids[fed + 1:start + 1]
                entries.append(ScheduledRequest(planned.req_id, tokens, fed, planned.block_table,
                                                planned.params, sample=k > 0, long_rope=planned.long_rope))
                features.append(self._feature_rows(planned.req_id, fed, start))
            self._fed[planned.req_id] = start
            if k:
                drafting.append(planned)
                ends[planned.req_id] = start + len(planned.token_ids)
        if not drafting:
            if entries:
                self._forward(entries, features)
            self.last_catch_up_s = time.perf_counter() - began
            return DraftProposal([[] for _ in scheduled])
        # As ModelDrafter: longest k first, so each step's inputs are a prefix of the last's outputs.
        order = sorted(drafting, key=lambda p: -p.num_lookahead)
        rank = {p.req_id: i for i, p in enumerate(order)}
        paired = sorted(zip(entries, features), key=lambda e: rank.get(e[0].req_id, len(order)))
        meta = None
        if any(not p.params.greedy for p in order):
            meta = SamplingMetadata.build([p.params for p in order], self.device)
        logits, outputs = self._forward([e for e, _ in paired], [f for _, f in paired])
        self.last_catch_up_s = time.perf_counter() - began  # as ModelDrafter: runs whatever k is
        process = LogitsProcess.for_drafting([requests[p.req_id].history(ends[p.req_id]) for p in order],
                                             [p.params for p in order], logits.shape[1], self.device,
                                             [requests[p.req_id].grammar for p in order])
        ranks = TREE_RANKS if self.grows_trees else 0
        # As ModelDrafter: where the stopping rule judges each row and nothing else follows
        # the rows' order, a pass runs only the rows still drafting (``passes_rows``).
        compact = stop is not None and process is None and not ranks
        session = None if stop is None else stop.begin(order, compact)
        tokens, q, confidence, top = self._choose(logits, order, [ends[p.req_id] for p in order], meta,
                                                  process=process, confident=session is not None, runner_ups=ranks)
        columns, q_columns, tops = [tokens], [q], [top]
        n = len(order)
        alive = list(range(n))
        passes_rows = [alive] if compact else None
        for j in range(1, order[0].num_lookahead):
            if session is None:
                n = sum(p.num_lookahead > j for p in order)
            else:
                n = session.after(j - 1, _by_rank(confidence, alive) if compact else confidence[:n].tolist())
            if n == 0:
                break
            alive, active, rows_meta, pick = _next_rows(session.running if compact else None, n, alive, order,
                                                        meta, self.device)
            n, inputs, features = len(alive), pick(tokens), pick(outputs)
            if compact:
                passes_rows.append(alive)
            if process is not None:
                process = process.head(n)
                process.advance(inputs)
            # Proposal d_j at position s - 1 + j (= end + j - 2), the head's output as its feature.
            step = [ScheduledRequest(p.req_id, [0], ends[p.req_id] + j - 2, p.block_table, p.params,
                                     long_rope=p.long_rope) for p in active]
            logits, outputs = self._forward(step, [features], DeviceTokenIds(inputs, [1] * n))
            tokens, q, confidence, top = self._choose(logits, active, [ends[p.req_id] + j for p in active],
                                                      rows_meta, process=process,
                                                      confident=session is not None, runner_ups=ranks)
            columns.append(tokens)
            q_columns.append(q)
            tops.append(top)
        index = {id(p): i for i, p in enumerate(scheduled)}
        positions = [index[id(p)] for p in order]
        proposal = self._proposal(scheduled, positions, columns, q_columns, session, confidence, n, passes_rows)
        if ranks:
            self._tree_material(proposal, scheduled, positions, tops)
        return proposal

    def follow_settled(self, verified: list, settled: list) -> None:
        """The target's last pass verified ``verified`` and its rows now follow ``settled``
        (each tree replaced by its path: ``DraftTrees.settle``): features are read from it."""
        if self._seen is verified:
            self._seen = settled

    @torch.inference_mode()  # (as ModelRunner.execute: no autograd records)
    def _forward(self, entries: list[ScheduledRequest], features: list[torch.Tensor],
                 device_ids: DeviceTokenIds | None = None):
        """The head over ``entries`` with their feature rows: the logits of the sampling
        rows, and the head's outputs there (the features of the next draft step)."""
        rows = features[0] if len(features) == 1 else torch.cat(features)
        logits = self.runner.execute(SchedulerOutput(entries, []), device_ids=device_ids,
                                     features=self.model.input_features(rows))
        hidden = self.runner.last_hidden  # every fed row's output, in schedule order
        ends = list(accumulate(len(e.token_ids) for e in entries))
        sampled = [end - 1 for e, end in zip(entries, ends) if e.sample]
        if len(sampled) == ends[-1]:  # a token each, every one sampled (a draft step)
            return logits, hidden
        (index,) = to_device([sampled], torch.int64, self.device)
        return logits, hidden.index_select(0, index)
