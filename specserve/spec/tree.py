"""Dynamic draft trees: a greedy request verifies, beside the chain its draft model drafted,
the draft's runner-up candidates where they are likeliest to be what the target says, all
in the one ragged pass.

* **Growing** (``DraftTrees.grow``). At each depth j of its chain the drafter reports its
  ``TREE_RANKS`` + 1 likeliest tokens and their probabilities under q. A runner-up r at
  depth j is a leaf whose parent is the chain's token j - 1 (the last fed token for j = 0);
  its chance of being emitted is estimated as the product of q's top probabilities before
  j times its own probability. Across the step, leaves are taken likeliest first while
  each request has at most ``max_nodes`` and the step's token budget lasts; where drafting
  stops by confidence, a leaf must also pay for verifying it at the step's expected goodput
  (the stopping rule's prices, ``spec.stopping``). Their KV slots are allocated after the
  chain's, and the token budget they use is what scheduling left.
* **Verifying.** Nodes sit at their depths' positions and see the context, their
  ancestors and themselves (``batch.tree_rows``; tree attention in every backend).
* **Settling** (``DraftTrees.settle``), before the rejection sampler: from the last fed
  token, each node's child that is the target's argmax there is followed. The path found
  becomes the request's drafts, as if it had drafted that chain: its rows of logits are
  kept, its nodes' K/V move to the chain's slots (``ModelRunner.copy_slots``), and a
  draft cache that holds the chain's entries forgets them from the first runner-up on.
  The rejection sampler then verifies the path like any chain, so the output is exactly
  the target's, whatever the tree (logits processors included: the walk reads raw logits
  only to choose the path).

Sampling requests draft a chain: verifying several drafts of one distribution needs
multi-draft rejection sampling, which is not built.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from specserve.scheduler import SchedulerOutput
from specserve.transfer import to_device

# Runner-up candidates per depth a tree may take (ranks 1 .. TREE_RANKS of q).
TREE_RANKS = 2


class TreeOutcome(NamedTuple):
    """What a request's tree came to in a step."""

    nodes: int   # drafts verified: the chain and its further nodes
    chain: int   # of them, the chain the request drafted (its k)
    prefix: int  # chain drafts on the path before a further node; the path's length if none


@dataclass(frozen=True)
class Leaf:
    req: int        # index of the request's entry in the step
    parent: int     # chain node (-1: the last fed token)
    token: int
    chance: float   # estimated chance that it is emitted


def leaves(chain: Sequence[int], candidates: Sequence[tuple[Sequence[int], Sequence[float]]],
           req: int = 0) -> list[Leaf]:
    """A chain's runner-up leaves at each of its depths, with their estimated chances."""
    out, before = [], 1.0
    for depth, (tokens, probs) in enumerate(candidates[:len(chain)]):
        own = chain[depth]  # (a tie may rank it second: then the first is a runner-up)
        others = [(token, prob) for token, prob in zip(tokens, probs) if token != own]
        for token, prob in others[:len(tokens) - 1]:
            out.append(Leaf(req, depth - 1, token, before * prob))
        before *= probs[tokens.index(own)] if own in tokens else probs[0]
    return out


def choose_leaves(all_leaves: list[Leaf], max_nodes: int, budget: int, threshold: float = 0.0) -> list[Leaf]:
    """The leaves to verify: likeliest first, at most ``max_nodes`` per request and
    ``budget`` in all, each with a chance of at least ``threshold``."""
    taken: list[Leaf] = []
    per_request: dict[int, int] = {}
    for leaf in sorted(all_leaves, key=lambda leaf: -leaf.chance):
        if len(taken) >= budget or leaf.chance < threshold:
            break
        if per_request.get(leaf.req, 0) < max_nodes:
            per_request[leaf.req] = per_request.get(leaf.req, 0) + 1
            taken.append(leaf)
    return taken


def walk(tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The nodes the target's greedy choices follow from the root: ``argmax[0]`` is its
    token after the last fed token, ``argmax[1 + i]`` after node i. Among a node's children
    the first in node order wins (the chain's, which comes first)."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        children.setdefault(parent, {}).setdefault(token, i)
    path, node = [], -1
    while (child := children.get(node, {}).get(argmax[node + 1])) is not None:
        path.append(child)
        node = child
    return path


class DraftTrees:
    """Grows a step's draft trees and settles them after the verify pass."""

    def __init__(self, max_nodes: int, kv, runner, drafter) -> None:
        self.max_nodes = max_nodes
        self.kv = kv
        self.runner = runner
        self.drafter = drafter

    def grow(self, output: SchedulerOutput, candidates: list, budget: int, threshold: float = 0.0) -> bool:
        """Add further nodes to ``output``'s requests from their drafter's ``candidates``
        (``DraftProposal.candidates``) within ``budget`` tokens; returns whether any grew."""
        planned = output.scheduled
        found = [leaf for i, c in enumerate(candidates) if c for leaf in leaves(planned[i].draft_token_ids, c, i)]
        chosen = choose_leaves(found, self.max_nodes, budget, threshold)
        by_request: dict[int, list[Leaf]] = {}
        for leaf in chosen:
            by_request.setdefault(leaf.req, []).append(leaf)
        grew = False
        for i, taken in by_request.items():
            p = planned[i]
            chain = len(p.draft_token_ids)
            end = p.start_pos + len(p.token_ids)
            if not self.kv.allocate_slots(p.req_id, end + chain + len(taken)):
                continue  # no blocks for them: the chain alone
            p.block_table = list(self.kv.block_table(p.req_id))
            p.draft_parents = list(range(-1, chain - 1)) + [leaf.parent for leaf in taken]
            p.draft_token_ids = p.draft_token_ids + [leaf.token for leaf in taken]
            grew = True
        return grew

    def settle(self, drafts, logits: torch.Tensor) -> torch.Tensor:
        """Each tree's path as its request's drafts (``drafts.settled``, the outcomes in
        ``drafts.trees``); returns the logits rows of the step as settled. ``logits``: the
        verify pass's rows (a sampling entry's 1 + drafts, after any prompt rows)."""
        scheduled = drafts.scheduled.scheduled
        begins, starts, row = [], [], 0  # each entry's first row, and its first sampling row
        for p in scheduled:
            begins.append(row)
            row += len(p.token_ids) - p.sample if p.prompt_logits else 0
            starts.append(row)
            row += 1 + len(p.draft_token_ids) if p.sample else 0
        tree_rows = [starts[i] + r for i, p in enumerate(scheduled) if p.draft_parents is not None
                     for r in range(1 + len(p.draft_token_ids))]
        (index,) = to_device([tree_rows], torch.int64, logits.device)
        argmax = logits.index_select(0, index).argmax(dim=-1).tolist()  # (the step's one wait)
        settled, keep, moves, q_keep, q_row, at = list(scheduled), [], [], [], 0, 0
        for i, p in enumerate(scheduled):
            n = len(p.draft_token_ids)
            if p.draft_parents is None:
                keep += range(begins[i], starts[i] + (1 + n if p.sample else 0))
                if p.sample:
                    q_keep += range(q_row, q_row + n)
                    q_row += n
                continue
            path = walk(p.draft_token_ids, p.draft_parents, argmax[at:at + 1 + n])
            at += 1 + n
            chain = _chain_length(p.draft_parents)
            prefix = next((d for d, node in enumerate(path) if node != d), len(path))
            end = p.start_pos + len(p.token_ids)
            for depth, node in enumerate(path):
                if node != depth:
                    moves.append((_slot(p.block_table, end + node, self.kv.block_size),
                                  _slot(p.block_table, end + depth, self.kv.block_size)))
            if prefix < len(path):
                self.drafter.rewind(p.req_id, end + prefix)
            keep += [starts[i]] + [starts[i] + 1 + node for node in path]
            q_keep += range(q_row, q_row + len(path))  # (a greedy row's q is never read)
            q_row += chain
            drafts.trees[p.req_id] = TreeOutcome(n, chain, prefix)
            settled[i] = replace(p, draft_token_ids=[p.draft_token_ids[node] for node in path], draft_parents=None)
        if moves:  # (a draft sharing the target's cache moves with it; its own forgot them)
            self.runner.copy_slots(moves)
        drafts.settled = SchedulerOutput(settled, drafts.scheduled.preempted_req_ids, drafts.scheduled.block_copies)
        if drafts.probs is not None:
            drafts.probs = drafts.probs.index_select(0, to_device([q_keep], torch.int64, drafts.probs.device)[0])
        return logits.index_select(0, to_device([keep], torch.int64, logits.device)[0])


def drafted_rows(planned) -> int:
    """An entry's rows of q (``Drafts.probs``): one per draft of its chain (a tree's
    further nodes have none)."""
    parents = planned.draft_parents
    return len(planned.draft_token_ids) if parents is None else _chain_length(parents)


def _chain_length(parents: Sequence[int]) -> int:
    """How many first nodes form the chain (node i's parent is i - 1)."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def _slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size

