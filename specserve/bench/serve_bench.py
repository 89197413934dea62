"""The serving benchmark: streaming requests against an OpenAI-compatible server.

The server is either one already running (``--base-url``) or one started here on a free
local port for each speculation setting asked for (``--speculation none,ngram:4``): a
``specserve serve`` child process by default, or a thread of this process. Requests are sent at arrival times drawn for a request rate (Poisson, or
gamma with a burstiness factor; inf sends all at once), optionally capped at a fixed
number in flight (``--max-concurrency``); a sweep repeats the run for several rates.
Warm-up requests run first and are not measured. Results use ``vllm bench serve``'s keys
(see ``stats``), so numbers from both tools can be compared.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from tqdm.auto import tqdm

from specserve.async_engine import AsyncLLMEngine
from specserve.bench.arrivals import arrival_times
from specserve.bench.client import (
    RequestResult,
    read_spec_counters,
    request_body,
    send_request,
)
from specserve.bench.stats import (
    DEFAULT_PERCENTILES,
    calculate_metrics,
    format_draft_lengths,
    mean_draft_length,
    per_request,
    spec_decode_metrics,
)
from specserve.bench.workloads import BenchRequest
from specserve.config import DRAFT_STOPPING, SPECULATIVE_METHODS
from specserve.engine import LLMEngine
from specserve.engine_flags import ENGINE_FLAGS
from specserve.server import ThreadedServer

logger = logging.getLogger("specserve")

ENDPOINTS = ("auto", "completions", "chat")


@dataclass
class ServeOptions:
    """How one serving run sends its requests (the server is given separately)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    endpoint: str = "auto"             # auto: chats to /v1/chat/completions, the rest to /v1/completions
    served_model_name: str | None = None  # None: the first model /v1/models lists
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    num_warmups: int = 1
    seed: int = 0
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput: dict[str, float] | None = None
    extra_body: dict = field(default_factory=dict)
    save_detailed: bool = False
    progress: bool = True
    label: str = ""


# ---------------------------------------------------------------------- one run
async def run_benchmark(base_url: str, requests: list[BenchRequest], opts: ServeOptions) -> dict:
    """Send ``requests`` to ``base_url`` as ``opts`` says; returns the result dict.
    ValueError when the server cannot be reached or the warm-up request fails."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits,
                                 headers=headers) as http:
        model = opts.served_model_name or await _served_model(http, base_url)

        def target(req: BenchRequest) -> tuple[str, dict]:
            chat = req.is_chat if opts.endpoint == "auto" else opts.endpoint == "chat"
            url = f"{base_url}/v1/{'chat/completions' if chat else 'completions'}"
            return url, request_body(req, chat, model, opts.temperature, opts.ignore_eos, opts.extra_body)

        for _ in range(opts.num_warmups):
            warm = await send_request(http, *target(requests[0]))
            if not warm.success:
                raise ValueError(f"the warm-up request failed: {warm.error}")
        before = await read_spec_counters(http, base_url)
        times = arrival_times(len(requests), opts.request_rate, opts.burstiness, opts.seed)
        limit = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
        bar = tqdm(total=len(requests), desc=opts.label or "requests", unit="req",
                   disable=not opts.progress, leave=False)
        start = time.perf_counter()

        # A chat's later turn waits for the answer it continues (its messages and text).
        answers = [asyncio.get_running_loop().create_future() for _ in requests]

        async def one(i: int, req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if req.follows is not None:
                messages, text = await answers[req.follows]
                req = dataclasses.replace(req, follows=None, messages=[
                    *messages, {"role": "assistant", "content": text}, *req.messages])
            result = None
            try:
                if limit is None:
                    result = await send_request(http, *target(req))
                else:
                    async with limit:
                        result = await send_request(http, *target(req))
            finally:  # a failed turn still lets the chat go on (with an empty answer)
                answers[i].set_result((req.messages, result.text if result is not None else ""))
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i, r, t) for i, (r, t) in enumerate(zip(requests, times))))
        duration = time.perf_counter() - start
        bar.close()
        # The engine publishes its counters right after delivering a step's outputs; give
        # it a moment so the last step is counted.
        await asyncio.sleep(0.1)
        after = await read_spec_counters(http, base_url)
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "specserve",
           "label": opts.label, "model_id": model, "base_url": base_url,
           "num_prompts": len(requests), "request_rate": _rate_value(opts.request_rate),
           "burstiness": opts.burstiness, "max_concurrency": opts.max_concurrency,
           "temperature": opts.temperature, "ignore_eos": opts.ignore_eos,
           **calculate_metrics(results, duration, opts.percentiles, opts.goodput),
           **spec_decode_metrics(before, after)}
    detail = per_request(results, start)
    if opts.save_detailed:
        out.update(detail, generated_texts=[r.text for r in results])
    else:
        out["_detail"] = detail  # for plots; dropped when the JSON is written
    failed = [r.error for r in results if not r.success]
    if failed:
        logger.warning("%d of %d requests failed; the first: %s", len(failed), len(results), failed[0])
    return out


def _rate_value(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


async def _served_model(http: httpx.AsyncClient, base_url: str) -> str:
    try:
        response = await http.get(base_url + "/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach the server at {base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models answered HTTP {response.status_code}: {response.text[:200]}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{base_url}/v1/models listed no model; pass --served-model-name") from None


# ---------------------------------------------------------------------- servers started here
class ServerProcess:
    """``specserve serve`` in a child process on a free port of 127.0.0.1, as ``vllm bench
    serve`` measures ``vllm serve``: the client never shares an interpreter (and its GIL)
    with the engine. ``with ServerProcess(config) as server: server.url``. A server that
    fails to start raises ValueError with its last line (bad engine flags say why)."""

    def __init__(self, config, quiet: bool = False, start_timeout: float = 600.0) -> None:
        self.config, self.quiet, self.start_timeout = config, quiet, start_timeout
        self.info: dict = {}

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--log-level", "warning", *engine_args(self.config)]
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._drain, daemon=True).start()
        deadline, last = time.monotonic() + self.start_timeout, "no output"
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._stop()
                raise ValueError(f"the benchmark's server did not start within {self.start_timeout:.0f} s") from None
            if line is None:  # it exited
                self.proc.wait()
                raise ValueError(f"the benchmark's server did not start: {last.removeprefix('specserve: error: ')}")
            last = line.strip() or last
            self._parse(line)
            if "serving " in line and "http://" in line:
                self.url = "http://" + line.split("http://", 1)[1].split("/v1", 1)[0]
                return self

    def _drain(self) -> None:
        """Forward the server's log (unless quiet) and hand lines to ``__enter__``."""
        for line in self.proc.stderr:
            if not self.quiet:
                sys.stderr.write(line)
            self._lines.put(line)
        self._lines.put(None)

    def _parse(self, line: str) -> None:
        """What the engine's start-up log says about where it runs."""
        key, _, value = line.strip().partition(" ")
        value = value.strip()
        if key == "model":
            self.info["model"] = value.split(" (")[0]
        elif key == "device" and ", dtype " in value:
            device, dtype = value.split(", dtype ", 1)
            self.info.update(device=device, dtype=dtype.split(",")[0])

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def describe(self) -> dict:
        return {**self.info, "mode": "process", "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "max_num_seqs": self.config.max_num_seqs}


def engine_args(config) -> list[str]:
    """The ``specserve serve`` flags that rebuild ``config``."""
    args = []
    for name in ENGINE_FLAGS:
        value, flag = getattr(config, name), name.replace("_", "-")
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", str(value)]
    return args


class InProcessServer:
    """The engine and the HTTP app under uvicorn in a thread of this process, on a free
    port: quick to start (tests), but the client then shares the interpreter with the
    engine, which costs the engine some throughput on a machine of few cores."""

    def __init__(self, config, quiet: bool = False) -> None:
        self.config = config

    def __enter__(self) -> InProcessServer:
        from specserve.server.app import create_app  # lazy: fastapi, only to serve in this process

        self.engine = AsyncLLMEngine(LLMEngine(self.config))
        self.http = ThreadedServer(create_app(self.engine)).__enter__()
        self.url = self.http.url
        return self

    def __exit__(self, *exc) -> None:
        self.http.__exit__(*exc)

    def describe(self) -> dict:
        llm = self.engine.engine
        return {"model": llm.model_name, "device": str(llm.device),
                "dtype": str(llm.dtype).removeprefix("torch."), "mode": "thread",
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "max_num_seqs": self.config.max_num_seqs}


SERVER_MODES = {"process": ServerProcess, "thread": InProcessServer}


# ---------------------------------------------------------------------- speculation settings
@dataclass(frozen=True)
class Speculation:
    """One speculation setting for a server started here: ``none`` or
    ``METHOD[:K][:adaptive][:tree=N][:stop=MODE]`` (adaptive: the engine chooses each
    request's k up to K every step; tree: a dynamic draft tree of up to N further nodes;
    stop: ``draft_stopping``, how an adaptive engine's drafting stops)."""

    method: str
    k: int | None = None
    adaptive: bool = False
    tree: int = 0
    stop: str | None = None

    @property
    def label(self) -> str:
        if self.method == "none":
            return "spec off"
        return (self.method + (f" k={self.k}" if self.k is not None else "")
                + (" adaptive" if self.adaptive else "") + (f" tree={self.tree}" if self.tree else "")
                + (f" stop={self.stop}" if self.stop else ""))

    def apply(self, config):
        if self.method == "none":
            return dataclasses.replace(config, speculative_method="none")
        k = self.k if self.k is not None else config.num_speculative_tokens
        return dataclasses.replace(config, speculative_method=self.method, num_speculative_tokens=k,
                                   speculative_adaptive=self.adaptive,
                                   draft_tree_nodes=self.tree or config.draft_tree_nodes,
                                   draft_stopping=self.stop or config.draft_stopping)


def parse_speculation(text: str) -> list[Speculation]:
    """``"none,ngram:4,ngram:4:adaptive,draft_model:4:adaptive:tree=10,layerskip:2,
    ngram:4:adaptive:stop=plan"`` -> settings; ValueError on an unknown method, a bad k or
    a bad option."""
    out = []
    for part in text.split(","):
        method, *rest = part.strip().split(":")
        k, adaptive, tree, stop = None, False, 0, None
        if rest and rest[0].isdigit():
            k = int(rest.pop(0))
            if k < 1 or method == "none":
                raise ValueError(f"--speculation {part.strip()!r}: give METHOD:K with K a positive integer")
        for option in rest:
            name, eq, value = option.partition("=")
            if option == "adaptive" and not adaptive:
                adaptive = True
            elif name == "tree" and eq and value.isdigit() and int(value) > 0 and not tree:
                tree = int(value)
            elif name == "stop" and value in DRAFT_STOPPING and stop is None:
                stop = value
            else:
                raise ValueError(f"--speculation {part.strip()!r}: unknown option {option!r} "
                                 "(expected METHOD[:K][:adaptive][:tree=N][:stop=MODE], K and N positive "
                                 f"integers, MODE one of {', '.join(DRAFT_STOPPING)})")
        if method == "none" and (adaptive or tree or stop):
            raise ValueError(f"--speculation {part.strip()!r}: speculation off has nothing to adapt or grow")
        if stop and not adaptive:
            raise ValueError(f"--speculation {part.strip()!r}: stop=MODE says how an adaptive engine's drafting "
                             "stops; add :adaptive")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculation {part.strip()!r}: the method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        out.append(Speculation(method, k, adaptive, tree, stop))
    return out


# ---------------------------------------------------------------------- runs and sweeps
def run_serve(requests: list[BenchRequest], opts: ServeOptions, rates: list[float], *,
              base_url: str | None = None, engine_config=None,
              speculation: list[Speculation] | None = None, server_mode: str = "process") -> list[dict]:
    """One run per (speculation setting, rate): against ``base_url``, or against a server
    started here per setting from ``engine_config`` (``server_mode``: a child process, or
    a thread of this process)."""
    runs = []
    if base_url is not None:
        for rate in rates:
            label = f"{rate:g} req/s"
            runs.append(asyncio.run(run_benchmark(base_url, requests, dataclasses.replace(
                opts, request_rate=rate, label=label))))
        return runs
    for spec in speculation or [None]:
        config = spec.apply(engine_config) if spec else engine_config
        with SERVER_MODES[server_mode](config, quiet=not opts.progress) as server:
            server_info = server.describe()
            for rate in rates:
                name = spec.label if spec else config_label(config)
                run = asyncio.run(run_benchmark(server.url, requests, dataclasses.replace(
                    opts, request_rate=rate, label=f"{name} @ {rate:g} req/s")))
                run.update(speculation=name, speculative_method=config.speculative_method,
                           num_speculative_tokens=config.max_draft_tokens
                           if config.speculative_method != "none" else 0, server=server_info)
                runs.append(run)
    return runs


def config_label(config) -> str:
    if config.speculative_method == "none":
        return "spec off"
    return f"{config.speculative_method} k={config.max_draft_tokens}"


# ---------------------------------------------------------------------- console output
def format_run(run: dict, percentiles=DEFAULT_PERCENTILES) -> str:
    """A run as ``vllm bench serve`` prints it, speculation included."""
    lines = [f"{' Serving Benchmark Result ':=^60}"]
    if run.get("label"):
        lines.append(f"{'Run:':<44} {run['label']}")

    def row(name, value, fmt="{:<10.2f}"):
        lines.append(f"{name:<44} {fmt.format(value)}")

    row("Successful requests:", run["completed"], "{:<10}")
    row("Failed requests:", run["failed"], "{:<10}")
    if run.get("max_concurrency"):
        row("Maximum request concurrency:", run["max_concurrency"], "{:<10}")
    if run["request_rate"] != "inf":
        row("Request rate configured (RPS):", run["request_rate"])
    row("Benchmark duration (s):", run["duration"])
    row("Total input tokens:", run["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", run["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", run["request_throughput"])
    if run.get("request_goodput") is not None:
        row("Request goodput (req/s):", run["request_goodput"])
    row("Output token throughput (tok/s):", run["output_throughput"])
    row("Peak concurrent requests:", run["max_concurrent_requests"], "{:<10}")
    row("Total token throughput (tok/s):", run["total_token_throughput"])
    for key, name, header in (("ttft", "TTFT", "Time to First Token"),
                              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl", "ITL", "Inter-token Latency"),
                              ("e2el", "E2EL", "End-to-end Latency")):
        lines.append(f"{header:-^60}")
        row(f"Mean {name} (ms):", run[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", run[f"median_{key}_ms"])
        for p in percentiles:
            word = str(int(p)) if float(p).is_integer() else str(p)
            row(f"P{word} {name} (ms):", run[f"p{word}_{key}_ms"])
    if "spec_decode_acceptance_length" in run:
        lines.append(f"{'Speculative Decoding':-^60}")
        row("Acceptance rate (%):", run["spec_decode_acceptance_rate"])
        row("Acceptance length:", run["spec_decode_acceptance_length"])
        row("Drafts:", run["spec_decode_num_drafts"], "{:<10}")
        row("Draft tokens:", run["spec_decode_draft_tokens"], "{:<10}")
        row("Accepted tokens:", run["spec_decode_accepted_tokens"], "{:<10}")
        lines.append(f"{'Per-position acceptance rate:':<44} "
                     + " ".join(f"{x:.2f}" for x in run["spec_decode_per_position_acceptance_rates"]))
    if format_draft_lengths(run):
        lines.append(f"{'Draft length chosen (request-steps):':<44} {format_draft_lengths(run)}")
    if run.get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (%):", run["prefix_cache_hit_rate"])
    lines.append("=" * 60)
    return "\n".join(lines)


def compare_to_off(runs: list[dict]) -> None:
    """Set each speculative run's ``output_throughput_vs_off``: its output tokens/s over
    speculation off's run of the same round and rate (nothing without off). One process's
    rounds share its host, whose speed can drift between processes more than the settings
    differ; a ratio within a round does not carry that drift."""
    off = {(r.get("round"), r["request_rate"]): r["output_throughput"] for r in runs
           if r.get("speculative_method") == "none"}
    for r in runs:
        base = off.get((r.get("round"), r["request_rate"]))
        if base and r.get("speculative_method") != "none":
            r["output_throughput_vs_off"] = r["output_throughput"] / base


def rounds_table(runs: list[dict]) -> str | None:
    """Each setting's ``output_throughput_vs_off`` (``compare_to_off``) at each rate, round
    by round, and their median; None where no run has one."""
    rows: dict[tuple[str, object], list[float]] = {}
    for r in runs:
        if "output_throughput_vs_off" in r:
            rows.setdefault((r["speculation"], r["request_rate"]), []).append(r["output_throughput_vs_off"])
    if not rows:
        return None
    lines = ["| speculation | rate (req/s) | vs speculation off, by round | median |",
             "| --- | ---: | --- | ---: |"]
    for (name, rate), ratios in rows.items():
        lines.append(f"| {name} | {rate} | {', '.join(f'{x:.2f}x' for x in ratios)} "
                     f"| {statistics.median(ratios):.2f}x |")
    return "\n".join(lines)


def summary_table(runs: list[dict]) -> str:
    """A markdown table of several runs, one line each."""
    head = ("| speculation | rate (req/s) | completed | req/s | output tok/s | TTFT mean / p99 (ms) "
            "| TPOT mean / p99 (ms) | ITL mean (ms) | E2EL mean / p99 (s) | acceptance length | mean k "
            "| prefix cache hits (%) |")
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        accept, mean_k = r.get("spec_decode_acceptance_length"), mean_draft_length(r)
        hit = r.get("prefix_cache_hit_rate")
        name = r.get("speculation", r.get("label", "")) + (f" (round {r['round']})" if "round" in r else "")
        lines.append(
            f"| {name} | {r['request_rate']} | {r['completed']}/{r['num_prompts']} "
            f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} "
            f"| {r['mean_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} "
            f"| {r['mean_itl_ms']:.1f} | {r['mean_e2el_ms'] / 1000:.2f} / {r['p99_e2el_ms'] / 1000:.2f} "
            f"| {f'{accept:.2f}' if accept else ''} | {'' if mean_k is None else f'{mean_k:.2f}'} "
            f"| {'' if hit is None else f'{hit:.1f}'} |")
    return "\n".join(lines)
