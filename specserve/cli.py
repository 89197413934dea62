"""The ``specserve`` command line. Bad input: one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import yaml

from specserve import __version__
from specserve.bench.cli import add_bench_parser, run_bench
from specserve.bench.workloads import load_workload
from specserve.config import PATH_METHODS, SPECULATIVE_METHODS, EngineConfig
from specserve.distributed import (
    MULTICAST_OFF,
    destroy_tensor_parallel,
    disable_multicast,
    init_tensor_parallel,
    run_main,
)
from specserve.engine import LLMEngine
from specserve.engine_flags import ENGINE_FLAGS, add_engine_flags
from specserve.loader import load_hf_config, resolve_model
from specserve.models.parallel import check_tensor_parallel
from specserve.sampling_params import SamplingParams
from specserve.server import serve
from specserve.tp_worker import run_worker
from specserve.tune import Objectives, best_config, format_table, settings_grid, tune

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), like every other error."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"specserve: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specserve", description="specserve: a speculative-decoding-first LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate a completion and stream it to stdout",
                         description="Generate a completion for PROMPT, streamed to stdout; "
                                     "statistics go to stderr.")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt (read from stdin when omitted and stdin is not a terminal)")
    gen.add_argument("--max-tokens", type=int, default=256, help="maximum new tokens (default: 256)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="divide (multiply, if negative) the logits of tokens already seen; 1 is off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="lower tokens already in the output")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="lower tokens by how often they are in the output")
    gen.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    gen.add_argument("--bad-word", dest="bad_words", action="append", default=[],
                     help="a word never to generate (repeatable)")
    chat = gen.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the tokenizer's chat template (default: when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt as raw text")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with the text and statistics instead of streaming")
    add_engine_flags(gen)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                         description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                                     "/health and /metrics (Prometheus) over HTTP.")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    srv.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1/* "
                          "(default: $SPECSERVE_API_KEY; unset: no key)")
    srv.add_argument("--served-model-name", default=None,
                     help="model name clients use and /v1/models shows (default: the model's name)")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="requests that may wait for a slot; more get 429 (default: 256)")
    srv.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                     help="largest request body accepted; larger gets 413 (default: 4 MiB)")
    srv.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"),
                     help="how the model writes tool calls (default: llama3_json for a Llama 3.x chat "
                          "template, else hermes: <tool_call> JSON, as Qwen and SmolLM2 write it)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds in-flight requests get to finish before they are "
                          "aborted (default: 30)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                     help="uvicorn's log level (default: info)")
    add_engine_flags(srv)
    add_bench_parser(sub)
    _tune_parser(sub)
    return parser


def _tune_parser(sub) -> None:
    tune = sub.add_parser(
        "tune", help="find the best draft length and token budget for a workload",
        description="Sweep --num-speculative-tokens x --max-num-batched-tokens (x drafter x "
                    "--num-draft-paths-list) on the engine in this process, with requests "
                    "arriving at --request-rate or held at --max-concurrency; print a table and "
                    "write the best setting as a config file for 'specserve serve --config'. "
                    "Settings clearly worse after a quick round on a quarter of the prompts are "
                    "dropped before the full round.")
    w = tune.add_argument_group("workload")
    w.add_argument("--workload", default="chat",
                   help="code-edit, summarize, chat, random, or a .jsonl file (one object per line: "
                        '{"prompt": ...} or {"messages": [...]}, optional "max_tokens"); default: chat')
    w.add_argument("--num-prompts", type=int, default=32, help="requests per setting (default: 32)")
    w.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default: 64)")
    w.add_argument("--input-len", type=int, default=128, help="random workload: prompt tokens (default: 128)")
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in the engine at once (default: no cap)")
    g = tune.add_argument_group("search")
    g.add_argument("--speculative-methods", default=None, metavar="LIST",
                   help="drafters to try, comma-separated (default: --speculative-method, or ngram)")
    g.add_argument("--num-speculative-tokens-list", default="0,1,2,4,6", metavar="LIST",
                   help="k values to try; 0 is speculation off (default: 0,1,2,4,6)")
    g.add_argument("--max-num-batched-tokens-list", default="128,256,512", metavar="LIST",
                   help="token budgets to try (default: 128,256,512)")
    g.add_argument("--num-draft-paths-list", default="1", metavar="LIST",
                   help="draft paths per greedy request to try, 1-4, with draft_model and layerskip "
                        "(default: 1)")
    g.add_argument("--ttft-slo-ms", type=float, default=None, help="objective: p99 TTFT at most this")
    g.add_argument("--tpot-slo-ms", type=float, default=None, help="objective: p99 TPOT at most this")
    g.add_argument("--output", default="specserve-tuned.yaml",
                   help="where to write the best setting (default: specserve-tuned.yaml)")
    g.add_argument("--result-json", default=None, help="also write every run's metrics here")
    add_engine_flags(tune)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            args = _apply_config_file(parser, args, argv)
    except ValueError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _quiet_libraries()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(message)s", stream=sys.stderr)
    try:
        if getattr(args, "tensor_parallel_size", 1) != 1:
            done = _tensor_parallel_rank(args, sys.argv[1:] if argv is None else argv)
            if done is not None:
                return done
        return {"generate": _generate, "serve": _serve, "bench": _bench,
                "tune": _tune}[args.command](args)
    except ValueError as exc:  # every user-facing error is a ValueError (see errors.py)
        print(f"specserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    finally:
        if getattr(args, "tensor_parallel_size", 1) != 1:
            destroy_tensor_parallel()


def _tensor_parallel_rank(args, argv: list[str]) -> int | None:
    """``--tensor-parallel-size N``: outside torchrun, check what can be checked and
    start this same command as N ranks under torchrun (this process becomes torchrun);
    under torchrun, rank 0 returns None and runs the command, the other ranks follow it
    (``tp_worker.run_worker``) and return 0."""
    size = args.tensor_parallel_size
    if args.command not in ("generate", "serve"):
        raise ValueError("--tensor-parallel-size runs with 'specserve generate' and 'specserve serve'")
    config = _engine_config(args)  # validates the size against the device and its GPUs
    if "WORLD_SIZE" not in os.environ:
        check_tensor_parallel(load_hf_config(resolve_model(config.model)), size)
        command = [sys.executable, "-m", "specserve.launch", "--standalone",
                   f"--nproc-per-node={size}", "-m", "specserve.cli", *argv]
        env = disable_multicast(dict(os.environ))
        if not args.quiet:
            print(f"specserve: starting {size} ranks: torchrun --nproc-per-node {size} -m specserve.cli "
                  f"... ({', '.join(f'{k}={env[k]}' for k in MULTICAST_OFF)})", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, env)
    tp = init_tensor_parallel(size, config.device)
    if tp.is_driver:
        return None

    logging.getLogger().setLevel(logging.WARNING)  # rank 0 speaks for the job
    os.environ["TQDM_DISABLE"] = "1"
    run_worker(config)
    return 0


def _engine_config(args):
    return EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS})


def _apply_config_file(parser: argparse.ArgumentParser, args, argv) -> argparse.Namespace:
    """Re-parse with the file's settings as defaults, so flags on the command line win."""
    settings = load_config_file(args.config)
    command = _subparser(parser, args)
    known = {a.dest: a for a in command._actions
             if a.option_strings and a.dest not in ("help", "config", "version")}
    defaults = {}
    for key, value in settings.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known:
            raise ValueError(f"{args.config}: unknown setting {key!r} for 'specserve {args.command}'")
        action = known[dest]
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{args.config}: {key} must be one of {', '.join(map(str, action.choices))}, "
                             f"got {value!r}")
        if action.type is not None and value is not None and not isinstance(value, bool):
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                raise ValueError(f"{args.config}: {key} has an invalid value {value!r}") from None
        defaults[dest] = value
    command.set_defaults(**defaults)
    return parser.parse_args(argv)


def _subparser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The (innermost) subcommand parser that parsed ``args``."""
    current = parser
    for dest in ("command", "bench_command"):
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or getattr(args, dest, None) is None:
            break
        current = subs[0].choices[getattr(args, dest)]
    return current


def load_config_file(path: str) -> dict:
    """A YAML or JSON mapping of settings; ValueError with the reason otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            settings = yaml.safe_load(f)  # JSON is YAML too
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML or JSON: {str(exc).splitlines()[0]}") from None
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ValueError(f"config file {path} must hold a mapping of setting: value")
    return settings


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers  # lazy: transformers takes seconds to import, and only a command needs it

    transformers.logging.set_verbosity_error()


def _generate(args) -> int:
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise ValueError("give a PROMPT argument or pipe one on stdin")
        prompt = sys.stdin.read()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, max_tokens=args.max_tokens, stop=args.stop,
                            ignore_eos=args.ignore_eos, seed=args.seed,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens,
                            bad_words=args.bad_words)
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
    engine = LLMEngine(_engine_config(args))
    try:
        return _generate_with(engine, args, prompt, params)
    finally:
        engine.shutdown()


def _generate_with(engine, args, prompt, params) -> int:
    use_chat = args.chat if args.chat is not None else bool(engine.tokenizer.chat_template)
    if use_chat:
        if not engine.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use --no-chat")
        prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
    start = time.perf_counter()
    req_id = engine.add_request(prompt, params)
    first_token_at, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first_token_at is None and out.token_ids:
                first_token_at = time.perf_counter()
            if not args.json:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            if out.finished and out.req_id == req_id:
                final = out
    elapsed = time.perf_counter() - start
    if final.finish_reason == "error":
        print(f"\nspecserve: error: generation failed: {final.error}", file=sys.stderr)
        return 1
    stats = _stats(final, elapsed, first_token_at - start if first_token_at else None)
    if args.json:
        print(json.dumps({"text": final.text, "token_ids": final.token_ids,
                          "finish_reason": final.finish_reason, **stats}))
    else:
        sys.stdout.write("\n")
        # Speculation off drafts nothing: no acceptance length to report.
        accepted = (f"acceptance length {stats['mean_acceptance_length']:.2f}, "
                    if engine.speculator.drafter is not None else "")
        print(f"[{stats['num_output_tokens']} tokens in {stats['elapsed_s']:.2f} s, "
              f"{stats['tokens_per_s']:.1f} tokens/s, TTFT {stats['ttft_s']:.3f} s, "
              f"{accepted}finish_reason={final.finish_reason}]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    for name in ("port", "max_queued_requests", "max_request_bytes", "shutdown_timeout"):
        value = getattr(args, name)
        if value < (0 if name in ("port", "shutdown_timeout") else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if name in ('port', 'shutdown_timeout') else '>= 1'}, got {value}")
    if args.port > 65535:
        raise ValueError(f"--port must be at most 65535, got {args.port}")
    if not math.isfinite(args.shutdown_timeout):
        raise ValueError(f"--shutdown-timeout must be a finite number of seconds, got {args.shutdown_timeout}")
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
    serve(_engine_config(args), args.host, args.port,
          api_key=args.api_key or None, served_model_name=args.served_model_name,
          max_queued_requests=args.max_queued_requests, shutdown_timeout=args.shutdown_timeout,
          max_body_bytes=args.max_request_bytes, tool_call_parser=args.tool_call_parser,
          log_level="warning" if args.quiet else args.log_level)
    return 0


def _tune(args) -> int:
    ks = _int_list(args.num_speculative_tokens_list, "--num-speculative-tokens-list", 0)
    budgets = _int_list(args.max_num_batched_tokens_list, "--max-num-batched-tokens-list", 1)
    path_counts = _int_list(args.num_draft_paths_list, "--num-draft-paths-list", 1)
    methods = (args.speculative_methods or (args.speculative_method if args.speculative_method != "none"
                                            else "ngram")).split(",")
    for method in methods:
        if method not in SPECULATIVE_METHODS or method == "none":
            raise ValueError(f"--speculative-methods: unknown drafter {method!r}")
    # Draft paths need a drafter that ranks candidates; the others run a chain.
    paths = {m: path_counts if m in PATH_METHODS else [1] for m in methods}
    if max(path_counts) > 1 and not any(m in PATH_METHODS for m in methods):
        raise ValueError(f"--num-draft-paths-list {args.num_draft_paths_list}: draft paths need "
                         f"{' or '.join(PATH_METHODS)} among --speculative-methods")
    if not (args.request_rate > 0):
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
    base = {k: getattr(args, k) for k in ENGINE_FLAGS}
    base["max_num_batched_tokens"] = max(budgets)
    # One engine per drafter, loaded once; k varies per request, the budget on the scheduler.
    # k = 0 runs on the n-gram engine when there is one (it drafts nothing for those
    # requests), so plain decoding needs no engine of its own.
    engines = {}
    for method in methods if any(k > 0 for k in ks) else []:
        engines[method] = LLMEngine(EngineConfig(**{**base, "speculative_method": method,
                                                    "num_speculative_tokens": max(ks),
                                                    "num_draft_paths": max(paths[method]),
                                                    "speculative_adaptive": False}))
    if 0 in ks:
        engines["none"] = engines.get("ngram") or LLMEngine(
            EngineConfig(**{**base, "speculative_method": "none"}))
    any_engine = next(iter(engines.values()))
    requests = load_workload(args.workload, args.num_prompts, output_len=args.output_len,
                             input_len=args.input_len, seed=args.seed, tokenizer=any_engine.tokenizer)
    objectives = Objectives(args.ttft_slo_ms, args.tpot_slo_ms)
    rows = tune(engines, requests, settings_grid(methods, ks, budgets, paths), objectives,
                request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                progress=not args.quiet)
    load = (f"{args.request_rate:g} requests/s" if not math.isinf(args.request_rate) else "all at once") + (
        f", at most {args.max_concurrency} in flight" if args.max_concurrency else "")
    print(f"{args.workload}: {len(requests)} requests x {args.output_len} tokens, {load}")
    print(format_table(rows, objectives))
    best = rows[0]
    config = best_config({k: v for k, v in base.items() if k != "speculative_adaptive"}, best["setting"])
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(f"# specserve tune: best of {len(rows)} settings for {args.workload} ({load})\n")
        yaml.safe_dump(config, f, sort_keys=False)
    verdict = "meets the objectives" if best["objectives_met"] else "misses the objectives least"
    print(f"best: {best['setting'].label} ({best['output_throughput']:.1f} tokens/s, {verdict}); "
          f"written to {args.output} (specserve serve --config {args.output})")
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump([{**r, "setting": r["setting"].label} for r in rows], f, indent=1)
    return 0


def _int_list(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < minimum:
        raise ValueError(f"{flag} values must be >= {minimum}, got {text!r}")
    return values


def _bench(args) -> int:
    return run_bench(args, {k: getattr(args, k) for k in ENGINE_FLAGS})


def _stats(final, elapsed: float, ttft: float | None) -> dict:
    n = len(final.token_ids)
    spec = final.spec_stats
    return {"num_prompt_tokens": len(final.prompt_token_ids), "num_output_tokens": n,
            "elapsed_s": round(elapsed, 4), "ttft_s": round(ttft or 0.0, 4),
            "tokens_per_s": round(n / elapsed, 2) if elapsed > 0 else 0.0,
            "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
            "speculation": spec.as_dict()}


if __name__ == "__main__":
    run_main(main)
