"""Where a run's time went, from `benchmarks/step_records.py`'s JSON (or this folder's
`sweep_records.py`'s): per run, the wall
time, the steps' own seconds and the gaps between them; per kind of step (plain, drafted,
with a prompt chunk) the steps, seconds, emitted tokens and goodput; and by batch size the
goodput of steps with and without drafts (no prompt chunk).

    python analyse.py records_chat_inf.json [more.json ...]
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def kind(step: dict) -> str:
    prefill, drafted = step["prefill_tokens"] > 0, step["drafts"] > 0
    return ("prefill+drafted" if drafted else "prefill") if prefill else ("drafted" if drafted else "plain")


def _rate(b: list) -> str:
    return f"{b[2] / b[1]:6.0f}" if b[1] else "     -"


def analyse(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    fields = data["fields"]
    print(f"# {path}: {data['args']['num_prompts']} prompts")
    for run in data["runs"]:
        if "steps" not in run:  # (sweep_records.json keeps the all-at-once runs' steps only)
            continue
        steps = [dict(zip(fields, s)) for s in run["steps"]]
        step_s = sum(s["step_s"] for s in steps)
        emitted = sum(s["emitted"] for s in steps)
        rate = run.get("rate", data["args"].get("request_rate"))
        print(f"\n{run['workload']} at {rate} req/s, round {run['round']} {run['setting']}: "
              f"{run['output_throughput']:.0f} tok/s, "
              f"{run['duration']:.3f} s wall, steps {len(steps)} taking {step_s:.3f} s "
              f"(gaps {run['duration'] - step_s:.3f} s), emitted {emitted}, TTFT {run.get('mean_ttft_ms') or 0:.0f} ms")
        by_kind = defaultdict(lambda: [0, 0.0, 0, 0, 0, 0])
        for s in steps:
            k = by_kind[kind(s)]
            k[0] += 1
            k[1] += s["step_s"]
            k[2] += s["emitted"]
            k[3] += s["requests"]
            k[4] += s["drafts"]
            k[5] += s["prefill_tokens"]
        for name, (n, sec, tok, reqs, drafts, prefill) in sorted(by_kind.items()):
            print(f"  {name:16s} {n:5d} steps {sec:7.3f} s ({1e3 * sec / n:6.2f} ms) emitted {tok:6d} "
                  f"({tok / sec:8.0f} tok/s) mean batch {reqs / n:5.1f} drafts/step {drafts / n:6.1f} "
                  f"prefill/step {prefill / n:6.1f}")
        bins = defaultdict(lambda: [[0, 0.0, 0, 0], [0, 0.0, 0, 0]])
        for s in steps:
            if s["prefill_tokens"]:
                continue
            b = bins[int(s["requests"]).bit_length()][s["drafts"] > 0]
            b[0] += 1
            b[1] += s["step_s"]
            b[2] += s["emitted"]
            b[3] += s["drafts"]
        line = []
        for size in sorted(bins):
            plain, drafted = bins[size]
            rate = lambda b: f"{b[2] / b[1]:6.0f}" if b[1] else "     -"
            line.append(f"{1 << (size - 1)}+: plain {plain[0]} {_rate(plain)}, drafted {drafted[0]} {_rate(drafted)}")
        print("  by batch (tok/s, no chunk): " + "; ".join(line))
        if run.get("checks"):
            print("  checks: " + "; ".join(f"{k} r={v['ratio']:.2f} z={v['z']:.1f} veto={int(v['vetoed'])} "
                                           f"steps={v['steps']} checks={v['checks']}" for k, v in run["checks"].items()))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        analyse(arg)
