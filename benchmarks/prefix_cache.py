"""Prefix caching on against off, on the workloads that share prefixes and on one that
does not: time to first token (median and p99), output throughput and the cache's hit
rate, in one run.

Workloads (``specserve.bench.workloads``): ``shared-prefix`` (chat questions behind one
long system prompt), ``multi-turn`` (four-turn chats, each turn resending the whole
conversation with the model's answers, sent once the answer before it has come) and
``chat`` (single questions: what hashing costs where nothing is shared). Requests keep at
most ``--max-concurrency`` in flight, greedy, EOS ignored; the two engines take turns,
each round starting with the other, both warmed up on the workload first, and every run
starts with an empty prefix cache. Greedy outputs are compared between the two in each
round, and between the first two rounds of caching off: in bfloat16 a batch's make-up
changes its rounding, so that is the agreement to expect (float32 compares exactly).

    python benchmarks/prefix_cache.py                            # CPU, the default model
    python benchmarks/prefix_cache.py --device cuda --num-prompts 64 --max-concurrency 16
    python benchmarks/prefix_cache.py --speculative-method draft_model
"""
from __future__ import annotations

import argparse
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from specserve.bench.offline import add_turns_flags, engine_flags, report, take_turns

    add_turns_flags(parser, num_prompts=16)
    parser.set_defaults(workloads="shared-prefix,multi-turn,chat", output_len=64)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--num-warmups", type=int, default=4)
    parser.add_argument("--speculative-method", default="none")
    args = parser.parse_args(argv)

    from specserve import LLMEngine
    from specserve.bench.cli import describe_machine

    common = engine_flags(args, speculative_method=args.speculative_method)
    engines = {"cache off": LLMEngine(**common, enable_prefix_caching=False),
               "cache on": LLMEngine(**common, enable_prefix_caching=True)}
    results = {"machine": describe_machine(), "args": vars(args), "runs": []}
    outputs: dict[tuple[str, str, int], list] = {}
    for workload, round_, name, run in take_turns(engines, args.workloads.split(","), args.num_prompts,
                                                  args.output_len, args.rounds, args.num_warmups,
                                                  max_concurrency=args.max_concurrency, ignore_eos=True):
        outputs[(workload, name, round_)] = run["output_token_ids"]
        row = {"workload": workload, "setting": name, "round": round_,
               "output_throughput": run["output_throughput"], "median_ttft_ms": run["median_ttft_ms"],
               "p99_ttft_ms": run["p99_ttft_ms"], "total_input_tokens": run["total_input_tokens"],
               "prefix_cache_hit_rate": run.get("prefix_cache_hit_rate", 0.0),
               "acceptance_length": run.get("spec_decode_acceptance_length")}
        results["runs"].append(row)
        print(f"{workload:13s} round {round_} {name:9s} {run['output_throughput']:8.1f} tok/s  "
              f"TTFT p50 {run['median_ttft_ms']:8.1f} ms  p99 {run['p99_ttft_ms']:8.1f} ms  "
              f"hits {row['prefix_cache_hit_rate']:5.1f} %", flush=True)
    def agree(a, b) -> int:
        return sum(x == y for x, y in zip(outputs.get(a, ()), outputs.get(b, ())))

    same = {w: {"cache on": [agree((w, "cache off", r), (w, "cache on", r)) for r in range(args.rounds)],
                "cache off": [agree((w, "cache off", 0), (w, "cache off", 1))] if args.rounds > 1 else []}
            for w in args.workloads.split(",")}
    results["same_output"] = same
    report(results, table(results["runs"], same, args.num_prompts), args.json)
    return 0


def table(runs: list[dict], same: dict[str, dict[str, list[int]]], num_prompts: int) -> str:
    """The study's table. "same greedy output": for caching on, the prompts whose output
    equals caching off's in the same round (each round); for caching off, those whose
    output equals its own in the next round."""
    lines = ["| workload | prefix cache | TTFT p50 (ms, each round) | TTFT p99 (ms, each round) | "
             "output tok/s (each round) | median tok/s vs off | hit rate | same greedy output |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    from specserve.bench.offline import by_setting

    def each(rows, key, fmt="{:,.0f}"):
        return " / ".join(fmt.format(r[key]) for r in rows)

    for workload, setting, rows, off in by_setting(runs, "cache off"):
        tps = [r["output_throughput"] for r in rows]
        hit = statistics.mean(r["prefix_cache_hit_rate"] for r in rows)
        lines.append(f"| {workload} | {setting.removeprefix('cache ')} | {each(rows, 'median_ttft_ms')} | "
                     f"{each(rows, 'p99_ttft_ms')} | {each(rows, 'output_throughput', '{:,.1f}')} | "
                     f"{statistics.median(tps) / off:.2f}x | {hit:.0f} % | "
                     f"{' / '.join(f'{n}/{num_prompts}' for n in same[workload][setting])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
