"""The adaptive plan's choices of k against every fixed k, on simulated batch-1 steps
(``specserve.bench.plan_sim``): no host time, no machine noise, the same texts for every
policy, so what is left is what the choices themselves cost or gain.

Workloads: chat-like (acceptance drawn from 0.3–0.85), code-like (0.6–0.98) and switching
(0.1 or 0.95, as copied spans and fresh text take turns), each with one acceptance per
request and with segments of 20 tokens on average; with ``--traces``, the real outputs of
held-out chat and code prompts (whether the draft's token matched at each position,
``benchmarks/acceptance_traces.py``). Caps of 4 and 6 drafts. Policies: fixed k =
0…cap, the plan as it is, the plan with the settings before 2026-12-01 (``--before``:
checks spread by 8 per standard error, plans standing at most 8 steps), the plan as
before 2026-12-03 (``--before-settling``: estimates at a constant weight of 0.3, the
drafter's cost per pass only), the plan with constant per-request acceptance weights
(``--smoothing W,...``), the plan with other margins (``--margins M,...``: the goodput
a plan with drafts must promise over none), and an oracle that knows each segment's acceptance (not for
real outputs). Ratios are to the best fixed k (at most the cap) of the same texts,
averaged over ``--seeds``.

    python benchmarks/plan_simulation.py [--seeds 4] [--requests 300] [--before] [--before-settling]
        [--smoothing 0.1] [--margins 0.1] [--traces traces.json] [--json out.json]
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


@contextmanager
def before_settling():
    """The plan as before 2026-12-03: a constant acceptance weight of 0.3, and the drafter's
    time fitted over its passes alone (no cost of drafting at all)."""
    from dataclasses import replace

    from specserve.spec import cost_model

    saved = cost_model.StepCosts.observe

    def observe(self, sample):
        saved(self, replace(sample, depth=0))  # the target's part as it is
        passes = sample.depth - self.first_free
        if passes > 0:
            self.draft.observe([0.0, 0.0, passes, passes * sample.num_drafting], sample.draft_s)

    cost_model.StepCosts.observe = observe
    try:
        with settings({"specserve.spec.acceptance": {"ACCEPT_SMOOTHING": 0.3, "ACCEPT_SMOOTHING_SETTLED": 0.3}}):
            yield
    finally:
        cost_model.StepCosts.observe = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--before", action="store_true", help="also the plan with the settings before 2026-12-01")
    parser.add_argument("--before-settling", action="store_true",
                        help="also the plan as before 2026-12-03: every estimate moving 0.3 of the way to each "
                             "outcome, and the drafter's cost fitted per pass only")
    parser.add_argument("--smoothing", default="",
                        help="also the plan with each of these (comma-separated) constant per-request acceptance "
                             "weights")
    parser.add_argument("--margins", default="",
                        help="also the plan with each of these (comma-separated) margins: the goodput a plan with "
                             "drafts must promise over none (MIN_GAIN)")
    parser.add_argument("--traces", default=None,
                        help="also real acceptance traces (benchmarks/acceptance_traces.py's JSON): each seed "
                             "takes the outputs in another order")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from specserve.bench.plan_sim import simulate

    weights = [float(w) for w in args.smoothing.split(",") if w]
    cases = [(workload, segment, {"acceptance": acceptance, "segment": segment, "switching": switching})
             for workload, (acceptance, switching) in WORKLOADS.items() for segment in (0, 20)]
    traces = json.loads(Path(args.traces).read_text())["traces"] if args.traces else {}
    cases += [(f"{kind}, real", -1, {"traces": outputs}) for kind, outputs in traces.items()]
    policies = {"plan": None, **({"plan, before": BEFORE} if args.before else {}),
                **({"plan, before settling": "settling"} if args.before_settling else {}),
                **{f"plan, weight {w}": {"specserve.spec.acceptance": {
                    "ACCEPT_SMOOTHING": w, "ACCEPT_SMOOTHING_SETTLED": w}} for w in weights},
                **{f"plan, margin {m:g}": {"specserve.spec.controller": {"MIN_GAIN": m}}
                   for m in (float(m) for m in args.margins.split(",") if m)},
                "oracle": None}
    rows = []
    for workload, segment, case in cases:
        for max_k in (4, 6):
            ratios: dict[str, list[float]] = {}
            means: dict[str, list[float]] = {}
            bests = []
            for seed in range(args.seeds):
                run = {**case, "requests": args.requests, "seed": seed}
                if "traces" in case:  # each seed its own order of the outputs
                    shift = seed * len(case["traces"]) // args.seeds
                    run["traces"] = case["traces"][shift:] + case["traces"][:shift]
                fixed = {k: simulate(k, max_k=max_k, **run)[0] for k in range(max_k + 1)}
                bests.append(max(fixed, key=fixed.get))
                for name, values in policies.items():
                    if name == "oracle" and "traces" in case:
                        continue  # it would know every token
                    with before_settling() if values == "settling" else settings(values or {}):
                        rate, mean_k = simulate("oracle" if name == "oracle" else "plan", max_k=max_k, **run)
                    ratios.setdefault(name, []).append(rate / max(fixed.values()))
                    means.setdefault(name, []).append(mean_k)
            row = {"workload": workload, "segment": segment, "max_k": max_k, "best_fixed_k": statistics.mode(bests),
                   **{f"{name} vs best fixed": round(statistics.mean(v), 3) for name, v in ratios.items()},
                   **{f"{name} mean k": round(statistics.mean(v), 2) for name, v in means.items()
                      if name != "oracle"}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    names = [name for name in policies if any(f"{name} vs best fixed" in r for r in rows)]
    print(f"\nSimulated batch-1 steps (H200 costs of the default model and its draft), {args.requests} requests, "
          f"{args.seeds} seeds; ratios to the best fixed k of the same texts\n")
    print("| workload | segments | cap | best fixed k | " + " | ".join(names) + " |")
    print("| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for r in rows:
        segments = "real outputs" if r["segment"] < 0 else f"~{r['segment']} tokens" if r["segment"] else \
            "one per request"
        cells = []
        for n in names:
            k = f", mean k {r[f'{n} mean k']:.2f}" if f"{n} mean k" in r else ""
            cells.append(f"{r[f'{n} vs best fixed']:.3f}x{k}" if f"{n} vs best fixed" in r else "")
        print(f"| {r['workload']} | {segments} | {r['max_k']} | {r['best_fixed_k']} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
