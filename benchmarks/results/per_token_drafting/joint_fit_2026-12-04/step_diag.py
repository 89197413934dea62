"""What a further draft adds to a step at batch 1, against what the adaptive engine's cost
model prices it at.

For fixed k = 0..6 (one engine, speculation not adaptive, the request's own k) and the
GPU default ("adaptive, no stopping", cap 4): every decode step's wall time
(``LLMEngine.step``; the sampler's read synchronises the device) and the k it verified.
Per k the median step, the slope over k >= 1 (what a further draft adds), and the
adaptive engine's fitted step cost per depth at batch 1 (what its plan pays).

    OUT=. python step_diag.py chat,code
"""
import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import itertools

import numpy as np
from workloads import run_cold

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.engine import LLMEngine
from specserve.spec.cost_model import draft_features, target_features
from specserve.spec.speculator import Speculator

out = os.environ.get("OUT", "/tmp")
steps: list[dict] = []
last: dict = {}
orig_step, orig_propose = LLMEngine.step, Speculator.propose


def step(self):
    last.clear()
    began = time.perf_counter()
    result = orig_step(self)
    if "k" in last:
        steps.append(dict(last, wall=time.perf_counter() - began))
    return result


def propose(self, scheduled, scheduler):
    drafts = orig_propose(self, scheduled, scheduler)
    planned = [p for p in scheduled.scheduled if p.sample]
    if len(planned) == 1 and len(planned[0].token_ids) == 1:  # a decode step of one request
        last.update(k=len(planned[0].draft_token_ids), context=planned[0].start_pos)
    return drafts


def thetas(costs):
    """The target's and the drafter's fitted costs: one fit (the patch) or two (fadfefc on)."""
    if hasattr(costs, "fit"):
        return costs.target_theta, costs.draft_theta
    return costs.target.theta, costs.draft.theta


def priced(costs, depth, context):
    """The fit's batch-1 step of draft depth ``depth`` (a CUDA graph: padded to 1 + k)."""
    drafter = draft_features(costs.drafter_passes(depth), 1) if depth else [0.0] * 3
    target, draft = thetas(costs)
    return float(np.dot(target, target_features(1 + depth, 1, context, 1 if depth else 0, 1 + depth))
                 + np.dot(draft, drafter))


LLMEngine.step, Speculator.propose = step, propose
dev = os.environ.get("DEV", "cuda")
common = dict(device=dev, max_num_seqs=8, max_model_len=4096, speculative_method="draft_model",
              **({"gpu_memory_utilization": 0.15} if dev == "cuda" else {}))
engines = {"fixed": LLM(num_speculative_tokens=6, speculative_adaptive=False, **common),
           "adaptive": LLM(num_speculative_tokens=4, draft_stopping="plan", **common)}
settings = [("fixed", k) for k in (0, 1, 2, 3, 4, 6)] + [("adaptive", None)]
report = {}
for kind in sys.argv[1].split(","):
    tok = engines["fixed"].engine.tokenizer
    prompts = chat_prompts(tok, held_out_prompts(kind, int(os.environ.get("NP", "6"))))
    for llm in engines.values():
        run_cold(llm, prompts[0], SamplingParams(temperature=0, max_tokens=16))
    by_setting = collections.defaultdict(list)
    for i, p in enumerate(prompts):  # settings take turns prompt by prompt
        for j in range(len(settings)):
            name, k = settings[(i + j) % len(settings)]
            params = SamplingParams(temperature=0, max_tokens=128, **({} if k is None else {"num_speculative_tokens": k}))
            steps.clear()
            run_cold(engines[name], p, params)
            by_setting[f"k={k}" if k is not None else "adaptive"] += list(steps)
    rows = {}
    for label, samples in by_setting.items():
        per_k = collections.defaultdict(list)
        for s in samples:
            per_k[s["k"]].append(s["wall"])
        rows[label] = {k: {"n": len(v), "wall_us": round(1e6 * statistics.median(v), 1)} for k, v in sorted(per_k.items())}
    fixed = [(int(label[2:]), r[int(label[2:])]) for label, r in rows.items()
             if label.startswith("k=") and int(label[2:]) in r]
    ks = np.array([k for k, _ in fixed if k > 0], dtype=float)
    slope = float(np.polyfit(ks, [r["wall_us"] for k, r in fixed if k > 0], 1)[0])
    context = int(statistics.median(s["context"] for s in by_setting["adaptive"]))
    costs = engines["adaptive"].engine.speculator.controller.costs
    fit = [round(1e6 * priced(costs, d, context), 1) for d in range(7)]
    print(f"{kind}: fixed k, median step: " + "; ".join(f"k={k}: {r['wall_us']} us (n={r['n']})" for k, r in fixed))
    print(f"  a further draft adds {slope:.1f} us (slope over k >= 1)")
    print(f"  adaptive engine's steps by k: {rows['adaptive']}")
    print(f"  adaptive engine's fit, batch-1 step by depth 0..6 at context {context}: {fit} us; "
          f"per further depth {[round(b - a, 1) for a, b in itertools.pairwise(fit[1:])]}")
    target, draft = thetas(costs)
    print(f"  theta (us): target {np.round(1e6 * target, 1).tolist()}, "
          f"drafter (o, d, e) {np.round(1e6 * draft, 1).tolist()}")
    report[kind] = {"rows": rows, "slope_us": slope, "fit_us": fit, "context": context,
                    "target_theta_us": (1e6 * target).tolist(), "drafter_theta_us": (1e6 * draft).tolist()}
with open(f"{out}/step_diag_{os.environ.get('TAG', 'x')}.json", "w") as f:
    json.dump(report, f, indent=1)
