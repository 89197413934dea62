"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the request's context."""
from __future__ import annotations

from collections.abc import Mapping

from specserve.drafts.base import DraftProposal
from specserve.request import Request
from specserve.scheduler import ScheduledRequest


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Match the last n tokens (n from ``max_n`` down to ``min_n``) against earlier context;
    at the most recent earlier match, propose up to ``k`` tokens that followed it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        last = suffix[-1]
        # Scan right to left for an earlier occurrence of the suffix.
        for end in range(length - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n

    def kv_bytes_per_block(self) -> int:
        return 0

    def bind(self, runner) -> None:
        pass

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        pass

    def propose(self, scheduled: list[ScheduledRequest],
                requests: Mapping[str, Request]) -> DraftProposal:
        return DraftProposal([
            lookup(requests[p.req_id].all_token_ids, p.num_lookahead, self.max_n, self.min_n)
            if p.num_lookahead else [] for p in scheduled])

    def free(self, req_id: str) -> None:
        pass

    def describe(self) -> str:
        return f"ngram (prompt lookup, n = {self.max_n}..{self.min_n})"
