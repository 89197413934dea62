"""Which of a draft tree's candidates to verify, replayed offline on pools recorded by
``dump_trees.py``: the shipped rule against variants, on the same steps.

A greedy step's accepted length is the number of verified nodes the target's tokens match
(siblings differ, so at most one node a depth matches, and a verified set holds each
node's parent). With the target's tokens known (the output equals plain greedy decoding),
any choice of nodes from a step's recorded candidates is scored exactly, on that step.
Emitted tokens a step = accepted + 1, averaged over the steps (the engine's acceptance
length counts the same).

    python select_eval.py POOL.json.gz [POOL.json.gz ...]
"""
import gzip
import json
import sys
from collections import defaultdict

PARENT, TOKEN, CHANCE, DEPTH, CHAIN, EXPANDED = range(6)


def steps_of(pool, kind, prompts=None):
    for i, run in enumerate(pool[kind]):
        if prompts is None or i in prompts:
            tokens = run["prompt_ids"] + run["out"]
            for step in run["steps"]:
                yield tokens, step


def matches(tokens, step):
    """Per node: whether it and every ancestor are the target's tokens at their positions."""
    ok = []
    for node in step["nodes"]:
        at = step["end"] + node[DEPTH]
        ok.append(at < len(tokens) and tokens[at] == node[TOKEN] and (node[PARENT] < 0 or ok[node[PARENT]]))
    return ok


def own_q(nodes):
    """q of each node's token given its parent (its chance over its parent's)."""
    return [node[CHANCE] / (nodes[node[PARENT]][CHANCE] if node[PARENT] >= 0 else 1.0) for node in nodes]


def ranks(nodes, q):
    children = defaultdict(list)
    for i, node in enumerate(nodes):
        children[node[PARENT]].append(i)
    rank = [0] * len(nodes)
    for ids in children.values():
        for r, i in enumerate(sorted(ids, key=lambda i: -q[i])):
            rank[i] = r
    return rank


def chosen(step, levels, expand, places, value=None):
    """The nodes the shipped rule verifies (``tree.DraftTrees.grow``): ``levels`` passes
    expanding the ``expand`` likeliest unexpanded non-chain nodes above the chain's last
    depth, then the likeliest ``places`` nodes, each after its parent (the chain cuttable).
    ``value``: per node, what ranks them for the choice (default: their chance). None where
    the pool lacks an expansion this rule makes."""
    nodes, k = step["nodes"], step["k"]
    chance = [node[CHANCE] for node in nodes]
    chain = [i for i, node in enumerate(nodes) if node[CHAIN]]
    children = defaultdict(list)
    for i, node in enumerate(nodes):
        children[node[PARENT]].append(i)
    candidates = {i for i, node in enumerate(nodes) if node[PARENT] < 0 or nodes[node[PARENT]][CHAIN]}
    fed, done = set(chain[:-1]), set()
    for _ in range(levels):
        ready = [i for i in candidates if i not in chain and i not in done and nodes[i][DEPTH] < k - 1
                 and (nodes[i][PARENT] < 0 or nodes[i][PARENT] in fed)]
        for i in sorted(ready, key=lambda i: -chance[i])[:expand]:
            if not nodes[i][EXPANDED]:
                return None
            done.add(i)
            fed.add(i)
            candidates.update(children[i])
    rank_by = value or chance
    taken = set()
    for i in sorted(candidates, key=lambda i: (-rank_by[i], nodes[i][DEPTH])):
        if len(taken) == places:
            break
        if nodes[i][PARENT] < 0 or nodes[i][PARENT] in taken:
            taken.add(i)
    return taken


def calibration(pool, kind, prompts=None, prior=8.0):
    """A map fitted on recorded outcomes: per (rank among siblings, depth, q's tenth), the
    matches over the sum of q of nodes whose parent matched; a node's calibrated
    probability is its q times that ratio (shrunk toward 1 by ``prior`` observations)."""
    cells = defaultdict(lambda: [0.0, 0.0, 0])
    for tokens, step in steps_of(pool, kind, prompts):
        ok, nodes = matches(tokens, step), step["nodes"]
        q = own_q(nodes)
        rank = ranks(nodes, q)
        for i, node in enumerate(nodes):
            if (node[PARENT] >= 0 and not ok[node[PARENT]]) or step["end"] + node[DEPTH] >= len(tokens):
                continue
            cell = cells[(min(rank[i], 3), min(node[DEPTH], 3), min(int(q[i] * 10), 9))]
            cell[0] += ok[i]
            cell[1] += q[i]
            cell[2] += 1

    def calibrated(step):
        nodes = step["nodes"]
        q = own_q(nodes)
        rank = ranks(nodes, q)
        value = []
        for i, node in enumerate(nodes):
            hits, total_q, n = cells.get((min(rank[i], 3), min(node[DEPTH], 3), min(int(q[i] * 10), 9)), (0, 0, 0))
            p = min(q[i] * (hits + prior * total_q / n) / (total_q + prior * total_q / n), 0.999) if n else q[i]
            value.append(p * (value[node[PARENT]] if node[PARENT] >= 0 else 1.0))
        return value
    return calibrated


def score(pool, kind, levels, expand, places, value=None, prompts=None):
    """Mean emitted tokens a step of a rule, and of hindsight (the longest matching path of
    the pool within ``places`` nodes); None where the pool lacks the rule's expansions."""
    emitted = best = steps = 0
    for tokens, step in steps_of(pool, kind, prompts):
        taken = chosen(step, levels, expand, places, value(step) if value else None)
        if taken is None:
            return None, None
        ok = matches(tokens, step)
        emitted += 1 + max((step["nodes"][i][DEPTH] + 1 for i in taken if ok[i]), default=0)
        best += 1 + min(max((node[DEPTH] + 1 for i, node in enumerate(step["nodes"]) if ok[i]), default=0), places)
        steps += 1
    return emitted / steps, best / steps


def main():
    print("| pool | workload | engine | shipped rule replayed | 4 x 4 expansions | 6 x 4 | calibrated, in-sample "
          "| calibrated, 2-fold (shipped on the same folds) | hindsight within the pool |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in sys.argv[1:]:
        with gzip.open(path, "rt") as f:
            pool = json.load(f)
        places = pool["k"] + pool["nodes"]
        name = f"{path.split('/')[-1].split('.')[0]}: k {pool['k']} + {pool['nodes']}, pool {pool['levels']} x {pool['expand']}"
        for kind in ("chat", "code"):
            runs = pool[kind]
            engine = 1 + sum(r["accepted"] for r in runs) / sum(r["verify_steps"] for r in runs)
            shipped, hindsight = score(pool, kind, 2, 2, places)
            more = [score(pool, kind, levels, expand, places)[0] for levels, expand in ((4, 4), (6, 4))]
            inside = score(pool, kind, 2, 2, places, calibration(pool, kind))[0]
            halves = [set(range(0, len(runs), 2)), set(range(1, len(runs), 2))]
            folds = [(score(pool, kind, 2, 2, places, calibration(pool, kind, fit), test)[0],
                      score(pool, kind, 2, 2, places, None, test)[0]) for fit, test in (halves, halves[::-1])]

            def f(x):
                return "(pool too small)" if x is None else f"{x:.3f}"
            print(f"| {name} | {kind} | {engine:.3f} | {f(shipped)} | {f(more[0])} | {f(more[1])} | {f(inside)} | "
                  + "; ".join(f"{c:.3f} ({s:.3f})" for c, s in folds) + f" | {hindsight:.3f} |")


if __name__ == "__main__":
    main()
