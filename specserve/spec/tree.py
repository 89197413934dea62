"""Dynamic draft trees: a request verifies, beside the chain its draft model (or EAGLE head)
drafted, the draft's other candidates where they are likeliest to be what the target says,
all in the one ragged pass.

* **Growing** (``DraftTrees.grow``). At each depth j of its chain the drafter reports its
  ``TREE_RANKS`` + 1 likeliest tokens and their probabilities under q. A runner-up at
  depth j is a node whose parent is the chain's token j - 1 (the last fed token for j = 0);
  its chance of being emitted is estimated as q's probabilities multiplied along its path
  (EAGLE-2's score). Then ``TREE_LEVELS`` draft passes expand each request's
  ``TREE_EXPAND`` likeliest nodes not yet expanded: the draft model reads them at their
  positions with tree attention over its own cache (``ModelDrafter.expand``; slots after
  the chain's, never reached by the draft's valid length) and their likeliest children
  join the candidates (not for an EAGLE head, whose passes need the target's features).
  Nodes are never deeper than the chain. Across the step, nodes are
  taken likeliest first (a node only after its parent) while each request has at most
  ``max_nodes`` and the step's token budget lasts; where drafting stops by confidence, a
  node (and an expansion) must also pay for verifying it at the step's expected goodput
  (the stopping rule's prices, ``spec.stopping``). Their KV slots are allocated after the
  chain's, and the token budget they use is what scheduling left.
* **Growing a fixed shape** (``DraftTrees.grow_fixed``, on a GPU: ``Speculator._fixed_trees``).
  Choosing by chances needs them on the host before the verify pass can be built, a wait
  for the device a chain step does not have. A greedy request's tree instead takes every
  depth's runner-up, then every depth's next rank, up to ``max_nodes`` (``fixed_shape``);
  their tokens are gathered on the device beside the chain's and reach the host with the
  target's argmax when settling.
* **Verifying.** Nodes sit at their depths' positions and see the context, their
  ancestors and themselves (``batch.tree_rows``; tree attention in every backend).
* **Settling** (``DraftTrees.settle``), before the rejection sampler: from the last fed
  token, each node's child that is the target's argmax there is followed. The path found
  becomes the request's drafts, as if it had drafted that chain: its rows of logits are
  kept, its nodes' K/V move to the chain's slots (``ModelRunner.copy_slots``), and a
  draft cache that holds the chain's entries forgets them from the first runner-up on
  (an EAGLE head's features, the target's kept hidden states, follow the path instead).
  Where the request processes its logits or wants logprobs, the rejection sampler then
  verifies the path like any chain, so the output is exactly the target's, whatever the
  tree (the walk reads raw logits only to choose the path); otherwise the path and the
  target's argmax after it are the step's tokens, decided here.

A sampling request (no seed, logprobs or logits processing: ``grows``) grows a tree too:
its candidates at a depth are the token it drew from q and more drawn from q without
replacement; which are verified reads only the candidates drawn before them; the tree is
verified here, by recursive rejection sampling without replacement (``_sample_walk``), and
its tokens bypass the rejection sampler. Its nodes are not expanded.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from specserve.sampler import SamplingMetadata, sample_from_probs, target_probs
from specserve.scheduler import ScheduledRequest, SchedulerOutput
from specserve.transfer import to_device

# Runner-up candidates per depth a tree may take (ranks 1 .. TREE_RANKS of q), and how
# the likeliest of them grow: TREE_LEVELS draft passes, each over a request's TREE_EXPAND
# likeliest nodes not yet expanded, adding their TREE_RANKS + 1 likeliest children.
TREE_RANKS = 3
TREE_LEVELS = 2
TREE_EXPAND = 2


class TreeOutcome(NamedTuple):
    """What a request's tree came to in a step."""

    nodes: int   # drafts verified: the chain and its further nodes
    chain: int   # of them, the chain the request drafted (its k)
    prefix: int  # chain drafts on the path before a further node; the path's length if none


@dataclass
class Node:
    """A candidate node of a request's draft tree."""

    parent: int           # index of its parent among the request's candidates (-1: the last fed token)
    token: int
    chance: float         # estimated chance that it is emitted: q's probabilities along its path
    depth: int            # 0: right after the last fed token
    chain: bool = False   # one of the drafted chain's (always verified)
    slot: int | None = None  # where the draft's own cache holds its entries (None: not fed)
    expanded: bool = False


def grows(params) -> bool:
    """Whether a request's drafts may grow into a tree: greedy ones without a grammar (its
    drafts are checked on one chain); sampling ones without a seed (their tokens would
    depend on the tree's shape), logprobs or logits processing (verified apart from the
    rejection sampler, which has those; ``DraftTrees.settle``)."""
    if params.structured_outputs is not None:
        return False
    return params.greedy or (params.seed is None and params.logprobs is None and not params.processes_logits)


def candidate_tree(chain: Sequence[int], candidates: Sequence[tuple[Sequence[int], Sequence[float]]],
                   end: int, sampling: bool = False) -> list[Node]:
    """A request's chain (drafted from position ``end`` on; the draft fed all but its last
    token, at their positions) and, at each of its depths, the other candidates as leaves.
    ``sampling``: the candidates were drawn from q without replacement, the chain's first;
    a leaf's chance then reads only the candidates drawn before it (q's mass they leave),
    never its own value, so which are verified does not depend on what they are, and the
    verification stays exact (``DraftTrees.settle``)."""
    nodes, before = [], 1.0
    k = len(chain)
    for depth, (tokens, probs) in enumerate(candidates[:k]):
        own = chain[depth]  # (a tie may rank it second: then the first is a runner-up)
        p_own = probs[tokens.index(own)] if own in tokens else probs[0]
        nodes.append(Node(depth - 1, own, before * p_own, depth, chain=True,
                          slot=end + depth if depth < k - 1 else None))
        before *= p_own
    for depth, (tokens, probs) in enumerate(candidates[:k]):
        others = [(token, prob) for token, prob in zip(tokens, probs) if token != chain[depth]]
        parent_chance = nodes[depth - 1].chance if depth else 1.0
        left = 1.0 - nodes[depth].chance / parent_chance if sampling else 0.0  # q's mass not drawn yet
        for token, prob in others[:len(tokens) - 1]:
            if prob <= 0.0:  # (q could not draw it)
                break
            nodes.append(Node(depth - 1, token, parent_chance * (max(left, 0.0) if sampling else prob), depth))
            left -= prob
    return nodes


def frontier(nodes: list[Node], count: int, max_depth: int, threshold: float = 0.0) -> list[int]:
    """The likeliest ``count`` nodes to expand: not the chain's (the draft continued those),
    not yet expanded, fed parents, children within ``max_depth``, chance at least ``threshold``."""
    ready = [i for i, node in enumerate(nodes)
             if not node.chain and not node.expanded and node.depth < max_depth and node.chance >= threshold
             and (node.parent < 0 or nodes[node.parent].slot is not None)]
    return sorted(ready, key=lambda i: -nodes[i].chance)[:count]


def feed_rows(nodes: list[Node], fed: list[int], end: int, first_slot: int) -> tuple[list[int], list[int]]:
    """Positions and visibility masks (``batch.tree_rows``) of nodes ``fed`` when the draft
    feeds them at slots ``first_slot`` on (set on the nodes): each sees the context before
    ``end``, its ancestors' slots and its own."""
    for n, i in enumerate(fed):
        nodes[i].slot = first_slot + n
    seq_len = first_slot + len(fed)
    context = -1 << (seq_len - end)
    masks = []
    for i in fed:
        mask, node = context, i
        while node >= 0:
            mask |= 1 << (seq_len - 1 - nodes[node].slot)
            node = nodes[node].parent
        masks.append(mask)
    return [end + nodes[i].depth for i in fed], masks


def choose(trees: dict[int, list[Node]], max_nodes: int, budget: int, threshold: float = 0.0,
           cuttable: frozenset[int] | set[int] = frozenset()) -> dict[int, tuple[int, list[int]]]:
    """Per request, how many of its chain's nodes stay and the further nodes to verify:
    likeliest first, each with its parent taken, ``budget`` in all, each with a chance of
    at least ``threshold``, and per request at most its chain's length + ``max_nodes``
    nodes. A chain stays whole, unless its request is in ``cuttable``: then its nodes
    compete for those places too, so a runner-up likelier than the chain's tail takes its
    place (EAGLE-2's reranking) and the request verifies more than ``max_nodes`` further
    nodes. The chain's nodes use none of ``budget`` (the step scheduled them) and need no
    threshold (they were drafted)."""
    ranked = sorted(((node.chance, node.depth, req, i) for req, nodes in trees.items()
                     for i, node in enumerate(nodes) if req in cuttable or not node.chain),
                    key=lambda t: (-t[0], t[1]))
    chains = {req: sum(node.chain for node in nodes) for req, nodes in trees.items()}
    kept = {req: 0 if req in cuttable else chains[req] for req in trees}  # chain nodes kept
    taken: dict[int, list[int]] = {req: [] for req in trees}
    total = 0
    for chance, _, req, i in ranked:
        node, nodes, mine = trees[req][i], trees[req], taken[req]
        parent_in = node.parent < 0 or (node.parent < kept[req] if nodes[node.parent].chain else node.parent in mine)
        if not parent_in:
            continue
        if node.chain:
            if kept[req] + len(mine) < chains[req] + max_nodes:
                kept[req] += 1
            continue
        if total < budget and chance >= threshold and kept[req] + len(mine) < chains[req] + max_nodes:
            mine.append(i)
            total += 1
    return {req: (kept[req], mine) for req, mine in taken.items() if mine}


def fixed_shape(k: int, max_nodes: int, ranks: int = TREE_RANKS) -> list[tuple[int, int]]:
    """A tree of fixed shape beside a chain of ``k``: its nodes as (depth, rank), leaves
    whose parent is the chain's token before that depth — every depth's runner-up (rank
    1), then every depth's rank 2, ..., at most ``max_nodes``."""
    shape = [(depth, r) for r in range(1, ranks + 1) for depth in range(k)]
    return shape[:max(max_nodes, 0)]


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

    def __init__(self, max_nodes: int, kv, runner, drafter, levels: int = TREE_LEVELS,
                 expand: int = TREE_EXPAND, seed: int = 0) -> None:
        self.max_nodes = max_nodes
        self.seed = seed
        self._rng: torch.Generator | None = None  # the sampling walks' random numbers
        self.kv = kv
        self.runner = runner
        self.drafter = drafter
        self.levels = levels if getattr(drafter, "expands_trees", False) else 0
        self.expand = expand

    def grow(self, output: SchedulerOutput, candidates: list, budget: int, threshold: float = 0.0,
             cut=None) -> bool:
        """Add further nodes to ``output``'s requests from their drafter's ``candidates``
        (``DraftProposal.candidates``), expanded by draft passes over the likeliest, within
        ``budget`` tokens; returns whether any grew. A greedy request's chain is cut where
        likelier candidates take its tail's place (``choose``), by ``cut`` (``Drafts.cut``:
        its drafts and their rows of q)."""
        planned = output.scheduled
        trees: dict[int, list[Node]] = {}
        for i, c in enumerate(candidates):
            p = planned[i]
            if not c:
                continue
            end, k = p.start_pos + len(p.token_ids), len(p.draft_token_ids)
            # Slots for the verify pass's nodes and for the draft's passes over nodes.
            if not self.kv.allocate_slots(p.req_id, end + k + max(self.max_nodes, self.levels * self.expand)):
                continue  # no blocks for them: the chain alone
            p.block_table = list(self.kv.block_table(p.req_id))
            trees[i] = candidate_tree(p.draft_token_ids, c, end, sampling=not p.params.greedy)
        next_slot = {i: planned[i].start_pos + len(planned[i].token_ids) + len(planned[i].draft_token_ids) - 1
                     for i in trees}
        for _ in range(self.levels):
            entries, fed_by = [], []
            for i, nodes in trees.items():
                p = planned[i]
                if not p.params.greedy:
                    continue  # (expanded nodes' q is not kept for verifying samples)
                fed = frontier(nodes, self.expand, len(p.draft_token_ids) - 1, threshold)
                if not fed:
                    continue
                end = p.start_pos + len(p.token_ids)
                rows = feed_rows(nodes, fed, end, next_slot[i])
                entries.append(ScheduledRequest(p.req_id, [nodes[j].token for j in fed], next_slot[i],
                                                p.block_table, p.params, prompt_logits=True,
                                                long_rope=p.long_rope, tree_nodes=rows))
                fed_by.append((i, fed))
                next_slot[i] += len(fed)
            if not entries:
                break
            tokens, probs = self.drafter.expand(entries)
            row = 0
            for i, fed in fed_by:
                nodes = trees[i]
                for j in fed:
                    nodes[j].expanded = True
                    for token, prob in zip(tokens[row], probs[row]):
                        nodes.append(Node(j, token, nodes[j].chance * prob, nodes[j].depth + 1))
                    row += 1
        grew = False
        # A sampling request's chain stays whole: which of its drafts are verified must not
        # depend on the values drawn (their chances are q's of the drawn tokens).
        cuttable = {i for i in trees if planned[i].params.greedy} if cut else set()
        chosen = choose(trees, self.max_nodes, budget, threshold, cuttable)
        cuts = {id(planned[i]): kept for i, (kept, _) in chosen.items()
                if i in cuttable and kept < len(planned[i].draft_token_ids)}
        if cuts:
            cut(cuts)
        for i, (k, taken) in chosen.items():
            p, nodes = planned[i], trees[i]
            index = {j: j for j in range(k)}  # candidate -> verified node (the chain first)
            index.update({j: k + n for n, j in enumerate(taken)})
            p.draft_parents = list(range(-1, k - 1)) + [-1 if nodes[j].parent < 0 else index[nodes[j].parent]
                                                       for j in taken]
            p.draft_token_ids = p.draft_token_ids + [nodes[j].token for j in taken]
            grew = True
        return grew

    def grow_fixed(self, output: SchedulerOutput, proposal, budget: int) -> bool:
        """Add to each greedy request's chain the runner-ups of a tree of fixed shape
        (``fixed_shape``), within ``budget`` tokens, without their values reaching the host:
        ``proposal.leaves`` holds each pass's likeliest tokens on the device, and
        ``proposal.draft_ids`` becomes every entry's chain and then its nodes, gathered
        there. The host knows each node's depth and parent beforehand, so the verify pass is
        built while the drafts are still being made, and the step waits for the device once
        (``settle`` reads the nodes' values with the target's argmax). Returns whether any
        grew."""
        tokens, firsts, rank = proposal.leaves
        width = tokens.shape[1]
        planned = output.scheduled
        counts = [len(p.draft_token_ids) for p in planned]
        gather, start, grew = [], 0, False  # into [draft ids; the ranked tokens, flat]
        leaves_at = proposal.draft_ids.shape[0]
        for i, p in enumerate(planned):
            k = counts[i]
            shape = fixed_shape(k, min(self.max_nodes, budget), width - 1) \
                if k and p.params.greedy and grows(p.params) else []
            end = p.start_pos + len(p.token_ids)
            if shape and self.kv.allocate_slots(p.req_id, end + k + len(shape)):
                p.block_table = list(self.kv.block_table(p.req_id))
                p.draft_parents = list(range(-1, k - 1)) + [depth - 1 for depth, _ in shape]
                p.draft_token_ids = p.draft_token_ids + [0] * len(shape)
                gather += range(start, start + k)
                gather += [leaves_at + (firsts[depth] + rank[i]) * width + r for depth, r in shape]
                budget -= len(shape)
                grew = True
            else:
                gather += range(start, start + k)
            start += k
        if grew:
            (index,) = to_device([gather], torch.int64, tokens.device)
            proposal.draft_ids = torch.cat([proposal.draft_ids, tokens.flatten()]).index_select(0, index)
        return grew

    def settle(self, drafts, logits: torch.Tensor) -> torch.Tensor:
        """Each tree's path as its request's drafts (``drafts.settled``, the outcomes in
        ``drafts.trees``); returns the logits rows of the step as settled, without those
        of the trees verified here (their tokens in ``drafts.decided``, by entry): a
        sampling request's, and a greedy one's whose sampler would only take the argmax
        again (no logits processing, no logprobs), so on a GPU the step waits for its
        pass once. ``logits``: the verify pass's rows (a sampling
        entry's 1 + drafts, after any prompt rows)."""
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
        argmax = logits.index_select(0, index).argmax(dim=-1)
        if drafts.device_ids is None:
            argmax = argmax.tolist()  # (the step's one wait)
        else:  # a fixed tree's drafts come back with the argmax, in the step's one wait
            both = torch.cat([argmax, drafts.device_ids.ids]).tolist()
            argmax, at = both[:len(tree_rows)], len(tree_rows)
            for p, count in zip(scheduled, drafts.device_ids.counts):
                p.draft_token_ids, at = both[at:at + count], at + count
            drafts.device_ids = None
        settled, keep, moves, q_keep, q_row, at = list(scheduled), [], [], [], 0, 0
        paths: dict[int, list[int]] = {}
        for i, p in enumerate(scheduled):
            n = len(p.draft_token_ids)
            if p.draft_parents is None:
                keep += range(begins[i], starts[i] + (1 + n if p.sample else 0))
                if p.sample:
                    q_keep += range(q_row, q_row + n)
                    q_row += n
                continue
            chain = _chain_length(p.draft_parents)
            if p.params.greedy:
                path = walk(p.draft_token_ids, p.draft_parents, argmax[at:at + 1 + n])
                last = argmax[at + 1 + path[-1] if path else at]  # the target's token after the path
            else:
                (q_rows,) = to_device([list(range(q_row, q_row + chain))], torch.int64, logits.device)
                path, last = self._sample_walk(p, logits[starts[i]:starts[i] + 1 + n],
                                               drafts.probs.index_select(0, q_rows))
            at += 1 + n
            paths[i] = path
            prefix = next((d for d, node in enumerate(path) if node != d), len(path))
            end = p.start_pos + len(p.token_ids)
            for depth, node in enumerate(path):
                if node != depth:
                    moves.append((_slot(p.block_table, end + node, self.kv.block_size),
                                  _slot(p.block_table, end + depth, self.kv.block_size)))
            if prefix < len(path):
                self.drafter.rewind(p.req_id, end + prefix)
            q_row += chain
            drafts.trees[p.req_id] = TreeOutcome(n, chain, prefix)
            settled[i] = replace(p, draft_token_ids=[p.draft_token_ids[node] for node in path], draft_parents=None)
            if p.params.greedy and (p.params.processes_logits or p.params.logprobs is not None):
                # The sampler verifies the path (processed logits, logprobs) as any chain.
                keep += [starts[i]] + [starts[i] + 1 + node for node in path]
                q_keep += range(q_row - chain, q_row - chain + len(path))  # (a greedy row's q is never read)
            else:  # verified here: a greedy path's tokens are the target's argmax, and the one after it
                drafts.decided[id(settled[i])] = settled[i].draft_token_ids + [last]
        if moves:  # (a draft sharing the target's cache moves with it; its own forgot them)
            self.runner.copy_slots(moves)
        drafts.settled = SchedulerOutput(settled, drafts.scheduled.preempted_req_ids, drafts.scheduled.block_copies)
        self._follow(scheduled, settled, paths)
        if drafts.probs is not None:
            drafts.probs = drafts.probs.index_select(0, to_device([q_keep], torch.int64, drafts.probs.device)[0])
        if not keep:  # every request's tokens decided here
            return logits[:0]
        return logits.index_select(0, to_device([keep], torch.int64, logits.device)[0])


    def _follow(self, scheduled: list, settled: list, paths: dict[int, list[int]]) -> None:
        """Where the target's pass keeps its hidden states (for a head that reads them), its
        rows become those of ``settled``: each tree's fed tokens and then its path's nodes
        (``paths``: by entry), in the positions they now hold, and the drafter reads them
        as such."""
        runner = self.runner
        if not runner.keep_hidden or runner.last_hidden is None or runner.last_pass is not scheduled:
            return
        rows, row = [], 0
        for i, before in enumerate(scheduled):
            fed = len(before.token_ids)
            if i in paths:
                rows += range(row, row + fed)
                rows += [row + fed + node for node in paths[i]]
            else:
                rows += range(row, row + fed + len(before.draft_token_ids))
            row += fed + len(before.draft_token_ids)
        (index,) = to_device([rows], torch.int64, runner.last_hidden.device)
        runner.last_hidden = runner.last_hidden.index_select(0, index)
        runner.last_pass = settled
        self.drafter.follow_settled(scheduled, settled)

    def _sample_walk(self, planned, logits: torch.Tensor, chain_q: torch.Tensor) -> tuple[list[int], int]:
        """A sampling request's tree verified by recursive rejection sampling without
        replacement (Sequoia's rule, as SpecInfer's with candidates drawn without
        replacement): at each node its children are tried in the order they were drawn
        from q (the chain's first); child c is accepted with probability min(1, p(c) / q(c));
        after a rejection p becomes normalize(max(p − q, 0)) and q loses c (renormalised).
        The first accepted child is followed; where none is (or there is none), the token is
        drawn from p as it stands. Output tokens then follow the target's distribution p
        exactly. ``logits``: the request's rows (the last fed token's, then each node's);
        ``chain_q``: q at each depth of its chain, from which every candidate at that depth
        was drawn. Returns the nodes followed and the token drawn after them."""
        p_rows = target_probs(logits, SamplingMetadata.build([planned.params] * logits.shape[0], logits.device))
        if self._rng is None:
            self._rng = torch.Generator(device=logits.device).manual_seed(self.seed)
        tokens, parents = planned.draft_token_ids, planned.draft_parents
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        depth = {-1: -1}
        for i, parent in enumerate(parents):
            depth[i] = depth[parent] + 1
        node, path = -1, []
        while True:
            p = p_rows[node + 1]
            kids = children.get(node, [])
            if kids:
                q = chain_q[depth[node] + 1].float().clone()
            accepted = None
            for child in kids:
                token = tokens[child]
                u = torch.rand((), generator=self._rng, device=p.device)
                if bool(u * q[token] < p[token]):
                    accepted = child
                    break
                residual = (p - q).clamp_(min=0.0)
                if float(residual.sum()) > 0.0:
                    p = residual / residual.sum()
                q[token] = 0.0
                if float(q.sum()) <= 0.0:
                    break
                q = q / q.sum()
            if accepted is None:
                u = torch.rand((1,), generator=self._rng, device=p.device)
                return path, int(sample_from_probs(p[None], u)[0])
            path.append(accepted)
            node = accepted


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

