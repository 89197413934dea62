"""The switching workload (acceptance 0.1 or 0.95, as copied spans and fresh text take
turns) on n-gram lookup's costs: no draft passes, 0.02 ms a drafting step; the plan
against the plan before settling, 4 seeds of 300 requests, ratios to the best fixed k.

    python benchmarks/results/plan_simulation/switching_ngram_costs.py
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import plan_simulation

from specserve.bench.plan_sim import StepCosts, simulate

NGRAM = StepCosts(draft_pass=0.0, draft_fixed=0.02e-3)

for name, context in (("plan", None), ("plan, before settling", plan_simulation.before_settling)):
    ratios = {}
    for segment in (0, 20):
        per_seed = []
        for seed in range(4):
            run = {"requests": 300, "segment": segment, "seed": seed, "acceptance": (0.1, 0.95),
                   "switching": True, "costs": NGRAM}
            best = max(simulate(k, **run)[0] for k in range(5))
            if context is None:
                rate = simulate("plan", **run)[0]
            else:
                with context():
                    rate = simulate("plan", **run)[0]
            per_seed.append(rate / best)
        ratios["one per request" if segment == 0 else f"~{segment} tokens"] = round(statistics.mean(per_seed), 3)
    print(name, ratios)
