"""What a verify step of the default model's quantized target costs on this CPU as its rows
cross ``QuantLinear.dequant_rows`` (2026-12-04): N requests of 200 tokens of context, each
feeding 1 + k tokens (k drafts), timed with the threshold at several values (the layer
unpacks its weight for a library GEMM from that many rows on; a large value: never), for
the decoder layers' projections (``--which layers``, the head's threshold left as it is) or
for the LM head (``--which head``, the layers' left), or for all of them (``--which all``).

    python verify_rows.py [--which layers|head|all] [--requests 24] [--rows 24,32,40] [--thresholds 32,48,100000]
"""
import argparse
import json
import statistics
import time

import torch

from specserve import LLMEngine, SamplingParams
from specserve.bench.cli import describe_machine
from specserve.models.fused_cpu import FusedCpuLayers
from specserve.models.quantized import QuantLinear
from specserve.scheduler import ScheduledRequest, SchedulerOutput


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--which", choices=("layers", "head", "all"), default="layers")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rows", default="24,28,32,36,40,44,48,56,64,72",
                        help="rows a step feeds (the requests' spans differ by at most one)")
    parser.add_argument("--thresholds", default="32,48,64,100000")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    engine = LLMEngine(speculative_method="none")
    runner = engine.runner
    head = runner.model.vocab_head if runner.model.vocab_ids is not None else runner.model.lm_head
    layers = [m for m in runner.model.modules() if isinstance(m, QuantLinear) and (args.which == "all" or (m is head) == (args.which == "head"))]
    block = engine.config.block_size
    per_req = -(-(args.context + 8) // block)
    params = SamplingParams(temperature=0)
    out = {"machine": describe_machine(), "threads": torch.get_num_threads(), "args": vars(args), "rows": []}
    print(f"{describe_machine()}, {torch.get_num_threads()} threads, {len(layers)} quantized layers ({args.which})")
    thresholds = [int(t) for t in args.thresholds.split(",")]
    print("| rows | " + " | ".join(f"from {t} rows, ms" if t < 10**5 else "never, ms" for t in thresholds) + " |")
    print("| ---: | " + " | ".join("---:" for _ in thresholds) + " |")
    for rows in (int(r) for r in args.rows.split(",")):
        n = min(args.requests, rows)
        spans = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
        entries = [ScheduledRequest(f"r{i}", [100 + i], args.context, list(range(i * per_req, (i + 1) * per_req)),
                                    params, draft_token_ids=[200 + j for j in range(span - 1)])
                   for i, span in enumerate(spans)]
        step = SchedulerOutput(entries, [])
        times = {}
        for t in thresholds:
            for layer in layers:
                layer.dequant_rows = t
            runner.model.fused_cpu = FusedCpuLayers.of(runner.model)  # it holds the threshold
            runner.execute(step)  # warm
            samples = []
            for _ in range(args.reps):
                start = time.perf_counter()
                runner.execute(step)
                samples.append(time.perf_counter() - start)
            times[t] = 1e3 * statistics.median(samples)
        out["rows"].append({"rows": rows, "ms": times})
        print(f"| {rows} | " + " | ".join(f"{times[t]:.1f}" for t in thresholds) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
