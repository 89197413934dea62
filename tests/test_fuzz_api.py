"""Schema-driven fuzzing of the HTTP API (schemathesis, from the server's own OpenAPI
document): valid and invalid bodies for every route, sent to a real uvicorn over the tiny
model with speculation on. Failures: any 5xx; any status or content type the document does
not list; a 4xx whose body is not an OpenAI-style error; a 200 that OpenAI's own response
types (the ``openai`` package's) reject, streamed chunks included; a request that takes
longer than ``FUZZ_TIMEOUT_S`` (a hang); and, after the run, an engine that is not alive or
KV blocks still held.

``SPECSERVE_FUZZ_EXAMPLES`` sets the cases per route and mode, valid or invalid (CI: the default;
``benchmarks/fuzz_api.py`` runs many more)."""
from __future__ import annotations

import json
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from test_server import make_server, wait_for

EXAMPLES = int(os.environ.get("SPECSERVE_FUZZ_EXAMPLES", "100"))
FUZZ_TIMEOUT_S = 60.0
CASES: dict[str, int] = {}  # route -> cases sent (reported at the end of the run)


@pytest.fixture(scope="module")
def fuzz_server(chat_model_dir):
    srv, engine = make_server(chat_model_dir, speculative_method="ngram", num_speculative_tokens=3,
                              max_model_len=128, num_kv_blocks=256)
    with srv:
        srv.engine = engine
        yield srv
        # after every case: the engine lives and holds no request's KV blocks
        assert engine.is_alive, engine.error
        kv = engine.engine.kv
        wait_for(lambda: not engine.engine.has_unfinished_requests(), timeout=30)
        assert kv.num_free_blocks == kv.num_blocks
        print(f"\nfuzzed {sum(CASES.values())} cases: "
              + ", ".join(f"{route} {n}" for route, n in sorted(CASES.items())))


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


ROUTES = ["GET /health", "GET /metrics", "GET /version", "POST /tokenize", "POST /detokenize", "GET /v1/models",
          "POST /v1/completions", "POST /v1/chat/completions"]


def test_the_document_lists_every_route(api_schema):
    assert sorted(r.ok().label for r in api_schema.get_all_operations()) == sorted(ROUTES)


def _error_body(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert isinstance(body["error"]["type"], str), body


def _openai_shape(path: str, response) -> None:
    """A 200 from the API routes must parse as OpenAI's types say (extra fields allowed)."""
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return
    whole, chunk = ((ChatCompletion, ChatCompletionChunk) if "chat" in path else (Completion, Completion))
    if response.headers["content-type"][0].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            data = json.loads(event)
            if "error" in data:
                raise AssertionError(f"the stream carried an error: {data}")
            chunk.model_validate(data, strict=False)
    else:
        whole.model_validate(response.json(), strict=False)


def check_case(case) -> None:
    path = case.operation.path
    CASES[path] = CASES.get(path, 0) + 1
    try:
        response = case.call(timeout=FUZZ_TIMEOUT_S)
    except httpx.TimeoutException as exc:  # pragma: no cover - a hang is the failure
        raise AssertionError(f"{case.method} {path}: no answer within {FUZZ_TIMEOUT_S} s") from exc
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                             content_type_conformance, response_schema_conformance,
                                             negative_data_rejection])
    if response.status_code >= 400:
        _error_body(response)
    elif response.status_code == 200:
        _openai_shape(path, response)


# schemathesis's strategies driven by hypothesis directly (not its pytest plugin, which
# follows pytest's internals): valid bodies and invalid ones for each route.
# (a GET route here takes no parameters: nothing about it can be invalid)
@pytest.mark.parametrize("route, mode", [(route, mode) for route in ROUTES for mode in GenerationMode
                                         if route.startswith("POST") or mode is GenerationMode.POSITIVE],
                         ids=lambda v: v.value if isinstance(v, GenerationMode) else v)
def test_the_api_answers_every_request_within_its_document(api_schema, route, mode):
    operation = next(r.ok() for r in api_schema.get_all_operations() if r.ok().label == route)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        check_case(case)

    fuzz()
