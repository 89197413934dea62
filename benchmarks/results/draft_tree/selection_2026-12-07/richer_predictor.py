"""A richer predictor of a node's acceptance than q, replayed as ``select_eval.py`` does:
logistic regression on each node's features (log q and q, its rank among its siblings,
its depth, its parent's q, its likeliest sibling's q and its q over that, whether the
chain drafted it), fitted on the even prompts and scored on the odd ones, then the
reverse; nodes ranked by the product of the predicted probabilities along their path,
against the shipped rule (q's product) on the same prompts.

    python richer_predictor.py POOL.json.gz [POOL.json.gz ...]
"""
import gzip
import json
import math
import sys

import numpy as np
from select_eval import CHAIN, DEPTH, PARENT, chosen, matches, own_q, ranks, steps_of


def features(step):
    nodes = step["nodes"]
    q = own_q(nodes)
    rank = ranks(nodes, q)
    top = {}
    for i, node in enumerate(nodes):
        top[node[PARENT]] = max(top.get(node[PARENT], 0.0), q[i])
    rows = []
    for i, node in enumerate(nodes):
        parent_q = q[node[PARENT]] if node[PARENT] >= 0 else 1.0
        rows.append([1.0, math.log(max(q[i], 1e-6)), q[i], rank[i] == 0, rank[i] == 1, rank[i] >= 2,
                     min(node[DEPTH], 5) / 5, math.log(max(parent_q, 1e-6)), top[node[PARENT]],
                     q[i] / max(top[node[PARENT]], 1e-9), node[CHAIN]])
    return np.array(rows, dtype=float)


def outcomes(pool, kind, prompts):
    """Features and outcomes of every node whose parent matched (``calibration``'s)."""
    x, y = [], []
    for tokens, step in steps_of(pool, kind, prompts):
        ok, f = matches(tokens, step), features(step)
        for i, node in enumerate(step["nodes"]):
            if (node[PARENT] < 0 or ok[node[PARENT]]) and step["end"] + node[DEPTH] < len(tokens):
                x.append(f[i])
                y.append(ok[i])
    return np.array(x), np.array(y, dtype=float)


def fit(x, y, l2=1e-3, iters=3000, rate=0.5):
    mean, scale = x.mean(0), x.std(0) + 1e-9
    mean[0], scale[0] = 0.0, 1.0
    z, w = (x - mean) / scale, np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-z @ w))
        w -= rate * (z.T @ (p - y) / len(y) + l2 * w)
    return lambda f: 1 / (1 + np.exp(-((f - mean) / scale) @ w))


def score(pool, kind, model, prompts, places):
    emitted = steps = 0
    for tokens, step in steps_of(pool, kind, prompts):
        value = None
        if model is not None:
            p, value = model(features(step)), []
            for i, node in enumerate(step["nodes"]):
                value.append(min(p[i], 0.999) * (value[node[PARENT]] if node[PARENT] >= 0 else 1.0))
        taken, ok = chosen(step, 2, 2, places, value), matches(tokens, step)
        emitted += 1 + max((step["nodes"][i][DEPTH] + 1 for i in taken if ok[i]), default=0)
        steps += 1
    return emitted / steps


def main():
    print("| pool | workload | logistic, 2-fold (shipped on the same folds) |")
    print("| --- | --- | --- |")
    for path in sys.argv[1:]:
        with gzip.open(path, "rt") as f:
            pool = json.load(f)
        places = pool["k"] + pool["nodes"]
        for kind in ("chat", "code"):
            n = len(pool[kind])
            halves = [set(range(0, n, 2)), set(range(1, n, 2))]
            folds = [(score(pool, kind, fit(*outcomes(pool, kind, train)), test, places),
                      score(pool, kind, None, test, places)) for train, test in (halves, halves[::-1])]
            print(f"| {path.split('/')[-1].split('.')[0]} | {kind} | "
                  + "; ".join(f"{a:.3f} ({b:.3f})" for a, b in folds) + " |", flush=True)


if __name__ == "__main__":
    main()
