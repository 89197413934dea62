"""Ragged CUDA graphs for steps with prefill chunks: what they save under load.

Under load most steps admit a new request, so a prefill chunk shares the step with every
running request's decode or verify rows. Such a step does not fit a padded decode graph;
run eagerly, its few hundred kernel launches from Python cost several times a decode
step. This benchmark runs the same workload (all requests at once, ``--max-num-seqs``
running) on two engines that differ only in ``cuda_graph_max_tokens``: 0 (steps with
prefill chunks run eagerly, as before ragged graphs) and the default (they replay ragged
graphs). Per round and engine: output tokens/s, mean TTFT, and the mean wall time of a
step with a prefill chunk and of one without. The engines take turns, each round
starting with the next, after a warm-up on the workload.

    python benchmarks/graph_steps.py --num-prompts 384 --num-kv-blocks 4096          # a CUDA device
    python benchmarks/graph_steps.py --speculation ngram:4 ...   # the same with n-gram drafts, k = 4

Without a CUDA device there are no graphs: both engines run the same eager steps.
"""
from __future__ import annotations

import argparse
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from specserve.bench.offline import add_turns_flags, engine_flags, report, take_turns
    from specserve.bench.recorder import FIELDS, StepRecorder

    add_turns_flags(parser, num_prompts=384)
    parser.add_argument("--speculation", default="none",
                        help="none, or METHOD:K (fixed k) for the drafter both engines run")
    args = parser.parse_args(argv)

    from specserve import LLMEngine
    from specserve.bench.cli import describe_machine

    common = engine_flags(args)
    if args.speculation != "none":
        method, k = args.speculation.split(":")
        common.update(speculative_method=method, num_speculative_tokens=int(k), speculative_adaptive=False)
    engines = {"prefill steps eager": LLMEngine(**common, cuda_graph_max_tokens=0),
               "ragged graphs": LLMEngine(**common)}
    recorders = {name: StepRecorder(engine) for name, engine in engines.items()}
    prefill, seconds = FIELDS.index("prefill_tokens"), FIELDS.index("step_s")
    results = {"machine": describe_machine(), "args": vars(args), "runs": []}
    for workload, round_, name, run in take_turns(engines, args.workloads.split(","), args.num_prompts,
                                                  args.output_len, args.rounds,
                                                  around=lambda name: recorders[name].recording()):
        timed = recorders[name].steps
        mixed = [s[seconds] for s in timed if s[prefill] > 0]
        plain = [s[seconds] for s in timed if s[prefill] == 0]
        row = {"workload": workload, "setting": name, "round": round_,
               "output_throughput": run["output_throughput"], "mean_ttft_ms": run["mean_ttft_ms"],
               "num_steps": len(timed), "num_prefill_steps": len(mixed),
               "prefill_step_ms": 1e3 * statistics.fmean(mixed) if mixed else None,
               "decode_step_ms": 1e3 * statistics.fmean(plain) if plain else None}
        results["runs"].append(row)
        print(f"{workload:9s} round {round_} {name:20s} {row['output_throughput']:9.1f} tok/s", flush=True)
    report(results, table(results["runs"]), args.json)
    return 0


def table(runs: list[dict]) -> str:
    lines = ["| workload | prefill steps | output tok/s (each round) | vs eager | mean TTFT ms | "
             "step ms, with prefill / without | steps (with prefill) |",
             "| --- | --- | --- | ---: | ---: | --- | --- |"]
    from specserve.bench.offline import by_setting

    for workload, setting, rows, base in by_setting(runs, "prefill steps eager"):
        tps = [r["output_throughput"] for r in rows]
        mixed = [r["prefill_step_ms"] for r in rows if r["prefill_step_ms"] is not None]
        plain = [r["decode_step_ms"] for r in rows if r["decode_step_ms"] is not None]
        lines.append(
            f"| {workload} | {'eager' if setting.endswith('eager') else 'ragged graphs'} | "
            f"{' / '.join(f'{t:,.0f}' for t in tps)} | {statistics.median(tps) / base:.2f}x | "
            f"{statistics.median(r['mean_ttft_ms'] for r in rows):.1f} | "
            f"{statistics.median(mixed) if mixed else float('nan'):.2f} / "
            f"{statistics.median(plain) if plain else float('nan'):.2f} | "
            f"{rows[0]['num_steps']} ({rows[0]['num_prefill_steps']}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
