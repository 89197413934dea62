"""The adaptive plan's choices of k against every fixed k, on simulated batch-1 steps
(``specserve.bench.plan_sim``): no host time, no machine noise, the same texts for every
policy, so what is left is what the choices themselves cost or gain.

Workloads: chat-like (acceptance drawn from 0.3–0.85), code-like (0.6–0.98) and switching
(0.1 or 0.95, as copied spans and fresh text take turns), each with one acceptance per
request and with segments of 20 tokens on average; caps of 4 and 6 drafts. Policies: fixed k = 0…cap, the plan as it is, the plan with the settings before
2026-12-01 (``--before``: checks spread by 8 per standard error, plans standing at most 8
steps), the plan with a per-request acceptance weight of its own (``--smoothing W``:
0.3 now), and an oracle that knows each segment's acceptance. Ratios are to the best fixed k (at most the cap) of the same texts, averaged
over ``--seeds``.

    python benchmarks/plan_simulation.py [--seeds 4] [--requests 300] [--before] [--smoothing 0.1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

WORKLOADS = {"chat-like": ((0.3, 0.85), False), "code-like": ((0.6, 0.98), False),
             "switching": ((0.1, 0.95), True)}
BEFORE = {"specserve.spec.goodput": {"CHECK_SPREAD": 8}, "specserve.spec.controller": {"DRAFT_REPLAN_MAX": 8}}


@contextmanager
def settings(values: dict[str, dict[str, float]]):
    """Module constants set for the block, then restored."""
    import importlib

    saved = []
    for module_name, constants in values.items():
        module = importlib.import_module(module_name)
        for name, value in constants.items():
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--before", action="store_true", help="also the plan with the settings before 2026-12-01")
    parser.add_argument("--smoothing", type=float, default=None,
                        help="also the plan with this per-request acceptance weight")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from specserve.bench.plan_sim import simulate

    rows = []
    for workload, (acceptance, switching) in WORKLOADS.items():
        for segment in (0, 20):
            for max_k in (4, 6):
                ratios: dict[str, list[float]] = {}
                means: dict[str, list[float]] = {}
                for seed in range(args.seeds):
                    run = {"acceptance": acceptance, "segment": segment, "requests": args.requests, "seed": seed,
                           "switching": switching}
                    fixed = {k: simulate(k, max_k=max_k, **run)[0] for k in range(max_k + 1)}
                    best = max(fixed.values())
                    policies = {"plan": {}, **({"plan, before": BEFORE} if args.before else {}),
                                **({f"plan, smoothing {args.smoothing}": {"specserve.spec.acceptance": {
                                    "ACCEPT_SMOOTHING": args.smoothing}}} if args.smoothing else {}),
                                "oracle": {}}
                    for name, values in policies.items():
                        with settings(values):
                            rate, mean_k = simulate("oracle" if name == "oracle" else "plan", max_k=max_k, **run)
                        ratios.setdefault(name, []).append(rate / best)
                        means.setdefault(name, []).append(mean_k)
                    ratios.setdefault("best fixed k", []).append(max(fixed, key=fixed.get))
                row = {"workload": workload, "segment": segment, "max_k": max_k,
                       "best_fixed_k": statistics.mode(ratios.pop("best fixed k")),
                       **{f"{name} vs best fixed": round(statistics.mean(v), 3) for name, v in ratios.items()},
                       **{f"{name} mean k": round(statistics.mean(v), 2) for name, v in means.items()
                          if name != "oracle"}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    names = [n[:-len(" vs best fixed")] for n in rows[0] if n.endswith(" vs best fixed")]
    print(f"\nSimulated batch-1 steps (H200 costs of the default model and its draft), {args.requests} requests "
          f"of 128 tokens, {args.seeds} seeds; ratios to the best fixed k of the same texts\n")
    print("| workload | segments | cap | best fixed k | " + " | ".join(names) + " |")
    print("| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for r in rows:
        segments = f"~{r['segment']} tokens" if r["segment"] else "one per request"
        cells = []
        for n in names:
            k = f", mean k {r[f'{n} mean k']:.2f}" if f"{n} mean k" in r else ""
            cells.append(f"{r[f'{n} vs best fixed']:.3f}x{k}")
        print(f"| {r['workload']} | {segments} | {r['max_k']} | {r['best_fixed_k']} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
