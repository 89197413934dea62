"""``specserve tune``: the draft length and token budget that serve a workload best.

Sweeps ``num_speculative_tokens`` x ``max_num_batched_tokens`` (x drafter, when several
are asked for; x ``num_draft_paths``, for a drafter that ranks candidates) on the engine
in this process, with requests arriving at a rate or held at a concurrency, and scores
each setting by output throughput among those that meet the latency objectives (p99 TTFT
/ TPOT), else by how far they miss them.

It does not take longer than it must: one engine per drafter is loaded once and every
setting reuses it (k is set per request, the budget and the draft paths on the
scheduler); k = 0 is run once, as plain decoding; a first round on a quarter of the
prompts drops settings that are clearly worse (below ``prune_ratio`` of the best
throughput, or missing objectives the best meets) before the full round. The winner is written as a config file that ``specserve
serve --config`` loads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tqdm.auto import tqdm

from specserve.bench.arrivals import arrival_times
from specserve.bench.offline import prompt_ids, run_offline, warm_up


@dataclass(frozen=True)
class Setting:
    method: str          # the drafter; "none" for k = 0
    k: int
    budget: int          # max_num_batched_tokens
    paths: int = 1       # num_draft_paths

    @property
    def label(self) -> str:
        spec = "off" if self.k == 0 else f"{self.method} k={self.k}"
        if self.k and self.paths > 1:
            spec += f" x {self.paths} paths"
        return f"{spec}, budget {self.budget}"


@dataclass
class Objectives:
    ttft_ms: float | None = None   # p99 time to first token
    tpot_ms: float | None = None   # p99 time per output token

    def misses(self, result: dict) -> float:
        """0 when every objective is met; else the summed relative overshoot."""
        total = 0.0
        for key, limit in (("p99_ttft_ms", self.ttft_ms), ("p99_tpot_ms", self.tpot_ms)):
            if limit is not None:
                total += max(0.0, (result.get(key) or math.inf) / limit - 1.0)
        return total


def settings_grid(methods: list[str], ks: list[int], budgets: list[int],
                  paths: dict[str, list[int]] | None = None) -> list[Setting]:
    """``paths``: the draft path counts to try per drafter (default: 1, a chain)."""
    grid = [Setting("none", 0, b) for b in budgets] if 0 in ks else []
    grid += [Setting(m, k, b, n) for m in methods for k in ks if k > 0 for n in (paths or {}).get(m, [1])
             for b in budgets]
    return grid


def score(result: dict, objectives: Objectives) -> tuple[float, float]:
    """Higher is better: meet the objectives first, then throughput."""
    return (-objectives.misses(result), result["output_throughput"])


def tune(engines: dict, requests, settings: list[Setting], objectives: Objectives, *,
         request_rate: float = math.inf, max_concurrency: int | None = None, seed: int = 0,
         prune_ratio: float = 0.85, progress: bool = True, on_result=None) -> list[dict]:
    """Run every setting (pruned after a first round on a quarter of ``requests``);
    returns one row per setting run in the final round, best first. ``engines`` maps a
    drafter name to a loaded ``LLMEngine``; "none" (k = 0) may be an n-gram engine, whose
    requests with k = 0 decode plainly at no drafting cost."""
    token_ids = {name: prompt_ids(engine, requests) for name, engine in engines.items()}
    for engine in {id(e): e for e in engines.values()}.values():
        warm_up(engine, requests)
    first = max(4, len(requests) // 4)
    rounds = [(requests[:first], "quick")] if first < len(requests) else []
    rounds.append((requests, "full"))
    survivors = list(settings)
    with tqdm(total=len(settings) + (len(settings) if len(rounds) > 1 else 0), desc="tuning",
              unit="run", disable=not progress) as bar:
        for index, (chosen, name) in enumerate(rounds):
            rows = []
            for setting in survivors:
                result = _run(engines, token_ids, chosen, setting, request_rate, max_concurrency, seed)
                row = {"setting": setting, "round": name, **result,
                       "objectives_met": objectives.misses(result) == 0}
                rows.append(row)
                bar.update(1)
                if on_result:
                    on_result(row)
            rows.sort(key=lambda r: score(r, objectives), reverse=True)
            if index == len(rounds) - 1:
                return rows
            survivors = [r["setting"] for r in _prune(rows, objectives, prune_ratio)]
            bar.total = len(settings) + len(survivors)
            bar.refresh()
    return []


def _prune(rows: list[dict], objectives: Objectives, ratio: float) -> list[dict]:
    """Keep what could still win: close to the best throughput and no worse on the
    objectives than the best; never fewer than two, at most half (rounded up)."""
    best = rows[0]
    keep = [r for r in rows
            if r["output_throughput"] >= ratio * best["output_throughput"]
            and objectives.misses(r) <= objectives.misses(best) + 1e-9]
    keep = keep[:max(2, -(-len(rows) // 2))]
    return keep if len(keep) >= 2 else rows[:2]


def _run(engines, token_ids, requests, setting: Setting, request_rate, max_concurrency, seed) -> dict:
    name = "none" if setting.k == 0 else setting.method
    engine = engines[name]
    engine.scheduler.max_num_batched_tokens = setting.budget
    engine.speculator.set_num_draft_paths(setting.paths)
    arrivals = None if math.isinf(request_rate) else arrival_times(len(requests), request_rate, seed=seed)
    result = run_offline(engine, requests, max_concurrency=max_concurrency, ignore_eos=True,
                         num_speculative_tokens=setting.k, seed=seed,
                         progress=False, label=setting.label,
                         token_ids=token_ids[name][:len(requests)], arrivals=arrivals)
    result.pop("output_token_ids", None)
    result.pop("_detail", None)  # per-request lists, for plots only
    return result


def best_config(base: dict, setting: Setting) -> dict:
    """The engine settings to save: ``base`` (the flags tune ran with) plus the winner."""
    config = {k: v for k, v in base.items() if v is not None}
    config.update(max_num_batched_tokens=setting.budget,
                  speculative_method=setting.method if setting.k else "none")
    config.pop("num_draft_paths", None)
    if setting.k:
        config["num_speculative_tokens"] = setting.k
        if setting.paths > 1:
            config["num_draft_paths"] = setting.paths
    else:
        config.pop("num_speculative_tokens", None)
    return config


def format_table(rows: list[dict], objectives: Objectives) -> str:
    lines = ["| setting | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | acceptance length | objectives |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    asked = objectives.ttft_ms is not None or objectives.tpot_ms is not None
    for r in rows:
        al = r.get("spec_decode_acceptance_length")
        met = ("met" if r["objectives_met"] else f"missed by {objectives.misses(r):.0%}") if asked else "-"
        lines.append(f"| {r['setting'].label} | {r['output_throughput']:.1f} | "
                     f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
                     f"{f'{al:.2f}' if al else '-'} | {met} |")
    return "\n".join(lines)
