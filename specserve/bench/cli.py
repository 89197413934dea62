"""``specserve bench serve | offline | spec-sweep``: arguments and what each runs
(``specserve/cli.py`` hooks them in)."""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import sys
from pathlib import Path

import torch

from specserve.bench.arrivals import arrival_times, check_rate, parse_rates
from specserve.bench.offline import format_offline, prompt_ids, run_offline, warm_up
from specserve.bench.plots import plot_serving, spec_sweep_plot
from specserve.bench.serve_bench import (
    ServeOptions,
    compare_to_off,
    config_label,
    format_run,
    parse_speculation,
    rounds_table,
    run_serve,
    summary_table,
)
from specserve.bench.spec_sweep import run_spec_sweep, sweep_table
from specserve.bench.stats import parse_goodput, parse_percentiles
from specserve.bench.workloads import load_workload
from specserve.config import SPECULATIVE_METHODS, EngineConfig
from specserve.engine import LLMEngine
from specserve.engine_flags import add_engine_flags
from specserve.loader import load_tokenizer, resolve_model

_WORKLOAD_HELP = ("code-edit (edit standard-library functions, return the full code), summarize "
                  "(standard-library documentation), chat (questions written for the project), "
                  "shared-prefix (the chat questions behind one long system prompt), multi-turn "
                  "(four-turn chats, each turn resending the conversation with the answers), random "
                  "(random token ids, --input-len long), or a .jsonl file: one object per line, "
                  '{"prompt": "..."} or {"messages": [...]}, optional "max_tokens" (default: code-edit)')


def add_bench_parser(sub) -> None:
    """Add ``bench`` and its three subcommands to the top-level subparsers ``sub``."""
    bench = sub.add_parser("bench", help="latency and throughput benchmarks",
                           description="Benchmarks: serve (HTTP serving, comparable with vllm bench "
                                       "serve), offline (engine in-process), spec-sweep (drafters x k).")
    kinds = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    serve = kinds.add_parser(
        "serve", help="serving benchmark: streaming requests at a rate, against a URL or a "
                      "server it starts",
        description="Send streaming requests to an OpenAI-compatible server and measure, client "
                    "side, TTFT, TPOT, ITL and end-to-end latency, throughput, goodput, and the "
                    "server's speculation statistics (from /metrics). Without --base-url a server "
                    "is started here from the engine flags, once per --speculation setting. The "
                    "JSON result uses vllm bench serve's key names.")
    target = serve.add_argument_group("server")
    target.add_argument("--base-url", default=None,
                        help="benchmark the server at this URL (e.g. http://127.0.0.1:8000); "
                             "default: start one here from the engine flags below")
    target.add_argument("--endpoint", default="auto", choices=("auto", "completions", "chat"),
                        help="auto: chats to /v1/chat/completions, raw prompts to /v1/completions")
    target.add_argument("--served-model-name", default=None,
                        help="model name to send (default: the first one /v1/models lists)")
    target.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                        help="bearer key for the server (default: $SPECSERVE_API_KEY)")
    target.add_argument("--speculation", default=None, metavar="LIST",
                        help="without --base-url: comma-separated settings, each 'none' or "
                             "METHOD[:K][:adaptive][:tree=N][:stop=MODE] (e.g. none,ngram:4,ngram:4:adaptive), one server "
                             "each; default: the engine flags")
    target.add_argument("--server-mode", default="process", choices=("process", "thread"),
                        help="without --base-url: run the server as a child process (default; "
                             "the client never slows the engine) or as a thread of this process "
                             "(faster to start)")
    _load_flags(serve)
    _workload_flags(serve)
    out = serve.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                     help="latency objectives for goodput, e.g. ttft:500 tpot:50 e2el:10000 (ms)")
    _result_flags(out)
    out.add_argument("--plot-dir", default=None,
                     help="write PNG plots here (latency CDFs, rate sweep, acceptance per position)")
    out.add_argument("--save-detailed", action="store_true",
                     help="keep per-request lists (ttfts, itls, latencies, texts) in the JSON")
    add_engine_flags(serve)

    offline = kinds.add_parser(
        "offline", help="offline benchmark: the engine in-process, no HTTP",
        description="Run prompts through the engine in this process — all at once, at most "
                    "--max-concurrency at a time, or arriving at a --request-rate — and report "
                    "throughput and per-request latency (TTFT, TPOT, ITL, end-to-end), with the "
                    "serving benchmark's keys. Needs no HTTP stack, so it also runs where "
                    "fastapi/uvicorn are not installed.")
    _load_flags(offline)
    offline.add_argument("--speculation", default=None, metavar="LIST",
                         help="comma-separated settings, each 'none' or METHOD[:K][:adaptive][:tree=N][:stop=MODE] (e.g. "
                              "none,ngram:4,ngram:4:adaptive; without :adaptive k is fixed): one "
                              "engine each, all loaded at once and run in turn at every rate, each "
                              "rate starting with the next, so drift and one-off costs hit them "
                              "alike (on a GPU, size their caches with --num-kv-blocks); default: "
                              "the engine flags")
    offline.add_argument("--rounds", type=int, default=1,
                         help="run every rate this many times, the settings taking turns each time: "
                              "with speculation off among them, a table of each setting's output "
                              "tokens/s against off's of the same round, and their median (default: 1)")
    _workload_flags(offline)
    out = offline.add_argument_group("results")
    _result_flags(out)
    out.add_argument("--plot-dir", default=None,
                     help="write PNG plots here (latency CDFs, rate sweep, acceptance per position)")
    add_engine_flags(offline)

    sweep = kinds.add_parser(
        "spec-sweep", help="speculation sweep: each drafter and k against speculation off",
        description="For each drafter and k, the speedup over speculation off (same run, same "
                    "prompts) and the acceptance length, at each concurrency (1 = batch 1).")
    sweep.add_argument("--drafters", default="ngram",
                       help="comma-separated drafters: ngram, layerskip, draft_model (default: ngram)")
    sweep.add_argument("--ks", default="1,2,4,6", help="comma-separated k values (default: 1,2,4,6)")
    sweep.add_argument("--concurrency", default="1,8",
                       help="comma-separated in-flight request counts; 1 is batch 1 (default: 1,8)")
    _workload_flags(sweep, num_prompts=8, output_len=64)
    _result_flags(sweep)
    sweep.add_argument("--plot", default=None, help="write the speedup plot (PNG) here")
    add_engine_flags(sweep)


def _load_flags(parser):
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=None,
                      help="requests per second, arrivals drawn from a gamma process; inf sends "
                           "all at once (default: inf)")
    load.add_argument("--request-rate-sweep", default=None, metavar="RATES",
                      help="run once per rate, e.g. 0.5,1,2,inf")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between requests: 1 is Poisson, lower is "
                           "burstier, higher more regular (default: 1)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (with rate inf: fixed concurrency)")
    load.add_argument("--num-warmups", type=int, default=1,
                      help="unmeasured requests sent first, all at once (default: 1); on a GPU, "
                           "the whole workload warms every kernel shape up")
    return load


def _workload_flags(parser, num_prompts: int = 24, output_len: int = 128) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default="code-edit", help=_WORKLOAD_HELP)
    g.add_argument("--num-prompts", type=int, default=num_prompts,
                   help=f"requests to send; a smaller set is cycled (default: {num_prompts})")
    g.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens (default: 128)")
    g.add_argument("--output-len", type=int, default=output_len,
                   help=f"max_tokens per request unless the JSONL line sets it (default: {output_len})")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")


def _result_flags(group) -> None:
    group.add_argument("--metric-percentiles", default="90,99",
                       help="percentiles reported for each latency (default: 90,99)")
    group.add_argument("--result-json", default=None, help="write the results here as JSON")


# ---------------------------------------------------------------------- running
def run_bench(args, engine_kwargs: dict) -> int:
    """Run the benchmark ``args.bench_command`` names; ValueError on bad input."""
    for name in ("num_prompts", "max_concurrency", "output_len", "input_len", "rounds"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    percentiles = parse_percentiles(args.metric_percentiles)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
    return {"serve": _serve, "offline": _offline, "spec-sweep": _spec_sweep}[args.bench_command](
        args, engine_kwargs, percentiles)


def _requests(args, engine_kwargs: dict):
    tokenizer = None
    if args.workload == "random":
        tokenizer = load_tokenizer(resolve_model(engine_kwargs["model"]), engine_kwargs["tokenizer"])
    return load_workload(args.workload, args.num_prompts, output_len=args.output_len,
                         input_len=args.input_len, seed=engine_kwargs["seed"], tokenizer=tokenizer)


def _serve(args, engine_kwargs: dict, percentiles) -> int:
    rates = _rates(args)
    speculation = parse_speculation(args.speculation) if args.speculation else None
    if speculation and args.base_url:
        raise ValueError("--speculation starts servers here; it cannot be used with --base-url")
    opts = ServeOptions(burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                        endpoint=args.endpoint, served_model_name=args.served_model_name,
                        api_key=args.api_key or None, temperature=args.temperature,
                        ignore_eos=args.ignore_eos, num_warmups=args.num_warmups,
                        seed=engine_kwargs["seed"], percentiles=tuple(percentiles),
                        goodput=parse_goodput(args.goodput) if args.goodput else None,
                        save_detailed=args.save_detailed, progress=not args.quiet)
    arrival_times(0, rates[0], args.burstiness)  # validates the burstiness before any model loads
    requests = _requests(args, engine_kwargs)
    config = None
    if args.base_url is None:
        config = EngineConfig(**engine_kwargs)
    runs = run_serve(requests, opts, rates, base_url=args.base_url, engine_config=config,
                     speculation=speculation, server_mode=args.server_mode)
    for run in runs:
        run["workload"] = args.workload
        print(format_run(run, percentiles))
    return _report(args, runs)


def _report(args, runs: list[dict]) -> int:
    """The runs' summary table, plots and JSON; exit code 1 unless every run completed."""
    if len(runs) > 1:
        print()
        print(summary_table(runs))
    if any("round" in r for r in runs) and (table := rounds_table(runs)):  # (``_offline``'s rounds)
        print()
        print(table)
    if args.plot_dir:
        for path in plot_serving(runs, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    _write_json(args.result_json, runs)
    return 0 if all(r["completed"] for r in runs) else 1


def _rates(args) -> list[float]:
    """The request rates to run; also checks the other load flags, before any model loads."""
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.request_rate is not None and args.request_rate_sweep is not None:
        raise ValueError("give --request-rate or --request-rate-sweep, not both")
    if args.request_rate_sweep is not None:
        rates = parse_rates(args.request_rate_sweep)
    else:
        rates = [math.inf if args.request_rate is None else args.request_rate]
        check_rate(rates[0])
    arrival_times(0, rates[0], args.burstiness)  # validates the burstiness before any model loads
    return rates


def _offline(args, engine_kwargs: dict, percentiles) -> int:
    rates = _rates(args)
    settings = parse_speculation(args.speculation) if args.speculation else [None]
    requests = _requests(args, engine_kwargs)
    base = EngineConfig(**engine_kwargs)
    engines = {}
    for spec in settings:
        engine = LLMEngine(spec.apply(base) if spec else base)
        engines[spec.label if spec else config_label(engine.config)] = engine
    ids = prompt_ids(engine, requests)
    for engine in engines.values():
        warm_up(engine, requests, ids, num_requests=args.num_warmups)
    runs = []
    names = list(engines)
    for round_ in range(args.rounds):
        for i, rate in enumerate(rates):
            arrivals = None if math.isinf(rate) else arrival_times(len(requests), rate, args.burstiness,
                                                                   engine_kwargs["seed"])
            # Each rate (and round) starts with another setting: whatever the first run at a
            # new load pays once (on a GPU, kernels for batch shapes the warm-up did not
            # reach) does not always fall on the same one. The runs are reported in the
            # settings' order.
            at_rate, first = {}, (i + round_) % len(names)
            for name in names[first:] + names[:first]:
                engine = engines[name]
                label = f"{name} @ {rate:g} req/s" if len(rates) > 1 else name
                run = run_offline(engine, requests, max_concurrency=args.max_concurrency,
                                  temperature=args.temperature, ignore_eos=args.ignore_eos,
                                  seed=engine_kwargs["seed"], percentiles=percentiles,
                                  progress=not args.quiet, token_ids=ids, arrivals=arrivals,
                                  label=f"{label}, round {round_ + 1}" if args.rounds > 1 else label)
                run.pop("output_token_ids")
                run.update(workload=args.workload, model_id=engine.model_name, speculation=name,
                           request_rate="inf" if math.isinf(rate) else rate, burstiness=args.burstiness,
                           device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
                           speculative_method=engine.config.speculative_method,
                           num_speculative_tokens=engine.speculator.max_k,
                           speculative_adaptive=engine.speculator.controller is not None)
                if args.rounds > 1:
                    run["round"] = round_ + 1
                print(format_offline(run))
                at_rate[name] = run
            runs += [at_rate[name] for name in names]
    if args.rounds > 1:
        compare_to_off(runs)
    return _report(args, runs)


def _spec_sweep(args, engine_kwargs: dict, _percentiles) -> int:
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    for d in drafters:
        if d not in SPECULATIVE_METHODS or d == "none":
            raise ValueError(f"--drafters: unknown drafter {d!r}; choose from "
                             f"{', '.join(m for m in SPECULATIVE_METHODS if m != 'none')}")
    ks, levels = _int_list(args.ks, "--ks"), _int_list(args.concurrency, "--concurrency")
    requests = _requests(args, engine_kwargs)
    rows = run_spec_sweep(EngineConfig(**engine_kwargs), requests, drafters, ks, levels,
                          ignore_eos=args.ignore_eos, progress=not args.quiet)
    print(sweep_table(rows))
    if args.plot:
        print(f"wrote {spec_sweep_plot(rows, args.plot)}", file=sys.stderr)
    _write_json(args.result_json, [{"workload": args.workload, "rows": rows}])
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be integers separated by commas, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} values must be >= 1, got {text!r}")
    return values


# ---------------------------------------------------------------------- output
def describe_machine() -> dict:
    """Where the benchmark ran: CPU model, cores, torch threads, GPU if any."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _write_json(path: str | None, runs: list[dict]) -> None:
    """One run: its dict (vllm bench serve's shape) with ``machine`` added; several:
    ``{"machine": ..., "runs": [...]}``."""
    if not path:
        return
    runs = [{k: v for k, v in r.items() if k != "_detail"} for r in runs]
    machine = describe_machine()
    payload = {**runs[0], "machine": machine} if len(runs) == 1 else {"machine": machine, "runs": runs}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
