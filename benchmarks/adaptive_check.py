"""Adaptive speculation's realised-goodput check, shown at work: what it saves when the
controller's plan is wrong, and what it costs when the plan is right.

The failure it guards against was seen on an H200: the cost model let drafts through on
chat under load that ran ~0.8x speculation off. This benchmark makes that mistake on any
machine, and worse: its "eager plan" stands in a planner that always drafts the most it
may (a model that takes drafts for free), and runs it with the check and without — the
check alone then decides between drafting k and nothing. Beside them: speculation off,
fixed k, and adaptive as shipped. All requests arrive at once, so most steps run the full batch; the
settings take turns, each round starting with the next, and every engine is warmed up on
the workload first.

    python benchmarks/adaptive_check.py                          # chat and code-edit, 128 requests
    python benchmarks/adaptive_check.py --device cuda --num-prompts 384 --num-kv-blocks 4096
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import numpy as np
import torch

SETTINGS = {  # name -> (engine kwargs, controller attributes)
    "off": (dict(speculative_method="none"), {}),
    "fixed k": (dict(speculative_adaptive=False), {}),
    "adaptive": (dict(), {}),
    "eager plan, unchecked": (dict(), dict(check_goodput=False)),
    "eager plan, checked": (dict(), dict(check_goodput=True)),
}


def eager_plan(caps: dict[str, int], *_args) -> np.ndarray:
    """Every request drafts its cap: the plan of a cost model that takes drafts for free."""
    return np.fromiter(caps.values(), dtype=int, count=len(caps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="chat,code-edit")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-warmups", type=int, default=None,
                        help="warm-up requests per engine (default: the whole workload)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from specserve import LLMEngine
    from specserve.bench.offline import take_turns

    common = dict(speculative_method="ngram", num_speculative_tokens=args.k, max_num_seqs=args.max_num_seqs)
    for name in ("model", "dtype", "device"):
        if getattr(args, name):
            common[name] = getattr(args, name)
    if args.num_kv_blocks:
        common["num_kv_blocks"] = args.num_kv_blocks
    engines = {}
    for name, (kwargs, attributes) in SETTINGS.items():
        engine = LLMEngine(**{**common, **kwargs})
        for attribute, value in attributes.items():
            setattr(engine.controller, attribute, value)
        if name.startswith("eager"):
            engine.controller._plan = eager_plan  # the planner's one seam: a wrong model's plan
        engines[name] = engine
    results = {"machine": _machine(), "args": vars(args), "runs": []}
    for workload, round_, name, run in take_turns(engines, args.workloads.split(","), args.num_prompts,
                                                  args.output_len, args.rounds, args.num_warmups):
        controller = engines[name].controller
        checks = controller.checks if controller else {}
        row = {"workload": workload, "setting": name, "round": round_,
               "output_throughput": run["output_throughput"],
               "mean_tpot_ms": run["mean_tpot_ms"],
               "acceptance_length": run.get("spec_decode_acceptance_length"),
               "draft_lengths": run.get("spec_decode_draft_lengths"),
               "vetoed_kinds": sorted(str(kind) for kind, c in checks.items() if c.vetoed)}
        results["runs"].append(row)
        print(f"{workload:9s} round {round_} {name:22s} {run['output_throughput']:8.1f} tok/s", flush=True)
    print()
    print(table(results["runs"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def table(runs: list[dict]) -> str:
    lines = ["| workload | setting | output tok/s (each round) | median vs off | mean k |",
             "| --- | --- | --- | ---: | ---: |"]
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        off = statistics.median(r["output_throughput"] for r in mine if r["setting"] == "off")
        for setting in dict.fromkeys(r["setting"] for r in mine):
            rows = [r for r in mine if r["setting"] == setting]
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


def _machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


if __name__ == "__main__":
    sys.exit(main())
