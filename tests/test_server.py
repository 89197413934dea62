"""The HTTP server, end to end: a real uvicorn on 127.0.0.1, the official ``openai``
client and raw httpx, over the tiny model."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve import EngineConfig, LLMEngine
from specserve.async_engine import AsyncLLMEngine
from specserve.server import ThreadedServer
from specserve.server.app import create_app

KEY = "sk-test-key"


def make_server(model_dir, *, max_queued_requests=None, api_key=None, max_body_bytes=None,
                **engine_kwargs) -> tuple[ThreadedServer, AsyncLLMEngine]:
    settings = dict(dtype="float32", block_size=4, num_kv_blocks=512, max_num_batched_tokens=64,
                    max_num_seqs=32, max_model_len=512)
    config = EngineConfig(model=str(model_dir), **{**settings, **engine_kwargs})
    engine = AsyncLLMEngine(LLMEngine(config), max_queued_requests=max_queued_requests)
    kwargs = {"max_body_bytes": max_body_bytes} if max_body_bytes else {}
    return ThreadedServer(create_app(engine, served_model_name="tiny", api_key=api_key, **kwargs)), engine


@pytest.fixture(scope="module")
def server(chat_model_dir):
    srv, engine = make_server(chat_model_dir, speculative_method="ngram", num_speculative_tokens=3)
    with srv:
        srv.engine = engine
        yield srv


def client(srv, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=kwargs.pop("api_key", "none"),
                         max_retries=0, **kwargs)


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body into JSON events, with the final "[DONE]" kept as a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


# ---------------------------------------------------------------------- streaming vs not
def test_completion_stream_equals_non_stream(server):
    body = {"model": "tiny", "prompt": "def add(a, b):", **GREEDY}
    whole = httpx.post(server.url + "/v1/completions", json=body).json()
    assert whole["object"] == "text_completion"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 12
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_event, chunks = events[-2], events[:-2]
    # The same prompt again: the stream's comes from the prefix cache (every whole block of
    # 4 before its last token). How many tokens each drafted is the adaptive controller's
    # choice, which learns from the first request and from measured step times, so only the
    # form of the speculation figures is compared; the rest of the usage is equal.
    cached = usage_event["usage"].pop("prompt_tokens_details")["cached_tokens"]
    whole["usage"].pop("prompt_tokens_details")
    assert cached == (whole["usage"]["prompt_tokens"] - 1) // 4 * 4 > 0
    spec_stream, spec_whole = usage_event["usage"].pop("speculation"), whole["usage"].pop("speculation")
    assert spec_stream.keys() == spec_whole.keys()
    assert usage_event["choices"] == [] and usage_event["usage"] == whole["usage"]
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and reasons.count("length") == 1 and set(reasons[:-1]) <= {None}
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_chat_stream_equals_non_stream_with_openai_client(server):
    api = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                        max_tokens=10, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10
    stream = api.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                         max_tokens=10, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    content = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in content].count("length") == 1
    assert content[-1].choices[0].finish_reason == "length"


def test_stop_string_and_eos_finish_with_stop(server):
    api = client(server)
    full = api.completions.create(model="tiny", prompt="import os", temperature=0, max_tokens=20,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    out = api.completions.create(model="tiny", prompt="import os", temperature=0, max_tokens=20,
                                 stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]


def test_several_prompts_give_one_choice_each(server):
    api = client(server)
    prompts = ["alpha", "beta gamma", "delta"]
    batch = api.completions.create(model="tiny", prompt=prompts, **{k: GREEDY[k] for k in ("temperature", "max_tokens")},
                                   extra_body={"ignore_eos": True})
    singles = [api.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage.completion_tokens == 36
    streamed = {i: "" for i in range(3)}
    for chunk in api.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=12,
                                        stream=True, extra_body={"ignore_eos": True}):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert list(streamed.values()) == singles


def test_token_id_prompt(server):
    out = httpx.post(server.url + "/v1/completions",
                     json={"prompt": [5, 6, 7, 8], **GREEDY}).json()
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["completion_tokens"] == 12


def test_usage_and_metrics_report_the_prefix_cache(server):
    """A prompt resent whole is served from the prefix cache: OpenAI's
    ``prompt_tokens_details.cached_tokens`` says how much, with the same completion, and
    /metrics counts the tokens looked up and found."""
    prompt = list(range(300, 341))  # 41 tokens: 10 whole blocks before the last token
    queries, hits = metric(server, "specserve:prefix_cache_queries_total"), metric(server, "specserve:prefix_cache_hits_total")
    first = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, **GREEDY}).json()
    again = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, **GREEDY}).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    wait_for(lambda: metric(server, "specserve:prefix_cache_queries_total") >= queries + 82)
    assert metric(server, "specserve:prefix_cache_hits_total") == hits + 40
    assert 0 < metric(server, "specserve:prefix_cache_hit_rate") <= 1
    usage = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
    assert usage.prompt_tokens_details.cached_tokens == 40


# ---------------------------------------------------------------------- speculation
def test_per_request_speculation_control_and_stats(server):
    """A request's own k wins over the engine's adaptive choice (which follows measured step
    times, so it may draft nothing for a request like this one): k = 3 drafts every step,
    k = 0 never, and all three outputs are plain greedy decoding's."""
    prompt = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"

    def complete(**extra):
        return httpx.post(server.url + "/v1/completions",
                          json={"prompt": prompt, **GREEDY, "max_tokens": 24, **extra}).json()

    adaptive, off = complete(), complete(speculative={"num_speculative_tokens": 0})
    on = complete(speculative={"num_speculative_tokens": 3})
    texts = {r["choices"][0]["text"] for r in (adaptive, off, on)}
    assert len(texts) == 1  # lossless (fp32 greedy)
    assert off["usage"]["speculation"]["num_draft_tokens"] == 0
    spec = on["usage"]["speculation"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"], abs=1e-3)
    bad = httpx.post(server.url + "/v1/completions",
                     json={"prompt": "a", "speculative": {"num_speculative_tokens": -1}})
    assert bad.status_code == 400


# ---------------------------------------------------------------------- concurrency
def test_32_concurrent_streams_complete(server):
    async def one(api, i):
        text, n_chunks = "", 0
        stream = await api.completions.create(
            model="tiny", prompt=f"request {i}: " + "word " * (i % 7), temperature=0.8, seed=i,
            max_tokens=8 + i % 5, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                n_chunks += 1
            if chunk.usage:
                usage = chunk.usage
        return usage.completion_tokens

    async def main():
        api = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        async with api:
            return await asyncio.gather(*(one(api, i) for i in range(32)))

    counts = asyncio.run(main())
    assert counts == [8 + i % 5 for i in range(32)]
    wait_for(lambda: metric(server, "specserve:kv_cache_usage_perc") == 0)


def test_disconnected_streams_free_their_blocks(server):
    async def read_a_little(http, i):
        async with http.stream("POST", "/v1/completions",
                               json={"prompt": f"long {i}", "max_tokens": 200, "ignore_eos": True,
                                     "temperature": 0, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return True  # leave mid-stream: the connection closes

    async def main():
        async with httpx.AsyncClient(base_url=server.url) as http:
            return await asyncio.gather(*(read_a_little(http, i) for i in range(8)))

    assert all(asyncio.run(main()))
    wait_for(lambda: metric(server, "specserve:num_requests_running") == 0
             and metric(server, "specserve:kv_cache_usage_perc") == 0)
    # The engine agrees, and still serves.
    free = asyncio.run(_probe(server.engine, lambda e: (e.num_free_blocks, e.kv.num_blocks)))
    assert free[0] == free[1]
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "still here", **GREEDY}).status_code == 200


async def _probe(engine, fn):
    return await engine.call(fn)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "slow"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "slow"}]})])
def test_non_streaming_disconnect_aborts(server, path, body):
    """The request is aborted, its blocks freed, and the handler returns without a traceback
    (it once unpacked the 499 response as if it were the outputs)."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    for name in ("uvicorn.error", "uvicorn", "fastapi"):  # uvicorn's loggers do not reach the root
        logging.getLogger(name).addHandler(handler)
    try:
        _disconnect_early(server, path, body)
    finally:
        for name in ("uvicorn.error", "uvicorn", "fastapi"):
            logging.getLogger(name).removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]


def _disconnect_early(server, path, body) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path,
                   json={**body, "max_tokens": 240, "ignore_eos": True, "temperature": 0,
                         "speculative": {"num_speculative_tokens": 0}},
                   timeout=0.05)
    wait_for(lambda: metric(server, "specserve:kv_cache_usage_perc") == 0, timeout=20)
    time.sleep(0.3)  # the handler ends once the work it cancelled has


def test_a_client_gone_first_gets_499_once_the_work_has_ended():
    """The work is cancelled and awaited (its finally, which aborts, has run), never left
    half-cancelled so that reading its result raises (a 500 and a traceback)."""
    from specserve.server.app import _unless_disconnected

    class Gone:
        async def receive(self):
            return {"type": "http.disconnect"}

    cleaned = []

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    response = asyncio.run(_unless_disconnected(Gone(), work()))
    assert response.status_code == 499 and cleaned == [True]


# ---------------------------------------------------------------------- bad input
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}


def test_structured_output_through_the_openai_client(server):
    """response_format (json_schema, json_object), streamed and not, and vLLM's fields:
    the outputs follow their structure; bad or conflicting structures are 400s."""
    import jsonschema

    c = client(server)
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60, temperature=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    whole = c.chat.completions.create(**chat, response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(**chat, response_format=fmt, stream=True) if ch.choices)
    assert streamed == whole.choices[0].message.content
    obj = c.chat.completions.create(**{**chat, "max_tokens": 200}, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    choice = c.completions.create(model="tiny", prompt="a", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = c.completions.create(model="tiny", prompt="a", max_tokens=10,
                                 extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", regex.choices[0].text)
    for extra, fragment in (({"structured_outputs": {"regex": "[0-9"}}, "unclosed character class"),
                            ({"guided_regex": "a", "guided_choice": ["b"]}, "give one"),
                            ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
                            ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "exactly one")):
        with pytest.raises(openai.BadRequestError, match=fragment):
            c.completions.create(model="tiny", prompt="a", max_tokens=10, extra_body=extra)


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n must be between 1 and 64"),
    ("/v1/completions", {"prompt": "a", "n": 65}, 400, "n must be between 1 and 64"),
    ("/v1/completions", {"prompt": "a", "n": 3, "best_of": 2}, 400, "best_of must be at least n"),
    ("/v1/completions", {"prompt": "a", "best_of": 3, "stream": True}, 400, "cannot be streamed"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "echo"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 20}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "bad_words": [" "]}, 400, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "requires logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}, 400,
     "/v1/completions"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {"prompt": []}, 400, "empty"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "token ids"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a\ud800b"}, 400, "not valid text"),  # a lone surrogate (#35)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "not valid text"),
    ("/v1/completions", {"prompt": "a", "temperature": float("inf")}, 400, "temperature"),
    # strict JSON types, as OpenAI's (the fuzz suite found "0" taken as token id 0)
    ("/v1/completions", {"prompt": "a", "max_tokens": "16"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 1.0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs"),
    ("/detokenize", {"tokens": ["0"]}, 400, "tokens"),
    ("/v1/completions", {"prompt": "word " * 300}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1000}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools"),
])
def test_bad_requests_get_openai_error_bodies(server, path, body, status, fragment):
    # Encoded as JSON allows and Python's json writes it (\ud800 escapes, Infinity), which
    # httpx's own encoder refuses to send.
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_invalid_json_and_unknown_route(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a", not json',
                   headers={"content-type": "application/json"})
    error = r.json()["error"]  # where it broke, not a field named "16" (#35)
    assert r.status_code == 400 and "not valid JSON" in error["message"] and "character 16" in error["message"]
    assert error["param"] is None
    # Without a JSON content type (curl -d sends a form's): say so, not "a valid dictionary".
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_openai_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(server).completions.create(model="tiny", prompt="a", temperature=-3)


def test_bad_input_leaves_nothing_queued(server):
    before = metric(server, "specserve:kv_cache_usage_perc")
    for _ in range(3):
        httpx.post(server.url + "/v1/completions", json={"prompt": ["ok", ""], "max_tokens": 3})
    assert metric(server, "specserve:num_requests_waiting") == 0
    assert metric(server, "specserve:kv_cache_usage_perc") == before == 0


# ---------------------------------------------------------------------- service endpoints
def test_models_health_and_metrics(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for expected in ("specserve:time_to_first_token_seconds", "specserve:inter_token_latency_seconds",
                     "specserve:e2e_request_latency_seconds", "specserve:num_requests_running",
                     "specserve:num_requests_waiting", "specserve:kv_cache_usage_perc",
                     "specserve:num_preemptions", "specserve:num_rope_restarts", "specserve:prompt_tokens",
                     "specserve:generation_tokens", "specserve:spec_decode_num_drafts",
                     "specserve:spec_decode_num_draft_tokens",
                     "specserve:spec_decode_num_accepted_tokens",
                     "specserve:spec_decode_num_accepted_tokens_per_pos",
                     "specserve:spec_decode_num_path_wins", "specserve:spec_decode_draft_length"):
        assert expected in names, expected


def test_metrics_count_tokens_and_speculation(server):
    before = metric(server, "specserve:generation_tokens_total")
    drafts = metric(server, "specserve:spec_decode_num_drafts_total")
    prompt = "a b c a b c a b c a b c"
    out = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, **GREEDY}).json()
    assert metric(server, "specserve:generation_tokens_total") - before == 12
    assert metric(server, "specserve:spec_decode_num_drafts_total") - drafts == \
        out["usage"]["speculation"]["num_drafts"]


# ---------------------------------------------------------------------- access and limits
def test_api_key(chat_model_dir):
    srv, _ = make_server(chat_model_dir, api_key=KEY)
    with srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": "Bearer café".encode()}):  # non-ASCII: 401, not 500
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(srv, api_key="wrong").models.list()
        assert client(srv, api_key=KEY).completions.create(model="tiny", prompt="a", max_tokens=2)
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(srv.url + "/metrics").status_code == 200  # nor scrapers
        for path in ("/docs", "/openapi.json", "/version"):  # every other route does
            assert httpx.get(srv.url + path).status_code == 401, path
            assert httpx.get(srv.url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.post(srv.url + "/tokenize", json={"prompt": "a"}).status_code == 401


def test_body_limit(chat_model_dir):
    srv, _ = make_server(chat_model_dir, max_body_bytes=1000)
    with srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit still holds while reading
            for _ in range(20):
                yield b"x" * 100

        r = httpx.post(srv.url + "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_more_choices_than_the_queue_holds_is_a_400(chat_model_dir):
    """Choices beyond the queue limit and every sequence slot could never be queued; a burst
    onto free slots is no queue (#35: from idle, it was cut at the limit)."""
    srv, _ = make_server(chat_model_dir, max_queued_requests=2, max_num_seqs=4)
    with srv:
        response = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "n": 7, "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "n": 6, "max_tokens": 2}).status_code == 200

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                return await asyncio.gather(*[http.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
                                              for i in range(6)])

        assert [r.status_code for r in asyncio.run(burst())] == [200] * 6  # 4 slots + 2 queued


def test_queue_full_gets_429(chat_model_dir):
    srv, engine = make_server(chat_model_dir, max_queued_requests=1, max_num_seqs=1)
    step = engine.engine.step
    engine.engine.step = lambda: (time.sleep(0.01), step())[1]  # the running request lasts ~2 s
    long = {"prompt": "hold", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}

    async def main():
        async with httpx.AsyncClient(base_url=srv.url) as http:
            async with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.aiter_lines()  # kept: dropping it would close the stream
                await anext(lines)  # the first request is running
                async with http.stream("POST", "/v1/completions", json=long) as waiting:
                    assert waiting.status_code == 200
                    full = await http.post("/v1/completions", json={"prompt": "more", "max_tokens": 2})
                    return full.status_code, full.json(), full.headers.get("retry-after")

    with srv:
        status, body, retry_after = asyncio.run(main())
        assert status == 429 and body["error"]["code"] == "queue_full" and retry_after == "1"
        assert body["error"]["type"] == "rate_limit_error"
        wait_for(lambda: metric(srv, "specserve:kv_cache_usage_perc") == 0)
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "again", "max_tokens": 2}).status_code == 200


def test_dead_engine_answers_503(chat_model_dir):
    srv, engine = make_server(chat_model_dir)

    def broken_schedule(*_args, **_kwargs):
        raise RuntimeError("scheduler bug")

    with srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        engine.engine.scheduler.schedule = broken_schedule
        with httpx.stream("POST", srv.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 5, "stream": True}) as r:
            events = sse_events(r)
        assert "error" in events[0] and events[-1] == "[DONE]"
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "scheduler bug" in r.json()["error"]["message"]


# ---------------------------------------------------------------------- the real command
def _start_cli_server(model_dir, *extra) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--model", str(model_dir), "--port", "0",
         "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512", *extra],
        stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    for line in proc.stderr:
        if "serving " in line and "http://" in line:
            url = line.split("http://")[1].split("/v1")[0]
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            break
        assert time.monotonic() < deadline
    else:
        raise AssertionError(f"server exited with {proc.wait()}")
    url = "http://" + url
    wait_for(lambda: _healthy(url), timeout=30)
    return proc, url


def _healthy(url) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health").status_code == 200
    return False


def test_sigterm_finishes_in_flight_requests_then_exits(chat_model_dir):
    proc, url = _start_cli_server(chat_model_dir, "--shutdown-timeout", "60")
    try:
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": "a", "max_tokens": 60, "ignore_eos": True,
                                "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(url + "/health")
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        # A clean shutdown, asked for: exit status 0.
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_sigterm_aborts_what_outlives_the_timeout(chat_model_dir):
    proc, url = _start_cli_server(chat_model_dir, "--shutdown-timeout", "0.5", "--max-num-seqs", "1")
    body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}

    async def one(http, i, started):
        async with http.stream("POST", "/v1/completions", json={"prompt": f"p{i}", **body}) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            return events

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            started = asyncio.Event()
            streams = [asyncio.create_task(one(http, i, started)) for i in range(4)]
            await started.wait()
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*streams)

    try:
        start = time.monotonic()
        results = asyncio.run(main())
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 20
    finally:
        proc.kill()
    reasons = [json.loads(events[-2])["choices"][0]["finish_reason"] for events in results]
    assert all(events[-1] == "[DONE]" for events in results)  # every stream ended cleanly
    assert "abort" in reasons  # 4 x 400 tokens one at a time outlive half a second


def test_serving_beyond_loopback_without_a_key_is_flagged():
    from specserve.server import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("10.1.2.3")


def test_busy_port_is_a_usage_error(chat_model_dir):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--model",
                               str(chat_model_dir), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("specserve: error: cannot listen on")


# ---------------------------------------------------------------------- every field of OpenAI's requests
def openai_request_fields(module) -> set[str]:
    """The fields of an OpenAI request type, streaming or not, from the ``openai`` package:
    the list the server's allowlist is checked against, so it cannot drift."""
    import typing

    return set(typing.get_type_hints(module.CompletionCreateParamsNonStreaming)) | set(
        typing.get_type_hints(module.CompletionCreateParamsStreaming))


def _logprob_tokens(resp: dict) -> int:
    logprobs = resp["choices"][0]["logprobs"]
    return len(logprobs["content"] if "content" in logprobs else logprobs["tokens"])


def _text(resp: dict) -> str:
    choice = resp["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# field -> (a value that asks for something, what must come of it): "refused" (a 400 naming
# the field), "advisory" (200, the same output as without it: ADVISORY in protocol.py),
# or a check of its effect, given the response and the baseline's (greedy, 6 tokens).
HONOURED = {
    "model": ("tiny", lambda r, base, _post: r["model"] == "tiny"),
    "max_tokens": (3, lambda r, base, _post: r["usage"]["completion_tokens"] == 3),
    "max_completion_tokens": (3, lambda r, base, _post: r["usage"]["completion_tokens"] == 3),
    "temperature": (2.0, lambda r, base, _post: _text(r) != _text(base)),
    "top_p": (1e-9, lambda r, base, _post: _text(r) == _text(base)),  # with temperature 2: greedy again
    "seed": (11, lambda r, base, post: _text(r) == _text(post()) and _text(r) != _text(post(seed=12))),
    "stop": (None, lambda r, base, _post: r["choices"][0]["finish_reason"] == "stop"
             and _text(base).startswith(_text(r)) and len(_text(r)) < len(_text(base))),
    "n": (3, lambda r, base, _post: [c["index"] for c in r["choices"]] == [0, 1, 2]
          and all(_text({"choices": [c]}) == _text(base) for c in r["choices"])),  # greedy: equal
    "best_of": (1, lambda r, base, _post: _text(r) == _text(base)),  # more: test_logprobs_echo_and_best_of
    "echo": (True, lambda r, base, _post: _text(r) == "def add(a, b):" + _text(base)),
    "logprobs": (1, lambda r, base, _post: _logprob_tokens(r) == 6),
    "top_logprobs": (2, lambda r, base, _post: all(len(t["top_logprobs"]) == 2
                                                   for t in r["choices"][0]["logprobs"]["content"])),
    "presence_penalty": (2.0, lambda r, base, _post: _text(r) != _text(base)),
    "frequency_penalty": (2.0, lambda r, base, _post: _text(r) != _text(base)),
    # The same token six times: a greedy pick biased by +100.
    "logit_bias": ({"300": 100}, lambda r, base, _post: _text(r) == _text(r)[:len(_text(r)) // 6] * 6),
    "response_format": ({"type": "json_object"}, lambda r, base, _post: _text(r).startswith("{")),
    # tools: in the prompt; tool_choice and parallel_tool_calls (with tools): the calls made.
    # More in test_tools.py.
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}],
              lambda r, base, _post: r["usage"]["prompt_tokens"] > base["usage"]["prompt_tokens"]),
    "tool_choice": ("required", lambda r, base, _post: r["choices"][0]["message"]["tool_calls"][0]
                    ["function"]["name"] == "f"),
    "parallel_tool_calls": (False, lambda r, base, _post: len(r["choices"][0]["message"]["tool_calls"]) == 1),
    "stream": (True, None),  # the stream tests above
    "stream_options": ({"include_usage": True}, None),  # the stream tests above
    "prompt": (None, None), "messages": (None, None),  # every request
}
REFUSED_VALUES = {
    "suffix": "x",
    "functions": [{"name": "f"}], "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "verbosity": "low", "web_search_options": {}, "store": True,
    "metadata": {"a": "b"}, "moderation": {}, "service_tier": "flex",
    "prompt_cache_retention": "24h", "prompt_cache_options": {},
}
ADVISORY_VALUES = {"user": "someone", "safety_identifier": "hash-1", "prompt_cache_key": "k"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_openai_request_field_is_honoured_or_refused(server, path):
    """Each field of the ``openai`` package's request type for this endpoint: honoured (its
    effect seen), refused with a 400 that names it, or advisory (accepted, output unchanged).
    A field OpenAI adds later fails here until it is classified."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    chat = "chat" in path
    fields = openai_request_fields(chat_create_params if chat else completion_create_params)
    unclassified = fields - set(HONOURED) - set(REFUSED_VALUES) - set(ADVISORY_VALUES)
    assert not unclassified, f"OpenAI request fields neither honoured nor refused: {sorted(unclassified)}"
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "def add(a, b):"}]} if chat else {"prompt": "def add(a, b):"})}

    def post(**extra):
        response = httpx.post(server.url + path, json={**body, **extra})
        return response.json() if response.status_code == 200 else response

    base = post()
    for field in sorted(fields):
        if field in REFUSED_VALUES:
            response = httpx.post(server.url + path, json={**body, field: REFUSED_VALUES[field]})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == field, (field, response.text)
            assert error["type"] == "invalid_request_error" and error["message"]
        elif field in ADVISORY_VALUES:
            assert _text(post(**{field: ADVISORY_VALUES[field]})) == _text(base), field
        else:
            value, check = HONOURED[field]
            if check is None:
                continue
            if field == "stop":
                value = _text(base)[len(_text(base)) // 2:][:3]
            if field == "logprobs" and chat:
                value = True  # a boolean in chat, a count in completions
            extra = {"temperature": 2.0} if field in ("top_p", "seed") else {}
            if field == "top_logprobs":
                extra = {"logprobs": True}
            if field == "response_format":
                extra = {"ignore_eos": False}  # a grammar ends with the end-of-sequence token
            if field in ("tool_choice", "parallel_tool_calls"):
                extra = {"ignore_eos": False, "max_tokens": 40, "tools": HONOURED["tools"][0],
                         **({"tool_choice": "required"} if field == "parallel_tool_calls" else {})}
            if field == "seed":
                check_post = lambda **more: post(temperature=2.0, seed=more.get("seed", value))  # noqa: E731
            else:
                check_post = post
            response = post(**extra, **{field: value})
            assert isinstance(response, dict), (field, response.text)
            assert check(response, base, check_post), field


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/v1/completions", {"prompt": "a", "foo": 1}, "foo", "unknown field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     None, "needs a schema"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_object"}}, "response_format", "unknown field"),
    ("/v1/completions", {"prompt": "a", "priority": 1}, "priority", "arrival order"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x", "unknown field"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages.0.tool_calls.0.type", "Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0", "only an assistant"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": "red"}]},
     "messages.0.colour", "unknown field"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "refusal": "no"}]},
     "messages.0", "refusal"),
])
def test_fields_nobody_honours_are_refused_by_name(server, path, body, param, fragment):
    response = httpx.post(server.url + path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and fragment in error["message"], response.text


def test_a_resent_assistant_message_with_null_fields_is_taken(server):
    """The openai client sends a response's message back with its null fields."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None,
                 "function_call": None, "audio": None, "annotations": []},
                {"role": "user", "content": "and then?", "name": "ann"}]
    out = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                                 parallel_tool_calls=None, n=1, presence_penalty=0)
    assert out.usage.completion_tokens == 3
    # Null for a field means its default, as some clients send it.
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None,
             "presence_penalty": None, "frequency_penalty": None, "seed": None, "stop": None}
    greedy = {"max_tokens": 3, "ignore_eos": True, "messages": messages}
    nulls.update(top_k=None, min_p=None, skip_special_tokens=None, stop_token_ids=None)
    with_nulls = httpx.post(server.url + "/v1/chat/completions", json={**greedy, **nulls})
    assert with_nulls.status_code == 200 and with_nulls.json()["usage"]["completion_tokens"] == 3
    default = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": None, "ignore_eos": True})
    assert default.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for a completion
    streamed = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True,
                                                                "stream_options": {"include_usage": None}})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")


def test_every_declared_field_is_classified():
    """A field added to the request models must be honoured (here by name), refused when it
    asks for something (REFUSED) or advisory (ADVISORY): never just declared."""
    from specserve.server.protocol import ADVISORY, REFUSED, ChatCompletionRequest, CompletionRequest

    honoured = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stream", "n", "best_of",
                "stream_options", "stop", "seed", "prompt", "messages", "top_k", "min_p", "ignore_eos",
                "stop_token_ids", "skip_special_tokens", "speculative", "echo", "logprobs", "top_logprobs",
                "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "min_tokens",
                "bad_words", "prompt_logprobs", "response_format", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar",  # test_structured_output_through_...
                "tools", "tool_choice", "parallel_tool_calls"}  # test_tools.py
    for model in (CompletionRequest, ChatCompletionRequest):
        loose = set(model.model_fields) - honoured - set(REFUSED) - ADVISORY
        assert not loose, f"{model.__name__} declares fields nobody honours or refuses: {sorted(loose)}"


def test_tokenize_detokenize_and_version(server):
    """vLLM's shapes: /tokenize for a text or a chat, /detokenize, /version."""
    from specserve import __version__

    tok = httpx.post(server.url + "/tokenize", json={"prompt": "def add(a, b):"}).json()
    engine = server.engine.engine
    assert tok["tokens"] == engine.tokenizer.encode("def add(a, b):") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == engine.max_model_len and tok["token_strs"] is None
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "def add(a, b):", "add_special_tokens": False,
                                                       "return_token_strs": True}).json()
    assert plain["tokens"] == engine.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    assert plain["token_strs"] == engine.tokenizer.convert_ids_to_tokens(plain["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == engine.apply_chat_template(messages)
    no_turn = httpx.post(server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_turn["count"] < chat["count"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": "def add(a, b):"}
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate"),
                              ("/detokenize", {"tokens": [10**9]}, None),
                              ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model")):
        response = httpx.post(server.url + path, json=body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text


def test_every_series_is_also_served_under_vllm_names(server):
    """Dashboards made for vLLM read the same values under ``vllm:``."""
    httpx.post(server.url + "/v1/completions", json={"prompt": "a b", **GREEDY})
    text = httpx.get(server.url + "/metrics").text
    ours = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("specserve:")}
    theirs = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name.startswith("vllm:")}
    assert ours and {"vllm:" + n.removeprefix("specserve:") for n in ours} == set(theirs)
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_running",
                 "time_to_first_token_seconds_count", "spec_decode_num_drafts_total", "prefix_cache_hits_total"):
        assert "vllm:" + name in theirs, name


def test_n_choices_compute_their_prompt_once(server):
    """n = 4 with the official client, streaming and not: four choices, each with its own
    random stream (seed + index) and its own stop, the prompt computed once (the other three
    take its blocks from the prefix cache), the prompt counted once in the usage."""
    api = client(server)
    prompt = list(range(100, 141))  # 41 tokens: 10 whole blocks of 4 before the last token
    hits = metric(server, "specserve:prefix_cache_hits_total")
    engine, added = server.engine.engine, []
    real = engine.add_request
    engine.add_request = lambda *args: added.append(args[3:]) or real(*args)
    try:
        out = api.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=5, temperature=1.0, seed=3,
                                     extra_body={"ignore_eos": True})
    finally:
        del engine.add_request
    first = f"{out.id}-0"
    assert added == [(None,), (first,), (first,), (first,)]  # the later choices wait for the first's prompt
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and len({c.text for c in out.choices}) > 1
    assert out.usage.prompt_tokens == 41 and out.usage.completion_tokens == 20
    wait_for(lambda: metric(server, "specserve:prefix_cache_hits_total") >= hits + 3 * 40)
    assert metric(server, "specserve:prefix_cache_hits_total") == hits + 3 * 40
    again = api.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=5, temperature=1.0, seed=3,
                                   extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    messages = [{"role": "user", "content": "Say something about prefixes."}]
    one = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    texts, roles, usage = {}, {}, None
    for chunk in api.chat.completions.create(model="tiny", messages=messages, n=4, max_tokens=6, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}):
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles[choice.index] = roles.get(choice.index) or choice.delta.role
    assert sorted(texts) == [0, 1, 2, 3] and set(roles.values()) == {"assistant"}
    assert set(texts.values()) == {one.choices[0].message.content}  # greedy: every choice the same
    assert usage.completion_tokens == 24 and usage.prompt_tokens == one.usage.prompt_tokens
    whole = api.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6, temperature=0,
                                        stop=[one.choices[0].message.content[2:4]], extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]


def test_logprobs_with_the_openai_client_streaming_and_not(server):
    """Chat logprobs (top 3) through the official client: the stream's chunks carry the
    same tokens and values as the whole answer, and the tokens spell the text; completions'
    legacy object likewise. Under n-gram speculation (the server's)."""
    api = client(server)
    messages = [{"role": "user", "content": "count: 1 2 3 1 2 3 1 2"}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 10 and "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob
               for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)
    streamed = []
    for chunk in api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                             logprobs=True, top_logprobs=3, stream=True,
                                             extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    # The same values (a cached prompt is computed in another order: float32 rounding apart).
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    plain = api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content
    legacy = api.completions.create(model="tiny", prompt="1 2 3 1 2 3", max_tokens=8, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.token_logprobs) == 8
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_echo_scoring_and_best_of(server):
    """echo with logprobs and max_tokens 0 scores a prompt (the first token null, each
    later one's log-probability, nothing generated or counted); best_of 4 returns the n
    whose tokens are likeliest per token, and counts all it generated."""
    api = client(server)
    prompt = "def add(a, b):"
    scored = api.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length"
    echoed = api.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert echoed.choices[0].logprobs.token_logprobs[:len(lp.tokens)] == lp.token_logprobs
    assert len(echoed.choices[0].logprobs.tokens) == len(lp.tokens) + 4
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 7, "ignore_eos": True, "logprobs": 0}
    every = httpx.post(server.url + "/v1/completions", json={**body, "n": 4}).json()
    best = httpx.post(server.url + "/v1/completions", json={**body, "n": 2, "best_of": 4}).json()
    means = sorted((sum(c["logprobs"]["token_logprobs"]) / 5, c["text"]) for c in every["choices"])
    assert {c["text"] for c in best["choices"]} == {text for _, text in means[2:]}
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["usage"]["completion_tokens"] == 20
    # vLLM's prompt_logprobs: per prompt token (null first) its own entry (with its rank) and the top N.
    given = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2,
                                                             "stream": False}).json()
    entries = given["choices"][0]["prompt_logprobs"]
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for token_id, entry, value in zip(prompt_ids[1:], entries[1:], lp.token_logprobs[1:]):
        own = entry[str(token_id)]
        assert abs(own["logprob"] - value) < 1e-4 and own["rank"] >= 1 and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for t, e in entry.items() if t != str(token_id))[:2] == [1, 2] or own["rank"] <= 2
    for extra in ({}, {"echo": True, "logprobs": 1}):  # with nothing else to stream first, and with
        streamed = [e for e in sse_events(httpx.post(server.url + "/v1/completions",
                                                     json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2,
                                                           "stream": True, **extra})) if e != "[DONE]"]
        sent = [e["choices"][0]["prompt_logprobs"] for e in streamed if e["choices"][0].get("prompt_logprobs")]
        assert len(sent) == 1 and len(sent[0]) == len(prompt_ids)
    quiet = httpx.post(server.url + "/v1/completions", json={**body, "n": 1, "best_of": 4, "logprobs": None}).json()
    assert quiet["choices"][0]["logprobs"] is None and quiet["choices"][0]["text"] == means[-1][1]


def test_penalties_bias_and_min_tokens_through_the_server(server):
    """vLLM's extensions, each seen to act: repetition_penalty changes a repetitive greedy
    answer, min_tokens holds off the stop token, bad_words keeps a word out."""
    body = {"prompt": "1 2 3 1 2 3 1 2 3", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    base = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    penalised = httpx.post(server.url + "/v1/completions", json={**body, "repetition_penalty": 3.0}).json()
    assert penalised["choices"][0]["text"] != base
    # An output token whose text tokenises back to it, as a stop token.
    tokens = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 0}).json()
    tokens = tokens["choices"][0]["logprobs"]["tokens"]
    tokenizer = server.engine.engine.tokenizer
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in tokens]
    stop = next(i[0] for i, t in zip(ids, tokens) if len(i) == 1 and tokenizer.decode(i) == t)
    at = tokens.index(tokenizer.decode([stop])) + 1
    stopped = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [stop]}).json()
    assert stopped["usage"]["completion_tokens"] == at
    held = httpx.post(server.url + "/v1/completions", json={**body, "stop_token_ids": [stop], "min_tokens": at + 2}).json()
    assert held["usage"]["completion_tokens"] >= at + 2
    word = tokenizer.decode([stop])
    banned = httpx.post(server.url + "/v1/completions", json={**body, "bad_words": [word], "logprobs": 0}).json()
    assert banned["choices"][0]["text"] != base and word not in banned["choices"][0]["logprobs"]["tokens"]


def test_tokenising_a_large_prompt_blocks_no_other_request(server, monkeypatch):
    """#35: prompts are tokenised off the event loop, so /health and other streams are
    served meanwhile; one too long by its bytes alone is refused before tokenising."""
    import specserve.server.app as app_module

    real = app_module.tokenize_prompt
    monkeypatch.setattr(app_module, "tokenize_prompt",
                        lambda *args: (time.sleep(2.0), real(*args))[1])  # a slow tokenizer

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            slow = asyncio.create_task(http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2}))
            await asyncio.sleep(0.3)  # the slow request is tokenising now
            start = time.monotonic()
            health = await http.get("/health")
            waited = time.monotonic() - start
            return (await slow).status_code, health.status_code, waited

    slow_status, health_status, waited = asyncio.run(main())
    assert slow_status == 200 and health_status == 200 and waited < 1.0
    monkeypatch.setattr(app_module, "tokenize_prompt", lambda *args: pytest.fail("tokenised"))
    huge = "word " * 400_000  # 2 MB: more tokens than max_model_len (512) by its bytes alone
    r = httpx.post(server.url + "/v1/completions", json={"prompt": huge, "max_tokens": 2})
    assert r.status_code == 400 and "bytes make at least" in r.json()["error"]["message"]
