"""The offline benchmark: the engine in this process, no HTTP.

Every request is tokenised first, then added to the engine (all at once, or keeping at
most ``max_concurrency`` in flight), and the engine is stepped until all have finished.
A request's clock starts when it is added; TTFT, TPOT, ITL (between outputs that carry
tokens) and end-to-end latency are measured on the step outputs, and the statistics are
the serving benchmark's (same keys). Speculation counts come from the engine itself.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from contextlib import nullcontext

from tqdm.auto import tqdm

from specserve.bench.client import RequestResult, SpecCounters
from specserve.bench.stats import (DEFAULT_PERCENTILES, calculate_metrics, format_draft_lengths, per_request,
                                   spec_decode_metrics)
from specserve.bench.workloads import BenchRequest, load_workload
from specserve.sampling_params import SamplingParams


def prompt_ids(engine, requests: list[BenchRequest]) -> list[list[int] | None]:
    """Token ids of each request: chats through the chat template, text as it is; None
    for a chat's later turn, whose prompt holds an answer not given yet."""
    out = []
    for req in requests:
        if req.follows is not None:
            out.append(None)
        elif req.is_chat:
            out.append(engine.apply_chat_template(req.messages))
        elif isinstance(req.prompt, str):
            out.append(engine.tokenizer.encode(req.prompt))
        else:
            out.append(list(req.prompt))
    return out


def run_offline(engine, requests: list[BenchRequest], *, max_concurrency: int | None = None,
                temperature: float = 0.0, ignore_eos: bool = False, num_speculative_tokens: int | None = None,
                seed: int = 0, percentiles=DEFAULT_PERCENTILES, progress: bool = True, label: str = "",
                token_ids: list[list[int]] | None = None,
                arrivals: list[float] | None = None) -> dict:
    """Run ``requests`` through ``engine`` (an idle ``LLMEngine``); returns the result dict,
    with ``output_token_ids`` per request for equality checks. ``arrivals`` (seconds from
    the start, non-decreasing) holds each request back until its time, as a request rate
    does; latencies count from that time. A chat's later turn (``BenchRequest.follows``)
    waits for the answer it continues and is sent with it, as a user would."""
    token_ids = list(token_ids or prompt_ids(engine, requests))
    chats = {i: r.messages for i, r in enumerate(requests) if r.is_chat}
    params = [SamplingParams(temperature=temperature, max_tokens=r.max_tokens, ignore_eos=ignore_eos,
                             seed=seed + i, num_speculative_tokens=num_speculative_tokens)
              for i, r in enumerate(requests)]
    cap = max_concurrency or len(requests)
    results = [RequestResult() for _ in requests]
    final: dict[int, list[int]] = {}
    owner: dict[str, int] = {}
    last: dict[int, float] = {}
    waiting = deque(i for i, r in enumerate(requests) if r.follows is None)
    followers: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.follows is not None:
            followers.setdefault(r.follows, []).append(i)
    answered: dict[int, float] = {}  # a later turn's own arrival: when its answer came
    engine.kv.reset_prefix_cache()  # every run starts cold: the warm-up's prompts are not cached
    before = _counters(engine)
    bar = tqdm(total=len(requests), desc=label or "requests", unit="req", disable=not progress, leave=False)
    start = time.perf_counter()
    while waiting or engine.has_unfinished_requests():
        while waiting and len(owner) < cap:
            due = answered.get(waiting[0]) if waiting[0] in answered else (
                None if arrivals is None else start + arrivals[waiting[0]])
            if due is not None and time.perf_counter() < due:
                if not engine.has_unfinished_requests():  # idle until the next arrival
                    time.sleep(max(0.0, due - time.perf_counter()))
                    continue
                break
            i = waiting.popleft()
            results[i].send_time = time.perf_counter() if due is None else due
            owner[engine.add_request(token_ids[i], params[i])] = i
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            now = time.perf_counter()
            i = owner[out.req_id]
            r = results[i]
            if out.delta_token_ids:
                if i not in last:
                    r.ttft = now - r.send_time
                else:
                    r.itl.append(now - last[i])
                r.chunk_times.append(now)
                last[i] = now
            if out.finished:
                del owner[out.req_id]
                r.prompt_len, r.output_len = len(out.prompt_token_ids), len(out.token_ids)
                r.latency = last.get(i, now) - r.send_time
                r.success, r.finish_reason = out.finish_reason != "error", out.finish_reason
                r.error, r.text = out.error or "", out.text
                final[i] = out.token_ids
                bar.update(1)
                for j in followers.get(i, ()):  # the chat's next turn, with this answer
                    chats[j] = chats[i] + [{"role": "assistant", "content": out.text}] + requests[j].messages
                    token_ids[j] = engine.apply_chat_template(chats[j])
                    answered[j] = max(now, start + arrivals[j]) if arrivals is not None else now
                    _insert_by_arrival(waiting, j, answered, arrivals, start)
    duration = time.perf_counter() - start
    bar.close()
    spec = spec_decode_metrics(before, _counters(engine))
    return {"label": label, "num_prompts": len(requests), "max_concurrency": max_concurrency,
            **calculate_metrics(results, duration, percentiles), **spec,
            "_detail": per_request(results, start),  # for plots; dropped when the JSON is written
            "output_token_ids": [final[i] for i in range(len(requests))]}


def _counters(engine) -> SpecCounters:
    """The engine's counters now, as the serving benchmark reads them from /metrics."""
    s = engine.spec_stats
    return SpecCounters(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                        dict(enumerate(s.accepted_per_position)), dict(engine.draft_length_counts),
                        engine.kv.num_query_tokens, engine.kv.num_hit_tokens)


def _insert_by_arrival(waiting: deque, j: int, answered: dict[int, float], arrivals, start: float) -> None:
    """Queue a later turn among the waiting requests by when it may be sent."""
    def due(i: int) -> float:
        if i in answered:
            return answered[i]
        return -math.inf if arrivals is None else start + arrivals[i]
    at = next((n for n, i in enumerate(waiting) if due(i) > answered[j]), len(waiting))
    waiting.insert(at, j)


def warm_up(engine, requests: list[BenchRequest], token_ids: list[list[int]] | None = None,
            num_requests: int | None = None) -> None:
    """Run requests untimed so lazy initialisation (and, on a GPU, kernel compilation for
    each shape) is not timed: by default one short request; with ``num_requests``, that
    many of the workload's requests (cycled) at their own lengths — the first half at
    once, the rest one per step, so prefill chunks also share steps with decode and verify
    spans, the mixed shapes a request rate produces (each compiles its own kernels)."""
    if num_requests is None:
        ids = (token_ids or prompt_ids(engine, requests[:1]))[0]
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    else:
        token_ids = token_ids or prompt_ids(engine, requests)
        ready = [j for j, ids in enumerate(token_ids) if ids is not None]  # not a chat's later turn
        for i in range(num_requests):
            j = ready[i % len(ready)]
            engine.add_request(token_ids[j], SamplingParams(temperature=0, max_tokens=requests[j].max_tokens))
            if i >= num_requests // 2:
                engine.step()
    while engine.has_unfinished_requests():
        engine.step()


def take_turns(engines: dict, workloads: list[str], num_prompts: int, output_len: int, rounds: int,
               num_warmups: int | None = None, around=None, **run_options):
    """The comparison benchmarks' loop: for each workload, every engine warmed up on it
    (``num_warmups`` requests, default all of them), then ``rounds`` rounds in which the
    settings take turns, each round starting with the next (the first measured run of a
    process pays one-off costs). Yields ``(workload, round, name, run)``, ``run`` being
    ``run_offline``'s result for engine ``name`` (given ``run_options``); ``around(name)``,
    if given, is a context manager entered for each measured run only."""
    names = list(engines)
    for workload in workloads:
        first = engines[names[0]]
        requests = load_workload(workload, num_prompts, output_len=output_len, tokenizer=first.tokenizer)
        ids = prompt_ids(first, requests)
        for engine in engines.values():
            warm_up(engine, requests, ids, num_requests=num_warmups or len(requests))
        for round_ in range(rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                with around(name) if around else nullcontext():
                    run = run_offline(engines[name], requests, token_ids=ids, progress=False, label=name,
                                      **run_options)
                yield workload, round_, name, run


def add_turns_flags(parser, num_prompts: int) -> None:
    """The flags every comparison benchmark has (``take_turns``, ``engine_flags``, ``report``)."""
    parser.add_argument("--workloads", default="chat,code-edit")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")


def add_settings_flags(parser, settings: dict, note: str = "") -> None:
    """The flags of a comparison benchmark of n-gram ``settings`` (names -> engine
    options): ``--num-warmups``, ``--k`` and ``--settings`` (names separated by ';',
    since some contain commas; read back with ``chosen_settings``)."""
    parser.add_argument("--num-warmups", type=int, default=None,
                        help="warm-up requests per engine (default: the whole workload)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--settings", default=";".join(settings),
                        help=f"separated by ';', of: {'; '.join(settings)} (default: all{note})")


def chosen_settings(parser, args, settings: dict, always: str | None = None) -> list[str]:
    """The setting names ``--settings`` asked for, in order and once each (``always``
    first, asked or not); an unknown name is the parser's error (exit code 2)."""
    names = [name.strip() for name in args.settings.split(";") if name.strip()]
    if always is not None:
        names = [always] + names
    unknown = [name for name in names if name not in settings]
    if unknown or not names:
        parser.error(f"unknown setting(s): {'; '.join(unknown)} (choose from: {'; '.join(settings)})")
    return list(dict.fromkeys(names))


def engine_flags(args, **extra) -> dict:
    """Engine keyword arguments from a comparison benchmark's flags (``--model``,
    ``--dtype``, ``--device``, ``--num-kv-blocks``, ``--max-num-seqs``: those given), and
    ``extra``."""
    given = {name: getattr(args, name, None) for name in
             ("model", "dtype", "device", "num_kv_blocks", "max_num_seqs")}
    return {**{name: value for name, value in given.items() if value}, **extra}


def by_setting(runs: list[dict], baseline: str):
    """A comparison benchmark's rows grouped for its table: yields ``(workload, setting,
    rows, base)`` per workload and setting in the order first seen, ``base`` being the
    median output throughput of the workload's ``baseline`` setting."""
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        base = statistics.median(r["output_throughput"] for r in mine if r["setting"] == baseline)
        for setting in dict.fromkeys(r["setting"] for r in mine):
            yield workload, setting, [r for r in mine if r["setting"] == setting], base


def report(results: dict, table: str, path: str | None) -> None:
    """Print a comparison benchmark's table; write its results to ``path`` as JSON."""
    print()
    print(table)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def format_offline(run: dict) -> str:
    lines = [f"{' Offline Benchmark Result ':=^60}"]
    if run.get("label"):
        lines.append(f"{'Run:':<44} {run['label']}")
    for name, key, fmt in (("Successful requests:", "completed", "{}"),
                           ("Failed requests:", "failed", "{}"),
                           ("Maximum concurrency:", "max_concurrency", "{}"),
                           ("Duration (s):", "duration", "{:.2f}"),
                           ("Total input tokens:", "total_input_tokens", "{}"),
                           ("Total generated tokens:", "total_output_tokens", "{}"),
                           ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
                           ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
                           ("Total token throughput (tok/s):", "total_token_throughput", "{:.2f}"),
                           ("Mean / P99 TTFT (ms):", ("mean_ttft_ms", "p99_ttft_ms"), "{:.2f} / {:.2f}"),
                           ("Mean / P99 TPOT (ms):", ("mean_tpot_ms", "p99_tpot_ms"), "{:.2f} / {:.2f}"),
                           ("Mean / P99 ITL (ms):", ("mean_itl_ms", "p99_itl_ms"), "{:.2f} / {:.2f}"),
                           ("Mean / P99 E2EL (ms):", ("mean_e2el_ms", "p99_e2el_ms"), "{:.2f} / {:.2f}"),
                           ("Acceptance length:", "spec_decode_acceptance_length", "{:.2f}"),
                           ("Prefix cache hit rate (%):", "prefix_cache_hit_rate", "{:.1f}")):
        keys = key if isinstance(key, tuple) else (key,)
        if all(run.get(k) is not None for k in keys):
            lines.append(f"{name:<44} {fmt.format(*(run[k] for k in keys))}")
    if format_draft_lengths(run):
        lines.append(f"{'Draft length chosen (request-steps):':<44} {format_draft_lengths(run)}")
    lines.append("=" * 60)
    return "\n".join(lines)
