"""The running requests as adaptive speculation needs them, kept up to date step by step
(``DecodingRequests``)."""
from __future__ import annotations

from specserve.request import Request
from specserve.scheduler import Scheduler


class DecodingRequests:
    """The running requests sorted for the draft-length controller: decoding with k for
    the controller to choose (``free``, each with its cap), decoding with a k of their own
    (``pinned``: the API's per-request k, or a seeded sampling request's fixed k, which
    keeps its sampled tokens reproducible), and still in prefill.

    Kept up to date from step to step: only requests that joined or left ``running`` since
    the last look (the scheduler logs them, ``running_changes``), and those still in
    prefill, are looked at. A decoding request only returns to prefill by leaving
    ``running`` (preemption), so the rest keep their place: a pass over all of them at
    every step would be a cost of its own at a GPU step's scale."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.version = -1
        self.free: dict[str, int] = {}
        self.greedy: set[str] = set()  # of ``free``: greedy requests (they may verify draft paths)
        self.pinned: dict[str, int] = {}
        self.prefilling: dict[str, Request] = {}
        self.joined = 0  # requests that entered ``free``, ever: what changed in a batch, at no pass over it

    def refresh(self, scheduler: Scheduler) -> int:
        """Bring the sorting up to date; returns the tokens the requests still in prefill
        have to compute."""
        known = ()  # of a re-sort: the requests already decoding (they do not join again)
        if self.version != scheduler.running_version:
            changes = scheduler.running_changes(self.version)
            if changes is None:  # the first look, or too far behind the log: sort them all
                known = set(self.free)
                self.free.clear()
                self.greedy.clear()
                self.pinned.clear()
                self.prefilling = {r.req_id: r for r in scheduler.running}
            else:  # the joins and leaves since the last look, in order: an id is reused
                for req, joined in changes:  # only after its request left
                    if joined:  # sorted below
                        self.prefilling[req.req_id] = req
                    else:
                        self.free.pop(req.req_id, None)
                        self.greedy.discard(req.req_id)
                        self.pinned.pop(req.req_id, None)
                        self.prefilling.pop(req.req_id, None)
            self.version = scheduler.running_version
        tokens = 0
        for req_id, req in list(self.prefilling.items()):
            remaining = len(req.all_token_ids) - req.num_computed_tokens
            if remaining > 1:
                tokens += remaining
                continue
            del self.prefilling[req_id]
            params = req.params
            if params.num_speculative_tokens is not None:
                self.pinned[req_id] = min(self.k, params.num_speculative_tokens)
            elif params.seed is not None and params.temperature > 0:
                self.pinned[req_id] = self.k
            else:
                self.free[req_id] = self.k
                self.joined += req_id not in known
                if params.greedy:
                    self.greedy.add(req_id)
        return tokens

    @property
    def num_prefilling(self) -> int:
        return len(self.prefilling)
