"""A soak: ``specserve serve`` under steady mixed load with disconnects for N minutes,
sampling the server's RSS, its KV-cache usage and the errors seen over time.

One server child (``ServerProcess``, default model unless ``--model``) and ``--concurrency``
clients that each send one request after another: chat or completions, streamed or not,
greedy or sampled, sometimes with ``n`` 2, log-probabilities, stop strings or penalties;
a share of them hang up mid-stream or time out, and a share are malformed (a 400 is the
right answer). Every ``--interval`` seconds the server's RSS and ``/metrics`` are read.
When the load stops, the KV cache must drain back to zero blocks.

Fails (exit 1) on any 5xx, any unexpected answer, or KV blocks still in use after the load.

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/soak_cpu
    python benchmarks/soak.py --minutes 2 --speculative-method ngram     # a quick look
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.cli import describe_machine
from specserve.bench.serve_bench import ServerProcess
from specserve.bench.workloads import chat_prompts, code_edit_prompts
from specserve.config import EngineConfig


@dataclass
class Tally:
    ok: int = 0
    disconnected: int = 0           # the client hung up or timed out on purpose
    refused: int = 0                # malformed on purpose, answered 4xx
    errors: list[str] = field(default_factory=list)   # anything else
    tokens: int = 0

    def total(self) -> int:
        return self.ok + self.disconnected + self.refused + len(self.errors)


def make_request(rng: random.Random, model: str, prompts: list[str]) -> tuple[str, dict, str]:
    """(path, body, intent): intent is ok, disconnect or bad."""
    chat = rng.random() < 0.7
    text = rng.choice(prompts)
    body: dict = {"model": model, "max_tokens": rng.randint(8, 96),
                  "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]), "stream": rng.random() < 0.7}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    extra = rng.random()
    if extra < 0.1:
        body["n"] = 2
    elif extra < 0.2:
        body["logprobs"] = True if chat else 2
        if chat:
            body["top_logprobs"] = 2
    elif extra < 0.3:
        body["stop"] = [rng.choice(["\n\n", ".", "def "])]
    elif extra < 0.4:
        body["presence_penalty"] = 0.5
        body["seed"] = rng.randint(0, 1000)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    intent = rng.choices(["ok", "disconnect", "bad"], weights=[0.75, 0.2, 0.05])[0]
    if intent == "bad":
        body[rng.choice(["temperature", "max_tokens", "n"])] = rng.choice([-1, "x"])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, intent


async def one_request(http: httpx.AsyncClient, url: str, body: dict, intent: str, rng: random.Random,
                      tally: Tally) -> None:
    try:
        if body["stream"]:
            hang_up_after = rng.randint(1, 8) if intent == "disconnect" else None
            async with http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    await _status(response.status_code, (await response.aread())[:200], intent, tally)
                    return
                chunks = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tally.errors.append(f"stream error: {chunk['error'].get('message', '')[:160]}")
                        return
                    if chunk.get("usage"):
                        tally.tokens += chunk["usage"]["completion_tokens"]
                    chunks += 1
                    if hang_up_after is not None and chunks >= hang_up_after:
                        tally.disconnected += 1
                        return       # leaving the block closes the connection mid-stream
            _settle(intent, tally)
        else:
            timeout = rng.uniform(0.05, 1.0) if intent == "disconnect" else None
            try:
                response = await http.post(url, json=body, **({"timeout": timeout} if timeout else {}))
            except httpx.TimeoutException:
                if intent == "disconnect":
                    tally.disconnected += 1
                    return
                raise
            if response.status_code != 200:
                await _status(response.status_code, response.content[:200], intent, tally)
                return
            tally.tokens += response.json()["usage"]["completion_tokens"]
            _settle(intent, tally)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        tally.errors.append(f"{type(exc).__name__}: {exc}"[:200])


async def _status(status: int, content: bytes, intent: str, tally: Tally) -> None:
    if intent == "bad" and 400 <= status < 500:
        tally.refused += 1
    else:
        tally.errors.append(f"HTTP {status}: {content.decode(errors='replace')}")


def _settle(intent: str, tally: Tally) -> None:
    if intent == "bad":
        tally.errors.append("a malformed request was answered 200")
    elif intent == "disconnect":
        tally.disconnected += 1   # it finished before the client hung up
    else:
        tally.ok += 1


def read_metrics(text: str) -> dict:
    wanted = {"specserve:kv_cache_usage_perc": "kv_usage", "specserve:kv_cache_free_blocks": "kv_free_blocks",
              "specserve:num_requests_running": "running", "specserve:num_requests_waiting": "waiting"}
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = sample.value
    return out


def rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


async def soak(base_url: str, pid: int, model: str, args) -> dict:
    prompts = [*chat_prompts(), *code_edit_prompts()]
    tally, samples = Tally(), []
    start = time.monotonic()
    stop_at = start + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
        async def client(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < stop_at:
                path, body, intent = make_request(rng, model, prompts)
                await one_request(http, path, body, intent, rng, tally)

        async def sampler() -> None:
            while True:
                metrics = read_metrics((await http.get("/metrics")).text)
                samples.append({"t_min": (time.monotonic() - start) / 60, "rss_mb": rss_mb(pid),
                                "requests": tally.total(), "errors": len(tally.errors), **metrics})
                if time.monotonic() >= stop_at and not any(not t.done() for t in clients):
                    return
                await asyncio.sleep(args.interval)

        clients = [asyncio.create_task(client(i)) for i in range(args.concurrency)]
        watcher = asyncio.create_task(sampler())
        await asyncio.gather(*clients)
        await watcher
        drained = None
        for _ in range(60):  # every request has ended: the cache must empty at once
            metrics = read_metrics((await http.get("/metrics")).text)
            if metrics.get("kv_usage", 1) == 0 and metrics.get("running", 1) == 0:
                drained = metrics
                break
            await asyncio.sleep(0.5)
    return {"tally": asdict(tally), "samples": samples, "drained": drained is not None,
            "final_metrics": drained or metrics}


def summarize(result: dict, warm_up_min: float) -> dict:
    samples = result["samples"]
    after = [s for s in samples if s["t_min"] >= warm_up_min]
    slope = 0.0
    if len(after) >= 3:
        ts, ys = [s["t_min"] for s in after], [s["rss_mb"] for s in after]
        slope = statistics.linear_regression(ts, ys).slope
    marks = {}
    for minute in (1, 5, 10, 15, 20, 25, 30, 45, 60):
        near = [s for s in samples if s["t_min"] <= minute + 1e-9]
        if near and samples[-1]["t_min"] >= minute - 0.5:
            marks[minute] = round(near[-1]["rss_mb"], 1)
    return {"rss_mb_at_minute": marks, "rss_slope_mb_per_min_after_warm_up": round(slope, 3),
            "rss_peak_mb": round(max(s["rss_mb"] for s in samples), 1),
            "kv_usage_peak": max(s.get("kv_usage", 0) for s in samples)}


def plot(result: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t_min"] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s["rss_mb"] for s in samples], color="tab:blue", label="server RSS (MB)")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)", color="tab:blue")
    kv = ax.twinx()
    kv.plot(t, [100 * s.get("kv_usage", 0) for s in samples], color="tab:orange", alpha=0.6,
            label="KV cache in use (%)")
    kv.set_ylabel("KV cache in use (%)", color="tab:orange")
    kv.set_ylim(0, 100)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warm-up", type=float, default=5.0, help="minutes before RSS should be flat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--speculative-method", default="draft_model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None, help="folder for soak.json and soak.png")
    args = parser.parse_args(argv)
    config = EngineConfig(**({"model": args.model} if args.model else {}), device=args.device,
                          speculative_method=args.speculative_method)
    with ServerProcess(config, quiet=True) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        result = asyncio.run(soak(server.url, server.proc.pid, model, args))
        machine = {**describe_machine(), **server.describe()}
    result.update(summary=summarize(result, args.warm_up), machine=machine, args=vars(args),
                  date=time.strftime("%Y-%m-%d"))
    tally, summary = result["tally"], result["summary"]
    print(f"requests {sum(tally[k] for k in ('ok', 'disconnected', 'refused')) + len(tally['errors'])}: "
          f"{tally['ok']} ok, {tally['disconnected']} hung up, {tally['refused']} refused (malformed), "
          f"{len(tally['errors'])} errors; {tally['tokens']} tokens")
    print("minute  RSS (MB)")
    for minute, mb in summary["rss_mb_at_minute"].items():
        print(f"{minute:>6}  {mb:8.1f}")
    print(f"RSS slope after {args.warm_up:g} min: {summary['rss_slope_mb_per_min_after_warm_up']:+.3f} MB/min; "
          f"peak {summary['rss_peak_mb']} MB; KV peak {100 * summary['kv_usage_peak']:.0f} %; "
          f"KV back to 0 after the load: {result['drained']}")
    for error in tally["errors"][:10]:
        print("error:", error)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(result, indent=1))
        plot(result, out / "soak.png", f"soak: {args.minutes:g} min, {args.concurrency} clients, "
                                       f"{args.speculative_method}")
    return 0 if result["drained"] and not tally["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
