"""Adaptive speculation's realised-goodput check, shown at work: what it saves when the
controller's plan is wrong, and what it costs when the plan is right.

The failure it guards against was seen on an H200: the cost model let drafts through on
chat under load that ran ~0.8x speculation off. This benchmark makes that mistake on any
machine, and worse: its "eager plan" stands in a planner that always drafts the most it
may (a model that takes drafts for free), and runs it with the check and without — the
check alone then decides between drafting k and nothing. Beside them: speculation off,
fixed k, adaptive as shipped, and adaptive with the plan's bar left as measured where its
drafts delivered more than promised (``GoodputCheck.promise``). All requests arrive at
once, so most steps run the full batch; the settings take turns, each round starting with
the next, and every engine is warmed up on the workload first.

    python benchmarks/adaptive_check.py                          # chat and code-edit, 128 requests
    python benchmarks/adaptive_check.py --device cuda --num-prompts 384 --num-kv-blocks 4096
    python benchmarks/adaptive_check.py --settings "fixed k;adaptive" --rounds 6   # off beside them
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

SETTINGS = {  # name -> (engine kwargs, controller attributes)
    "off": (dict(speculative_method="none"), {}),
    "fixed k": (dict(speculative_adaptive=False), {}),
    "adaptive": (dict(), {}),
    "adaptive, promises ignored": ({}, {"keep_promises": False}),  # the bar as measured (GoodputCheck.promise)
    "eager plan, unchecked": (dict(), dict(check_goodput=False)),
    "eager plan, checked": (dict(), dict(check_goodput=True)),
}


def eager_plan(caps: dict[str, int], *_args) -> tuple[np.ndarray, set[str], None, float]:
    """Every request drafts its cap (and verifies every draft path it may): the plan of a
    cost model that takes drafts for free (and knows no prices: n-gram drafts need none,
    and it promises nothing)."""
    return np.fromiter(caps.values(), dtype=int, count=len(caps)), set(), None, 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from specserve.bench.offline import (add_settings_flags, add_turns_flags, chosen_settings,
                                         engine_flags, report, take_turns)

    add_turns_flags(parser, num_prompts=128)
    add_settings_flags(parser, SETTINGS, note="; off always runs")
    args = parser.parse_args(argv)
    chosen = chosen_settings(parser, args, SETTINGS, always="off")

    from specserve import LLMEngine
    from specserve.bench.cli import describe_machine

    common = engine_flags(args, speculative_method="ngram", num_speculative_tokens=args.k)
    engines = {}
    for name in chosen:
        kwargs, attributes = SETTINGS[name]
        engine = LLMEngine(**{**common, **kwargs})
        for attribute, value in attributes.items():
            setattr(engine.speculator.controller, attribute, value)
        if name.startswith("eager"):
            engine.speculator.controller._plan = eager_plan  # the planner's one seam: a wrong model's plan
        engines[name] = engine
    results = {"machine": describe_machine(), "args": vars(args), "runs": []}
    for workload, round_, name, run in take_turns(engines, args.workloads.split(","), args.num_prompts,
                                                  args.output_len, args.rounds, args.num_warmups):
        controller = engines[name].speculator.controller
        checks = controller.checks if controller else {}
        row = {"workload": workload, "setting": name, "round": round_,
               "output_throughput": run["output_throughput"],
               "mean_tpot_ms": run["mean_tpot_ms"],
               "acceptance_length": run.get("spec_decode_acceptance_length"),
               "draft_lengths": run.get("spec_decode_draft_lengths"),
               "vetoed_kinds": sorted(str(kind) for kind, c in checks.items() if c.vetoed)}
        results["runs"].append(row)
        print(f"{workload:9s} round {round_} {name:22s} {run['output_throughput']:8.1f} tok/s", flush=True)
    report(results, table(results["runs"]), args.json)
    return 0


def table(runs: list[dict]) -> str:
    lines = ["| workload | setting | output tok/s (each round) | median vs off | mean k |",
             "| --- | --- | --- | ---: | ---: |"]
    from specserve.bench.offline import by_setting

    for workload, setting, rows, off in by_setting(runs, "off"):
        tps = [r["output_throughput"] for r in rows]
        lengths: dict[str, int] = {}
        for r in rows:
            for k, n in (r["draft_lengths"] or {}).items():
                lengths[k] = lengths.get(k, 0) + n
        total = sum(lengths.values())
        mean_k = f"{sum(int(k) * n for k, n in lengths.items()) / total:.2f}" if total else ""
        lines.append(f"| {workload} | {setting} | {' / '.join(f'{t:,.1f}' for t in tps)} | "
                     f"{statistics.median(tps) / off:.2f}x | {mean_k} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
