"""The speculation sweep: every drafter and k beside speculation off, in one process.

For each concurrency level (1 = one request at a time; higher = that many in flight, the
load case) the same requests run through an engine without a drafter, then through one
engine per drafter at each k (k is set per request, so each drafter loads once). Speedup
is output tokens/s over speculation off at the same level, measured in the same run;
acceptance length and per-position acceptance come from the engine's counters. Greedy
outputs are compared with speculation off (identical in float32; bfloat16 batching may
round differently, so the count is reported, not asserted).
"""
from __future__ import annotations

import dataclasses

from specserve.bench.offline import prompt_ids, run_offline, warm_up
from specserve.bench.workloads import BenchRequest
from specserve.engine import LLMEngine


def run_spec_sweep(engine_config, requests: list[BenchRequest], drafters: list[str], ks: list[int],
                   concurrencies: list[int], *, ignore_eos: bool = False, progress: bool = True) -> list[dict]:
    """One row per (concurrency, setting): speculation off first, then drafter x k."""
    if not drafters or not ks or not concurrencies:
        raise ValueError("give at least one drafter, one k and one concurrency")
    if min(ks) < 1 or min(concurrencies) < 1:
        raise ValueError("k and concurrency must be >= 1")
    engines = {"off": LLMEngine(dataclasses.replace(engine_config, speculative_method="none"))}
    for name in drafters:
        engines[name] = LLMEngine(dataclasses.replace(engine_config, speculative_method=name,
                                                      num_speculative_tokens=max(ks)))
    ids = prompt_ids(engines["off"], requests)
    for engine in engines.values():
        warm_up(engine, requests, ids)
    rows = []
    for level in concurrencies:
        common = {"max_concurrency": level, "ignore_eos": ignore_eos, "progress": progress, "token_ids": ids}
        base = run_offline(engines["off"], requests, label=f"off, concurrency {level}", **common)
        rows.append(_row("off", None, level, base, base))
        for name in drafters:
            for k in ks:
                run = run_offline(engines[name], requests, num_speculative_tokens=k,
                                  label=f"{name} k={k}, concurrency {level}", **common)
                rows.append(_row(name, k, level, run, base))
    return rows


def _row(drafter: str, k: int | None, level: int, run: dict, base: dict) -> dict:
    same = sum(a == b for a, b in zip(run["output_token_ids"], base["output_token_ids"]))
    return {"drafter": drafter, "k": k, "concurrency": level,
            "output_throughput": run["output_throughput"],
            "speedup": run["output_throughput"] / base["output_throughput"] if base["output_throughput"] else 0.0,
            "mean_tpot_ms": run["mean_tpot_ms"], "p99_tpot_ms": run["p99_tpot_ms"],
            "mean_ttft_ms": run["mean_ttft_ms"], "mean_e2el_ms": run["mean_e2el_ms"],
            "total_output_tokens": run["total_output_tokens"],
            "spec_decode_acceptance_length": run.get("spec_decode_acceptance_length", 1.0 if k is None else None),
            "spec_decode_acceptance_rate": run.get("spec_decode_acceptance_rate"),
            "spec_decode_per_position_acceptance_rates": run.get("spec_decode_per_position_acceptance_rates", []),
            "same_as_off": f"{same}/{len(base['output_token_ids'])}"}


def sweep_table(rows: list[dict]) -> str:
    lines = [("| concurrency | drafter | k | output tok/s | speedup | TPOT mean (ms) | acceptance length "
              "| same output as off |"),
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        accept = r["spec_decode_acceptance_length"]
        lines.append(f"| {r['concurrency']} | {r['drafter']} | {r['k'] or ''} | {r['output_throughput']:.1f} "
                     f"| {r['speedup']:.2f}x | {r['mean_tpot_ms']:.1f} "
                     f"| {f'{accept:.2f}' if accept else ''} | {r['same_as_off']} |")
    return "\n".join(lines)
