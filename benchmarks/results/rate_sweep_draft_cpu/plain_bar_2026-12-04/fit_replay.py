"""The target cost model's samples of one CPU run (``fit_samples.json``: chat, 24 requests
queued, the adaptive engine at 361e7ed, recorded by ``fit_diag.py``: the start-up profile's
10 steps, then every planned step), fitted again as the engine fits them (the profile
anchored at weight 0.1), with no cost negative (the active-set solve) and with the
unconstrained solve clipped at zero (before 2026-12-04): each fit's costs and its
prediction of four of the steps it learned from.

    python fit_replay.py
"""
import json
import os
import types

from ab_plain_bar import clipped_solve  # the solve before 2026-12-04

from specserve.spec.cost_model import CostModel

HERE = os.path.dirname(os.path.abspath(__file__))


with open(os.path.join(HERE, "fit_samples.json")) as f:
    samples = json.load(f)
names = ["fixed", "token", "request", "per 1k context", "span", "padded", "prefill token", "prefill"]
print("| fit | " + " | ".join(f"{n} (ms)" for n in names) + " |")
print("| --- |" + " ---: |" * len(names))
rows = []
for name in ("active set", "clipped"):
    model = CostModel(8)
    if name == "clipped":
        model.solve = types.MethodType(clipped_solve, model)
    for i, sample in enumerate(samples):
        if i == 10:
            model.anchor(weight=0.1)  # the engine's PROFILE_WEIGHT
        model.observe(sample["x"], sample["y"])
    model.solve()
    print(f"| {name} | " + " | ".join(f"{t * 1e3:.3g}" for t in model.theta) + " |")
    rows.append([(i, model.predict(samples[i]["x"])) for i in (14, 12, 48, 45)])
print()
print("| step (requests, tokens, verify spans) | took (ms) | active set | clipped |")
print("| --- | ---: | ---: | ---: |")
for (i, a), (_, c) in zip(*rows):
    x, y = samples[i]["x"], samples[i]["y"]
    print(f"| {int(x[2])}, {int(x[1])}, {int(x[4])} | {y * 1e3:.1f} | {a * 1e3:.1f} ({a / y - 1:+.0%}) | "
          f"{c * 1e3:.1f} ({c / y - 1:+.0%}) |")
