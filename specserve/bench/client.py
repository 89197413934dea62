"""The benchmark's HTTP client: one streaming request at a time over httpx, timed on
arrival of every chunk, and the speculation counters read from ``/metrics``.

Timing follows ``vllm bench serve``: TTFT is the time from sending to the first chunk that
carries text; ITL is the gap between successive text chunks (one chunk may carry several
tokens when drafts are accepted); end-to-end latency ends at the last chunk. Token counts
come from the usage chunk (``stream_options.include_usage``), so they are exact.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specserve.bench.workloads import BenchRequest


@dataclass
class RequestResult:
    """What the client saw of one request. Times are ``time.perf_counter()`` seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0             # usage.prompt_tokens
    output_len: int = 0             # usage.completion_tokens
    send_time: float = 0.0
    ttft: float = 0.0               # seconds from sending to the first text chunk
    latency: float = 0.0            # seconds from sending to the last chunk
    itl: list[float] = field(default_factory=list)          # gaps between text chunks
    chunk_times: list[float] = field(default_factory=list)  # arrival of every text chunk
    text: str = ""
    finish_reason: str | None = None


def request_body(req: BenchRequest, chat: bool, model: str | None, temperature: float,
                 ignore_eos: bool, extra: dict | None = None) -> dict:
    body = {"max_tokens": req.max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt_text()}]
    else:
        body["prompt"] = req.prompt_text()
    return {**body, **(extra or {})}


async def send_request(http: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """POST one streaming request and time its chunks; never raises for a failed request
    (``success`` False and ``error`` say what went wrong)."""
    chat = "messages" in body
    result = RequestResult(send_time=time.perf_counter())
    last = result.send_time
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = _error_message(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    result.prompt_len = event["usage"].get("prompt_tokens", 0)
                    result.output_len = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        if not result.chunk_times:
                            result.ttft = now - result.send_time
                        else:
                            result.itl.append(now - last)
                        result.chunk_times.append(now)
                        result.text += text
                    if text or choice.get("finish_reason"):
                        last = now
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if not result.chunk_times and result.output_len:
        result.error = "the stream carried no text"  # tokens that decode to nothing
        return result
    result.latency = last - result.send_time
    result.success = result.finish_reason is not None
    if not result.success:
        result.error = "the stream ended without a finish_reason"
    return result


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status}: {message}"


# ---------------------------------------------------------------------- /metrics
@dataclass
class SpecCounters:
    """The speculation and prefix-cache counters of a server's /metrics (specserve's or
    vLLM's names)."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    draft_lengths: dict[int, float] = field(default_factory=dict)  # k chosen -> request-steps
    prefix_cache_queries: float = 0.0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: float = 0.0     # of which found there


_COUNTERS = {"spec_decode_num_drafts_total": "num_drafts",
             "spec_decode_num_draft_tokens_total": "num_draft_tokens",
             "spec_decode_num_accepted_tokens_total": "num_accepted_tokens",
             "prefix_cache_queries_total": "prefix_cache_queries",
             "prefix_cache_hits_total": "prefix_cache_hits"}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"
_DRAFT_LENGTH_BUCKET = "spec_decode_draft_length_bucket"


async def read_spec_counters(http: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    """The counters now, or None when the server has no /metrics or none of these counters."""
    try:
        response = await http.get(base_url + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_spec_counters(response.text)


def parse_spec_counters(text: str) -> SpecCounters | None:
    counters, found = SpecCounters(), False
    cumulative: dict[int, float] = {}  # the draft-length histogram's buckets, k -> requests with <= k
    # specserve serves its series under both prefixes: read one ("specserve:" where present).
    prefix = "specserve:" if "specserve:" in text else "vllm:"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix):
                continue
            name = sample.name.removeprefix(prefix)
            if name in _COUNTERS:
                setattr(counters, _COUNTERS[name], getattr(counters, _COUNTERS[name]) + sample.value)
                found = True
            elif name == _PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                counters.accepted_per_position[pos] = counters.accepted_per_position.get(pos, 0) + sample.value
            elif name == _DRAFT_LENGTH_BUCKET and sample.labels.get("le", "+Inf") != "+Inf":
                k = int(float(sample.labels["le"]))
                cumulative[k] = cumulative.get(k, 0) + sample.value
    below = 0.0
    for k in sorted(cumulative):
        counters.draft_lengths[k], below = cumulative[k] - below, cumulative[k]
    return counters if found else None
