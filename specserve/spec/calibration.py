"""How often a drafted token is accepted, given how confident the draft was in it: an
online calibration map (``ConfidenceCalibration``).

A draft model or EAGLE head computes its distribution q at every depth. Its confidence,
the top probability of q, predicts acceptance far better than a request's past: a
confident draft is accepted, an unsure one mostly is not. N-gram lookup's confidence is
its match's length, as ``1 - 1/length`` (``drafts/ngram.py``). The map learns
P(accepted | the tokens before it were accepted, confidence, depth) from every verified
draft token (each is an outcome, so what it learns does not depend on which steps chose
to draft), in bins of confidence per depth, separately for greedy and sampling requests
(a sampled draft is accepted with probability min(1, p/q), not when it is the target's
argmax). A greedy request's first draft that the stopping rule dropped teaches it too,
where every draft kept before it was accepted: the target's next token says whether it
would have been (``Speculator._calibrate``). Else the bins the rule drops from would
learn only from the few drafts it kept there, and a bin predicted too low would stay so.

Each bin starts from a prior that the draft is calibrated (its acceptance is its
confidence), worth ``PRIOR_WEIGHT`` observations, and forgets old outcomes
exponentially (``FORGET`` per token observed at its kind and depth), so a workload that changes
(chat after code) is learned again. Read out, each depth's bins are made monotone in
confidence (pool-adjacent-violators, weighted by their observations): a more confident
draft is never predicted worse, and a sparse bin borrows from its neighbours.

The confidence used is the top probability of q, not q of the drawn token: for a sampled
draft, a rule that keeps or drops a draft by the value it drew would bias the verified
distribution; one that looks only at q keeps rejection sampling exact.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

# Bin edges over confidence; finer near 1, where a good draft's tokens gather.
EDGES = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 1.0])
NUM_BINS = len(EDGES) - 1
DEPTHS = 4            # depths 0, 1, 2 and 3 or deeper (deeper ones behave alike given confidence)
PRIOR_WEIGHT = 4.0    # observations the calibrated-draft prior is worth, per bin
FORGET = 0.9995       # per observed token of a kind and depth: a half-life of ~1,400 tokens
_EDGES = EDGES.tolist()


def _bin(confidence: float) -> int:
    """A confidence's bin: the last edge at or below it (0 below 0, the last bin at 1)."""
    return min(max(bisect_right(_EDGES, confidence) - 1, 0), NUM_BINS - 1)


class ConfidenceCalibration:
    """P(a draft token is accepted | all before it were, its confidence, its depth).

    It runs at every step of a drafting engine with a handful of tokens, so it works in
    plain Python per token (numpy's per-call cost is most of the work at these sizes) and
    keeps its monotone map, remaking a row (a kind of request at a depth) that a step's
    tokens changed only when it is next read."""

    def __init__(self) -> None:
        centres = ((EDGES[:-1] + EDGES[1:]) / 2).tolist()
        self._prior = centres  # a calibrated draft: acceptance = the bin's mid confidence
        # [greedy?][depth][bin], forgetting weights
        self._seen = [[[0.0] * NUM_BINS for _ in range(DEPTHS)] for _ in range(2)]
        self._accepted = [[[0.0] * NUM_BINS for _ in range(DEPTHS)] for _ in range(2)]
        self.num_observed = 0
        # The monotone map, row by row (the engine's thread only), and its rows to make
        # again before they are read.
        self._rows = [[self._row(k, d) for d in range(DEPTHS)] for k in range(2)]
        self._changed: set[tuple[int, int]] = set()

    @property
    def prior(self) -> np.ndarray:
        """``[2, DEPTHS, NUM_BINS]`` the acceptance each bin starts from."""
        return np.broadcast_to(np.array(self._prior), (2, DEPTHS, NUM_BINS)).copy()

    @property
    def seen(self) -> np.ndarray:
        """``[2, DEPTHS, NUM_BINS]`` the (forgetting-weighted) observations per bin."""
        return np.array(self._seen)

    @property
    def accepted(self) -> np.ndarray:
        """``[2, DEPTHS, NUM_BINS]`` the (forgetting-weighted) accepted tokens per bin."""
        return np.array(self._accepted)

    def observe(self, greedy, depth, confidence, accepted) -> None:
        """Verified draft tokens, flat (a step's, all requests together): whether each
        one's request is greedy, its depth, confidence and whether it was accepted. A
        request's tokens count up to and including its first rejection (those past it
        were never judged)."""
        rows: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for g, d, c, a in zip(greedy, depth, confidence, accepted):
            rows.setdefault((0 if g else 1, min(int(d), DEPTHS - 1)), []).append((_bin(float(c)), float(a)))
        for (kind, d), tokens in rows.items():
            decay = FORGET ** float(len(tokens))  # each row forgets by its own tokens
            seen = self._seen[kind][d] = [s * decay for s in self._seen[kind][d]]
            hits = self._accepted[kind][d] = [h * decay for h in self._accepted[kind][d]]
            for b, a in tokens:
                seen[b] += 1.0
                hits[b] += a
            self.num_observed += len(tokens)
        self._changed.update(rows)

    def _row(self, kind: int, depth: int) -> list[float]:
        """One row of the map (a kind of request at a depth), made from its observations."""
        weight = [s + PRIOR_WEIGHT for s in self._seen[kind][depth]]
        values = [(h + PRIOR_WEIGHT * p) / w for h, p, w in zip(self._accepted[kind][depth], self._prior, weight)]
        return _monotone(values, weight)

    def _current(self, kind: int, depth: int) -> list[float]:
        """A row of the map as its observations so far make it."""
        if (kind, depth) in self._changed:
            self._changed.discard((kind, depth))
            self._rows[kind][depth] = self._row(kind, depth)
        return self._rows[kind][depth]

    @property
    def table(self) -> np.ndarray:
        """``[2, DEPTHS, NUM_BINS]`` the acceptance predicted per bin (greedy, sampling),
        monotone in confidence."""
        return np.array([[self._current(k, d) for d in range(DEPTHS)] for k in range(2)])

    def predict(self, greedy: bool, depth: int, confidence) -> list[float]:
        """The acceptance of tokens drafted at ``depth`` with these confidences."""
        row = self._current(0 if greedy else 1, min(depth, DEPTHS - 1))
        return [row[_bin(c)] for c in confidence]

    def best_case(self, greedy: bool, max_k: int) -> np.ndarray:
        """``[max_k]`` per depth, the acceptance of the most confident drafts: what a plan
        may hope for at best (the drafter then stops where its tokens are less sure)."""
        kind = 0 if greedy else 1
        return np.array([self._current(kind, min(d, DEPTHS - 1))[-1] for d in range(max_k)])

    def describe(self) -> dict:
        """The map for ``/metrics`` and benchmark output: bin edges, and per kind and
        depth the predicted acceptance and the (forgetting-weighted) observations per bin.
        Made afresh (the server's metrics read it from another thread than the engine's)."""
        seen = self.seen
        table = np.array([[self._row(k, d) for d in range(DEPTHS)] for k in range(2)])
        return {"edges": EDGES.tolist(), "observed_tokens": self.num_observed,
                **{kind: {"acceptance": table[i].round(4).tolist(), "observations": seen[i].round(1).tolist()}
                   for i, kind in enumerate(("greedy", "sampling"))}}


def _monotone(values, weights) -> list[float]:
    """The weighted least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    if all(a <= b for a, b in zip(values, values[1:])):
        return list(values)  # (what the pooling would give: nothing to pool)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks[-1]
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return [m for m, _, c in blocks for _ in range(c)]
