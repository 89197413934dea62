"""A large batch's verdict by its goodput ratio (``GoodputCheck.verdict_steps``, as
committed) against by its z alone (the code before, ``verdict_steps`` 0), beside
speculation off, in one process: for each workload, each round, each request rate in
turn (as ``bench offline --request-rate-sweep``), the engines taking turns, every step
recorded. Prints tokens/s, steps, drafted steps, mean latency and each engine's verdicts.

    python ab_verdict.py --workload chat --rates 2,inf --rounds 3 --json ab_chat.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from specserve import LLMEngine
from specserve.bench.arrivals import arrival_times, parse_rates
from specserve.bench.cli import describe_machine
from specserve.bench.offline import prompt_ids, run_offline, warm_up
from specserve.bench.recorder import FIELDS, StepRecorder, summarise
from specserve.bench.workloads import load_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from step_records import checks

SETTINGS = {"off": ({"speculative_method": "none"}, None), "z rule": ({"speculative_method": "draft_model"}, 0),
            "ratio rule": ({"speculative_method": "draft_model"}, None)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--num-warmups", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rates", default="2,inf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="ab_verdict.json")
    args = parser.parse_args()
    engines = {}
    for name, (kwargs, verdict_steps) in SETTINGS.items():
        engines[name] = LLMEngine(**kwargs)
        if verdict_steps is not None:
            engines[name].speculator.controller.verdict_steps = verdict_steps
    recorders = {name: StepRecorder(engine) for name, engine in engines.items()}
    first = engines["off"]
    requests = load_workload(args.workload, args.num_prompts, output_len=args.output_len, tokenizer=first.tokenizer)
    ids = prompt_ids(first, requests)
    for engine in engines.values():
        warm_up(engine, requests, ids, num_requests=args.num_warmups)
    names = list(engines)
    out = {"machine": describe_machine(), "args": vars(args), "fields": list(FIELDS), "runs": []}
    for round_ in range(args.rounds):
        for rate in parse_rates(args.rates):
            arrivals = None if math.isinf(rate) else arrival_times(len(requests), rate)
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                with recorders[name].recording():
                    run = run_offline(engines[name], requests, token_ids=ids, progress=False, label=name,
                                      arrivals=arrivals)
                steps = recorders[name].steps
                out["runs"].append({"workload": args.workload, "rate": rate, "round": round_, "setting": name,
                                    "output_throughput": run["output_throughput"], "duration": run["duration"],
                                    "mean_e2el_ms": run.get("mean_e2el_ms"), "summary": summarise(steps, 20),
                                    "checks": checks(engines[name]),
                                    **({"steps": steps} if math.isinf(rate) else {})})
                print(f"round {round_} rate {rate} {name:10s} {run['output_throughput']:7.1f} tok/s, "
                      f"{len(steps)} steps, drafted {sum(1 for s in steps if s[2])}, mean latency "
                      f"{run.get('mean_e2el_ms') or 0:.0f} ms", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
