"""Benchmark statistics under ``vllm bench serve``'s key names, so results compare directly.

Per request (successful ones only): TTFT; TPOT = (end-to-end - TTFT) / (output tokens - 1)
for requests with more than one output token; end-to-end latency (``e2el``). ITL pools
every gap between successive streamed chunks of every request. Each gets ``mean_*_ms``,
``median_*_ms``, ``std_*_ms`` (population) and ``p{P}_*_ms`` (numpy's linear-interpolation
percentile). Goodput counts requests that meet every objective given (``ttft``, ``tpot``,
``e2el`` in ms; a request with one output token has TPOT 0 there, as in vLLM).
Speculation keys come from the server's counter deltas over the measured window.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from specserve.bench.client import RequestResult, SpecCounters

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


def percentile(values: Sequence[float], p: float) -> float:
    """numpy's linear-interpolation percentile; 0.0 for no values (vLLM's convention)."""
    return float(np.percentile(values, p)) if len(values) else 0.0


def summarize(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """``mean/median/std/p{P}_{name}_ms`` of values given in seconds."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    empty = len(ms) == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(ms.mean()),
           f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
           f"std_{name}_ms": 0.0 if empty else float(ms.std())}
    for p in percentiles:
        out[f"p{_p_word(p)}_{name}_ms"] = percentile(ms, p)
    return out


def _p_word(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers separated by commas, got {text!r}") from None
    if any(not 0 < p < 100 for p in values):
        raise ValueError(f"percentiles must be between 0 and 100, got {text!r}")
    return values


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else math.nan
        except ValueError:
            slos[name] = math.nan
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: the objective must be one of "
                             f"{', '.join(GOODPUT_METRICS)} (as KEY:MILLISECONDS)")
        if not slos[name] >= 0:
            raise ValueError(f"--goodput {pair!r}: give KEY:MILLISECONDS with a number >= 0")
    return slos


def tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first; None with one output token or fewer."""
    if result.output_len <= 1:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def calculate_metrics(results: Sequence[RequestResult], duration_s: float,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      goodput: dict[str, float] | None = None) -> dict:
    """The result dict: counts, throughputs, goodput and latency statistics."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    tpots = [t for t in map(tpot, done) if t is not None]
    out = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "request_goodput": (count_good(done, goodput) / duration_s if duration_s > 0 else 0.0)
        if goodput else None,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        "max_concurrent_requests": max_concurrency(done),
    }
    out.update(summarize("ttft", [r.ttft for r in done], percentiles))
    out.update(summarize("tpot", tpots, percentiles))
    out.update(summarize("itl", [gap for r in done for gap in r.itl], percentiles))
    out.update(summarize("e2el", [r.latency for r in done], percentiles))
    return out


def count_good(done: Sequence[RequestResult], goodput: dict[str, float]) -> int:
    """Requests meeting every objective (milliseconds)."""
    good = 0
    for r in done:
        values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
        if all(values[name] * 1000.0 <= limit for name, limit in goodput.items()):
            good += 1
    return good


def max_concurrency(done: Sequence[RequestResult]) -> int:
    """The most requests in flight at once, from their send and end times."""
    events = sorted([(r.send_time, 1) for r in done] + [(r.send_time + r.latency, -1) for r in done],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def per_request(results: Sequence[RequestResult], start: float) -> dict:
    """vLLM's per-request lists (``input_lens``, ``output_lens``, ``ttfts``, ``itls``,
    ``errors``) plus ``latencies`` and ``start_times`` (seconds after the run's start)."""
    return {"input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_len if r.success else 0 for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results],
            "start_times": [r.send_time - start for r in results],
            "errors": [r.error for r in results]}


def spec_decode_metrics(before: SpecCounters | None, after: SpecCounters | None) -> dict:
    """vLLM's speculation keys from two counter snapshots; empty when the server did not
    speculate in between (absent, not zero: zero would claim every draft was rejected).

    acceptance_rate is a percentage of draft tokens; acceptance_length = 1 + accepted /
    drafts (tokens per verify step that drafted); per-position rate j = drafts whose
    (j+1)-th token was accepted / drafts.
    """
    if before is None or after is None:
        return {}
    cache = prefix_cache_metrics(before, after)
    lengths = {k: n - before.draft_lengths.get(k, 0) for k, n in sorted(after.draft_lengths.items())}
    # The draft length chosen per request per step (k = 0 included): adaptive speculation's decisions.
    chosen = {"spec_decode_draft_lengths": {str(k): int(n) for k, n in lengths.items() if n > 0}}
    if not any(chosen["spec_decode_draft_lengths"].values()):
        chosen = {}
    drafts = after.num_drafts - before.num_drafts
    if drafts <= 0:
        return {**cache, **chosen}
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    positions = range(max(after.accepted_per_position, default=-1) + 1)
    per_position = [(after.accepted_per_position.get(j, 0) - before.accepted_per_position.get(j, 0)) / drafts
                    for j in positions]
    return {"spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens if draft_tokens else 0.0,
            "spec_decode_acceptance_length": 1.0 + accepted / drafts,
            "spec_decode_num_drafts": int(drafts),
            "spec_decode_draft_tokens": int(draft_tokens),
            "spec_decode_accepted_tokens": int(accepted),
            "spec_decode_per_position_acceptance_rates": per_position, **chosen, **cache}


def prefix_cache_metrics(before: SpecCounters, after: SpecCounters) -> dict:
    """The prefix cache's hit rate (percent of the prompt tokens looked up in it that were
    found there) between two counter snapshots; empty when nothing was looked up."""
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    if queries <= 0:
        return {}
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return {"prefix_cache_queries": int(queries), "prefix_cache_hits": int(hits),
            "prefix_cache_hit_rate": 100.0 * hits / queries}


def mean_draft_length(run: dict) -> float | None:
    """The mean k chosen per request per step, from ``spec_decode_draft_lengths``."""
    lengths = run.get("spec_decode_draft_lengths")
    if not lengths:
        return None
    return sum(int(k) * n for k, n in lengths.items()) / sum(lengths.values())


def format_draft_lengths(run: dict) -> str | None:
    """``k=0 12%  k=4 88%``: how often each draft length was chosen."""
    lengths = run.get("spec_decode_draft_lengths")
    if not lengths:
        return None
    total = sum(lengths.values())
    return "  ".join(f"k={k} {100 * n / total:.0f}%" for k, n in lengths.items())
