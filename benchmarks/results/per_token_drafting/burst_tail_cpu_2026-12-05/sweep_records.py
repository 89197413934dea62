"""Per-step records across a request-rate sweep's turns: for each round, each rate in turn,
speculation off and the default (the built-in draft, adaptive) taking turns, every step of
every run recorded (``specserve.bench.recorder``) — so that the steps a rate's run drafted
can be told apart by kind and placed in time, with the engines' state carried over from
the rates before, as in ``bench offline --request-rate-sweep``.

    python sweep_records.py --rates 2,inf --rounds 4 --json sweep_records.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
from step_records import checks

SETTINGS = {"off": {"speculative_method": "none"}, "adaptive": {"speculative_method": "draft_model"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--num-warmups", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rates", default="2,inf")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default="sweep_records.json")
    args = parser.parse_args()
    engines = {name: LLMEngine(**kwargs) for name, kwargs in SETTINGS.items()}
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
            for name in names[round_ % 2:] + names[:round_ % 2]:
                with recorders[name].recording():
                    run = run_offline(engines[name], requests, token_ids=ids, progress=False, label=name,
                                      arrivals=arrivals)
                steps = recorders[name].steps
                out["runs"].append({"workload": args.workload, "rate": rate, "round": round_, "setting": name,
                                    "output_throughput": run["output_throughput"], "duration": run["duration"],
                                    **{key: run.get(key) for key in ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
                                                                     "median_e2el_ms", "p99_e2el_ms")},
                                    "summary": summarise(steps, 20), "checks": checks(engines[name]),
                                    "steps": steps})
                print(f"round {round_} rate {rate} {name:9s} {run['output_throughput']:7.1f} tok/s, "
                      f"{len(steps)} steps, drafted {sum(1 for s in steps if s[2])}, mean latency "
                      f"{run.get('mean_e2el_ms') or 0:.0f} ms", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
