"""Prompt-lookup (n-gram) drafting: no model, proposals copied from the request's context.

Its confidence in a proposal is the match's length: the request's last tokens and the
earlier span the proposal follows agree over that many tokens, counted past ``max_n`` up to
``MATCH_CAP``. A proposal after a long match continues a span being copied (code an edit
repeats) and is nearly always accepted; one after two tokens in common often is not
(held-out traces: ``benchmarks/results/per_token_drafting/ngram_match_2026-12-06/``). It is
given as ``1 - 1 / length`` (0.5 for two tokens, 0.75 for four, 0.95 for twenty), which the
controller's calibration map learns to read like a draft model's top probability.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from specserve.request import Request
from specserve.scheduler import ScheduledRequest
from specserve.spec.drafter import DraftProposal
from specserve.spec.stopping import StopRule

MATCH_CAP = 64  # a match's length is counted up to this many tokens (its confidence, ``confidence``)


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


def match_length(tokens: list[int], end: int, cap: int = MATCH_CAP) -> int:
    """How many last tokens of ``tokens`` the span ending at ``end`` (an earlier position)
    repeats, at most ``cap``: whole slices compared first, doubling, then token by token
    in the last one that differs."""
    length = len(tokens)
    cap = min(cap, end + 1)
    n = 0
    step = 8
    while n < cap:
        m = min(n + step, cap)
        if tokens[end - m + 1:end - n + 1] != tokens[length - m:length - n]:
            while tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            return n
        n, step = m, 2 * step
    return n


def confidence(length: int) -> float:
    """The confidence a match of ``length`` tokens gives its proposals (module docstring)."""
    return 1.0 - 1.0 / length


def continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """Up to ``k`` tokens after the match ending at ``end`` (none where ``end`` is -1):
    ``lookup``'s answer, given where ``find_scan`` or ``NgramIndex.find`` found its match."""
    return [] if end < 0 else tokens[end + 1:end + 1 + k]


def find_scan(tokens: list[int], max_n: int, min_n: int) -> int:
    """Where ``lookup``'s match ends (-1: none), without an index, its search run in C: the
    context reversed once, then ``list.index`` jumps from one earlier occurrence of the
    last token to the next, newest first; each is extended to its match length (at most
    ``max_n``). The longest match wins, the most recent among equals — what ``lookup``
    returns by trying n from ``max_n`` down. Cheaper, once, than building an
    ``NgramIndex`` for a context of a few hundred tokens."""
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return -1
    rev = tokens[::-1]  # rev[i] is tokens[length - 1 - i]
    find, last = rev.index, rev[0]
    best_i, best_n, i = 0, min_n - 1, 0
    while True:
        try:
            i = find(last, i + 1)
        except ValueError:
            break
        n, limit = 1, min(max_n, length - i)
        while n < limit and rev[i + n] == rev[n]:
            n += 1
        if n > best_n:
            best_i, best_n = i, n
            if n == max_n:
                break
    return length - 1 - best_i if best_i else -1


CATCH_UP_TOKENS = 32  # positions an index learns per lookup while it is behind


class NgramIndex:
    """``lookup`` for one growing token list without rescanning it every step: the end
    position of every ``min_n``-gram, kept up to date as tokens are appended. Any longer
    match ends in a ``min_n``-gram match, so only those positions are tried, newest first
    (one entry per token: memory stays linear in the context).

    Building an index costs time per token, so one that is far behind (a new request's
    prompt, or a request that drafted nothing for a while, which adaptive speculation
    makes common under load) catches up by at most ``CATCH_UP_TOKENS`` a lookup, and
    ``find_scan`` answers until it is current: a request that drafts once after a long pause
    does not pay for indexing its whole context inside one step. Under a steady draft the
    index stays current at a small cost a lookup."""

    def __init__(self, min_n: int) -> None:
        self.min_n = min_n
        self._reset()

    def _reset(self) -> None:
        self._ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._indexed = 0  # end positions below this one are in _ends
        self._length = 0

    def find(self, tokens: list[int], max_n: int) -> int:
        """Where ``lookup(tokens, k, max_n, min_n)``'s match ends (-1: none), for ``tokens``
        that only grew since the last call (fewer tokens start the index over)."""
        length, min_n = len(tokens), self.min_n
        if length < self._length:
            self._reset()
        self._length = length
        first = max(self._indexed, min_n - 1)
        stop = min(length - 1, first + CATCH_UP_TOKENS)  # earlier ends only, a few at a time
        ends = self._ends
        for end in range(first, stop):
            ends[tuple(tokens[end - min_n + 1:end + 1])].append(end)
        self._indexed = max(self._indexed, stop)
        if stop < length - 1:  # still behind: the scan answers this time
            return find_scan(tokens, max_n, min_n)
        if length <= min_n:
            return -1
        candidates = self._ends.get(tuple(tokens[length - min_n:]), ())
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            suffix = tokens[length - n:]
            for end in reversed(candidates):
                if end >= n - 1 and tokens[end - n + 1:end + 1] == suffix:
                    return end
        return -1


class NgramDrafter:
    name = "ngram"
    needs_every_step = False  # each request's index catches up on the tokens at its next lookup
    feeds_after_target = False  # (never fed in a step without drafts)
    first_draft_in_catch_up = False
    max_paths = 1  # one continuation per lookup
    last_catch_up_s = 0.0  # no cache to keep up
    last_backlog_s = 0.0
    lazy_from = 0
    draft_cache = None  # no KV cache of its own
    confidence = True  # a match's length (``confidence``): drafting may stop by it (``spec.stopping``)

    def cached_tokens(self, req_id: str) -> int:
        return 0

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[str, NgramIndex] = {}

    def kv_bytes_per_block(self) -> int:
        return 0

    def bind(self, runner) -> None:
        pass

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        pass

    def copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        pass  # no KV cache

    def time_pass(self, scheduled: list[ScheduledRequest], passes: int = 4) -> None:
        return None  # a lookup, not a pass

    def catch_up_lazily(self, from_requests: float = 1) -> bool:
        return True  # no cache: each request's index catches up at its next lookup anyway

    def propose(self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request],
                stop: StopRule | None = None) -> DraftProposal:
        """Each request's continuation of its match, up to its k; with ``stop``, the drafts
        the stopping rule keeps, judged depth by depth by their match's length. The first
        token of a continuation not kept is reported as dropped whether the rule dropped it
        or did not go on to it (it is looked up already): the calibration map learns from
        it where every kept draft is accepted (``Speculator._calibrate``)."""
        if stop is None:
            return DraftProposal([self._lookup(p.req_id, requests[p.req_id].all_token_ids, p.num_lookahead)[0]
                                  if p.num_lookahead else [] for p in scheduled])
        found = [self._lookup(p.req_id, requests[p.req_id].all_token_ids, p.num_lookahead, measure=True)
                 if p.num_lookahead else ([], 0) for p in scheduled]
        session = stop.begin(scheduled, caps=[len(tokens) for tokens, _ in found])
        sure = [confidence(length) if length else 0.0 for _, length in found]
        depth = 0
        while session.after(depth, sure):
            depth += 1
        dropped = [(kept, tokens[kept], sure[r]) if kept < len(tokens) else None
                   for r, ((tokens, _), kept) in enumerate(zip(found, session.kept))]
        return DraftProposal([tokens[:kept] for (tokens, _), kept in zip(found, session.kept)],
                             confidence=session.confidence, pass_rows=session.pass_rows, dropped=dropped,
                             goodput=session.gain / session.time)

    def _lookup(self, req_id: str, tokens: list[int], k: int, measure: bool = False) -> tuple[list[int], int]:
        """The request's proposal and, with ``measure``, its match's length (0: none
        found, or not measured)."""
        index = self._indexes.get(req_id)
        if index is None:
            index = self._indexes[req_id] = NgramIndex(self.min_n)
        end = index.find(tokens, self.max_n)
        if end < 0:
            return [], 0
        return continuation(tokens, end, k), match_length(tokens, end) if measure else 0

    def close(self) -> None:
        """Nothing to let go of: n-gram lookup has no model."""

    def free(self, req_id: str) -> None:
        self._indexes.pop(req_id, None)

    def describe(self) -> str:
        return f"ngram (prompt lookup, n = {self.max_n}..{self.min_n})"
