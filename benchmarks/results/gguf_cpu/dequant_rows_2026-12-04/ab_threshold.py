"""A/B of the decoder layers' unpacking threshold (2026-12-04): ``DEQUANT_ROWS`` (32, the
code before) against the count measured on this machine at load (as committed), on the
default model's quantized target, a few requests at a time: speculation off, fixed k = 4
with the built-in draft (verify steps of 8 x 5 = 40 rows) and the default. The thresholds
take turns within each round on the same engines.

    python ab_threshold.py [--concurrency 8] [--num-prompts 24] [--rounds 3] [--json out.json]
"""
import argparse
import json
import statistics

from specserve import LLMEngine
from specserve.bench.cli import describe_machine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.models.fused_cpu import FusedCpuLayers
from specserve.models.quantized import DEQUANT_ROWS, QuantLinear


def set_threshold(engine, rows: int) -> None:
    """Every decoder layer's projections of the target (and a draft model) unpack from ``rows`` on."""
    models = [engine.runner.model]
    drafter = engine.speculator.drafter
    if drafter is not None and getattr(drafter, "model", None) is not None:
        models.append(drafter.model)
    for model in models:
        heads = {id(getattr(model, "lm_head", None)), id(getattr(model, "vocab_head", None))}
        for module in model.modules():
            if isinstance(module, QuantLinear) and id(module) not in heads:
                module.dequant_rows = rows
        if getattr(model, "fused_cpu", None) is not None:
            model.fused_cpu = FusedCpuLayers.of(model)  # it holds the threshold


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="chat,code-edit")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engines = {"off": LLMEngine(speculative_method="none"),
               "k=4": LLMEngine(speculative_method="draft_model", speculative_adaptive=False),
               "default": LLMEngine(speculative_method="draft_model")}
    measured = next(m.dequant_rows for m in engines["off"].runner.model.model.layers[0].modules()
                    if isinstance(m, QuantLinear))
    thresholds = {"32 (before)": DEQUANT_ROWS, f"measured ({measured})": measured}
    print(f"{describe_machine()}; measured threshold {measured}", flush=True)
    runs = []
    for workload in args.workloads.split(","):
        requests = load_workload(workload, args.num_prompts, output_len=args.output_len,
                                 tokenizer=engines["off"].tokenizer)
        ids = prompt_ids(engines["off"], requests)
        for engine in engines.values():
            warm_up(engine, requests, ids, num_requests=args.concurrency)
        for round_ in range(args.rounds):
            names = list(thresholds)
            for label in names[round_ % 2:] + names[:round_ % 2]:
                for name, engine in engines.items():
                    set_threshold(engine, thresholds[label])
                    run = run_offline(engine, requests, token_ids=ids, progress=False, label=name,
                                      max_concurrency=args.concurrency)
                    row = {"workload": workload, "round": round_, "threshold": label, "setting": name,
                           "output_throughput": run["output_throughput"]}
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    print()
    print("| workload | setting | " + " | ".join(f"{t}, tok/s by round" for t in thresholds) + " | median ratio |")
    print("| --- | --- | " + " | ".join("---" for _ in thresholds) + " | ---: |")
    for workload in args.workloads.split(","):
        for name in engines:
            mine = [r for r in runs if r["workload"] == workload and r["setting"] == name]
            by = {t: [r["output_throughput"] for r in mine if r["threshold"] == t] for t in thresholds}
            before, after = by.values()
            ratios = [a / b for a, b in zip(after, before)]
            print(f"| {workload} | {name} | " + " | ".join(", ".join(f"{x:.1f}" for x in v) for v in by.values())
                  + f" | {statistics.median(ratios):.3f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe_machine(), "args": vars(args), "measured": measured, "runs": runs}, f,
                      indent=1)


if __name__ == "__main__":
    main()
