"""Where the time goes under load, step by step: speculation off, fixed k and adaptive
with every request queued, each engine step recorded — its requests, prefill tokens,
drafts, emitted tokens, wall time, the verify pass's time, and the host phases around it
(choosing k, scheduling, update, postprocess, the controller's bookkeeping, garbage
collection) — and summarised per run by kind of step (plain, drafted, with a prefill
chunk, both) and, for full plain steps, by phase.

Throughput at max load moves by 10–30 % with a GPU host from run to run; a step's
records show what moved, and what one setting adds to the same kind of step. The
settings take turns over the rounds, as in ``adaptive_check.py``.

    python benchmarks/step_records.py                                   # CPU, chat, 128 requests
    python benchmarks/step_records.py --device cuda --num-prompts 384 --num-kv-blocks 4096 --rounds 3
    python benchmarks/step_records.py --device cuda --method draft_model --num-prompts 192
    python benchmarks/step_records.py --device cuda --method draft_model --request-rate 256
"""
from __future__ import annotations

import argparse
import math
import sys

SETTINGS = {  # name -> engine kwargs beside the speculation method (``--method``)
    "off": dict(speculative_method="none"),
    "fixed k": dict(speculative_adaptive=False),
    "adaptive": dict(),
    "adaptive, promises ignored": {},
}
CONTROLLER = {  # name -> controller attributes set after the engine is made
    "adaptive, promises ignored": {"keep_promises": False},  # the plan's bar as measured (GoodputCheck.promise)
}
SETUP: dict = {}  # name -> a function of the engine, called once it is made (a study's own settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from specserve.bench.offline import (
        add_settings_flags,
        add_turns_flags,
        chosen_settings,
        engine_flags,
        report,
        take_turns,
    )
    from specserve.bench.recorder import FIELDS, StepRecorder, summarise

    add_turns_flags(parser, num_prompts=128)
    parser.set_defaults(workloads="chat")
    add_settings_flags(parser, SETTINGS, note=" but 'adaptive, promises ignored'")
    parser.set_defaults(settings="off;fixed k;adaptive")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals, as `bench offline`'s); default: all at once")
    parser.add_argument("--method", default="ngram", help="the speculation method of the fixed-k and "
                        "adaptive settings (ngram, draft_model: the default model's built-in draft, ...)")
    args = parser.parse_args(argv)
    chosen = chosen_settings(parser, args, SETTINGS)

    from specserve import LLMEngine
    from specserve.bench.arrivals import arrival_times, check_rate
    from specserve.bench.cli import describe_machine

    try:
        check_rate(args.request_rate)
    except ValueError as e:
        parser.error(str(e))
    arrivals = None if math.isinf(args.request_rate) else arrival_times(args.num_prompts, args.request_rate)

    common = engine_flags(args, speculative_method=args.method, num_speculative_tokens=args.k)
    engines = {name: LLMEngine(**{**common, **SETTINGS[name]}) for name in chosen}
    for name, attributes in CONTROLLER.items():
        for attribute, value in attributes.items() if name in engines else ():
            setattr(engines[name].speculator.controller, attribute, value)
    for name, setup in SETUP.items():
        if name in engines:
            setup(engines[name])
    recorders = {name: StepRecorder(engine) for name, engine in engines.items()}
    full_batch = int(0.9 * args.max_num_seqs)

    results = {"machine": describe_machine(), "args": vars(args), "fields": list(FIELDS), "runs": []}
    for workload, round_, name, run in take_turns(engines, args.workloads.split(","), args.num_prompts,
                                                  args.output_len, args.rounds, args.num_warmups,
                                                  lambda name: recorders[name].recording(), arrivals=arrivals):
        steps = recorders[name].steps
        results["runs"].append({"workload": workload, "setting": name, "round": round_,
                                "output_throughput": run["output_throughput"], "duration": run["duration"],
                                "recorded_s": recorders[name].seconds,
                                "mean_ttft_ms": run.get("mean_ttft_ms"),
                                "summary": summarise(steps, full_batch), "checks": checks(engines[name]),
                                "steps": steps})
        print(f"{workload:9s} round {round_} {name:9s} {run['output_throughput']:9.1f} tok/s "
              f"{len(steps)} steps", flush=True)
    report(results, table(results["runs"]), args.json)
    return 0


def checks(engine) -> dict:
    """The goodput check of each kind of step (padded, with a prompt chunk, batch size's
    bit length) as it stands after a run: its ratio, z, veto, steps per side, checks and
    promise factor."""
    controller = engine.speculator.controller
    if controller is None:
        return {}
    return {str(kind): {"ratio": check.ratio, "z": check.z, "vetoed": check.vetoed,
                        "steps": list(check.steps_seen), "checks": check.num_checks, "promise": check.promise}
            for kind, check in controller.checks.items()}


def table(runs: list[dict]) -> str:
    from specserve.bench.recorder import PHASES

    lines = ["| workload | round | setting | tok/s | steps: plain / drafted / prefill / prefill+drafted "
             "(count, mean ms) | full plain step µs: step, verify | choose, schedule, update, "
             "postprocess, controller, gc |", "| --- | ---: | --- | ---: | --- | --- | --- |"]
    for r in runs:
        s = r["summary"]
        kinds = " / ".join(f"{k['steps']}, {k['mean_ms']:.2f}" if k else "-"
                           for k in (s["kinds"].get(n) for n in ("plain", "drafted", "prefill", "prefill+drafted")))
        full = s.get("full_plain_us")
        main_us = f"{full['step_s']:.0f}, {full['verify_s']:.0f}" if full else ""
        phases = ", ".join(f"{full[p]:.0f}" for p in PHASES) if full else ""
        lines.append(f"| {r['workload']} | {r['round']} | {r['setting']} | {r['output_throughput']:,.1f} | "
                     f"{kinds} | {main_us} | {phases} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
