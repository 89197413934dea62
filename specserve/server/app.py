"""The OpenAI-compatible HTTP API (FastAPI) over an AsyncLLMEngine.

Every refusal — bad JSON or values, an unknown model, a prompt too long, a full queue, a
missing API key, a body too large — is answered before anything is queued, with an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from specserve.logprobs import TokenLogprob
from specserve.metrics import SpecDecodeStats
from specserve.outputs import RequestOutput
from specserve.prompts import chat_prompt_ids, check_text, tokenize_prompt
from specserve.sampling_params import SamplingParams
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest)
from specserve.tools import HERMES_CLOSE, ChatReply, ChatTools

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class APIError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def create_app(engine: AsyncLLMEngine, served_model_name: str | None = None,
               api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tool_call_parser: str | None = None) -> FastAPI:
    """The ASGI app. The engine thread starts with the app and is stopped (in-flight
    requests aborted) when the app shuts down. ``tool_call_parser``: how the model writes
    tool calls (``tools.FORMATS``; None: found from its chat template)."""
    llm = engine.engine
    model_name = served_model_name or llm.model_name
    metrics = ServerMetrics(engine, model_name)
    # The engine thread detokenises with the engine's tokenizer; this copy is the event
    # loop's own, so the two threads never share one tokenizer object.
    prompts = _PromptEncoder(copy.deepcopy(llm.tokenizer), llm.hf_config.vocab_size, llm.max_model_len,
                             tool_call_parser)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        if not engine.is_alive:
            engine.start()
        try:
            yield
        finally:
            prompts.close()
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="specserve", lifespan=lifespan)
    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(req, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":  # its loc is the character where parsing stopped
            where = f" at character {loc[0]}" if loc else ""
            return APIError(400, f"the body is not valid JSON ({err.get('ctx', {}).get('error', 'invalid')}"
                                 f"{where})").response()
        if "json" not in req.headers.get("content-type", ""):
            return APIError(400, "send the body as JSON, with 'Content-Type: application/json'").response()
        if err.get("type") == "extra_forbidden":  # an allowlist: a field nobody declared
            message = f"{'.'.join(loc)}: unknown field; this server takes the fields in docs/server.md"
        else:
            message = f"{'.'.join(loc) + ': ' if loc else ''}{err.get('msg', 'invalid request')}"
        return APIError(400, message, param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_).response()

    @app.exception_handler(Exception)
    async def _unexpected(_req, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    # ------------------------------------------------------------------ service endpoints
    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return APIError(503, f"the engine is not running{': ' + engine.error if engine.error else ''}",
                            "service_unavailable").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_request(body)
        with _bad_input():
            if body.messages is not None:
                ids = await prompts.run(prompts.chat_ids, [m.as_dict() for m in body.messages],
                                        body.add_generation_prompt, body.tool_list())
            else:
                ids = await prompts.run(prompts.text_ids, body.prompt, body.add_special_tokens)
        strs = prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_request(body)
        with _bad_input():
            tokenize_prompt(prompts.tokenizer, body.tokens, llm.hf_config.vocab_size)  # ids in range
        return {"prompt": prompts.tokenizer.decode(body.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "specserve",
            "max_model_len": llm.max_model_len}]}

    # ------------------------------------------------------------------ generation
    def check_request(body) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")
        refused = body.refused()
        if refused:
            raise APIError(400, refused[1], param=refused[0])

    async def compile_grammar(params: SamplingParams) -> None:
        """A structured-output request's grammar, compiled (or found cached) on the
        tokenising thread, so the engine thread's ``add_request`` never compiles one."""
        if params.structured_outputs is not None:
            await prompts.run(llm.grammars.compile, params.structured_outputs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body)
        with _bad_input():
            params = [body.sampling_params(None, choice) for choice in range(body.num_generated)]
            prompt_list = body.prompts()
            prompt_ids = await prompts.run(lambda: [prompts.encode(p, params[0].max_tokens) for p in prompt_list])
            await compile_grammar(params[0])
        run = _Run(engine, metrics, prompt_ids, params, "cmpl")
        await run.start()
        texts = prompts.decode_prompt(prompt_list, prompt_ids) if body.echo else []
        view = _CompletionView(body, prompts.token_text, texts, run.n)
        if body.stream:
            return _sse(_stream_completion(run, model_name, body.include_usage, view), run)
        outs = await _unless_disconnected(request, run.collect())
        if isinstance(outs, Response):  # the client left: nobody reads this
            return outs
        chosen = _best(outs, run.n, body.num_choices)
        return {"id": run.id, "object": "text_completion", "created": run.created, "model": model_name,
                "choices": [view.choice(i, o, index // run.n)
                            for i, (index, o) in enumerate(chosen)],
                "usage": _usage(outs, run.n, view.scores_only)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body)
        with _bad_input():
            params = [body.sampling_params(None, choice) for choice in range(body.num_choices)]
            reply = _chat_reply(body, prompts.chat_tools)
            if body.tool_mode == "auto" and body.parallel_tool_calls is False:
                params = [dataclasses.replace(p, stop=[*p.stop, HERMES_CLOSE]) for p in params]  # one call
            conversation = body.conversation()
            prompt_ids = [await prompts.run(prompts.encode_chat, conversation, params[0].max_tokens,
                                            body.tool_list())]
            await compile_grammar(params[0])
        run = _Run(engine, metrics, prompt_ids, params, "chatcmpl")
        await run.start()
        logprobs = (lambda lps: _chat_logprobs(lps, params[0].logprobs, prompts.token_text)) \
            if body.logprobs else (lambda lps: None)
        if body.stream:
            return _sse(_stream_chat(run, model_name, body.include_usage, logprobs, reply), run)
        outs = await _unless_disconnected(request, run.collect())
        if isinstance(outs, Response):  # the client left: nobody reads this
            return outs
        messages = [reply().message(o.text, o.finish_reason) for o in outs]
        return {"id": run.id, "object": "chat.completion", "created": run.created, "model": model_name,
                "choices": [{"index": i, "message": message, "logprobs": logprobs(o.logprobs),
                             "finish_reason": finish}
                            for i, (o, (message, finish)) in enumerate(zip(outs, messages))],
                "usage": _usage(outs, run.n)}

    _document_errors(app, api_key is not None)
    return app


ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# What each kind of route may answer besides 200, in the OpenAPI document.
ERRORS_BODY = {400: "invalid request: bad JSON, a bad or unknown field, a prompt too long",
               404: "the model named is not served", 413: "the body is larger than the server takes",
               429: "the queue is full (Retry-After says when to retry)",
               503: "the engine is not running"}
ERRORS_ANY = {401: "missing or invalid API key (when the server has one)"}
# 200 answers that are not (only) JSON.
ANSWERS = {"/health": {"description": "the engine is running (no body)"},
           "/metrics": {"description": "Prometheus metrics",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
           **{path: {"description": "the completion (JSON), or with stream true its chunks (server-sent events)",
                     "content": {"application/json": {"schema": {"type": "object"}},
                                 "text/event-stream": {"schema": {"type": "string"}}}}
              for path in ("/v1/completions", "/v1/chat/completions")}}


def _document_errors(app: FastAPI, with_key: bool) -> None:
    """The OpenAPI document says what the routes really answer: an OpenAI-style error body
    with the status codes above, never FastAPI's 422 (validation errors are 400 here)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=__version__, routes=app.routes)
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    if path in ANSWERS:
                        responses["200"] = ANSWERS[path]
                    errors = {**(ERRORS_BODY if "requestBody" in operation else {}),
                              **(ERRORS_ANY if with_key and path not in OPEN_PATHS else {})}
                    if path == "/health":
                        errors[503] = ERRORS_BODY[503]
                    for status, why in errors.items():
                        responses[str(status)] = {"description": why, "content": {
                            "application/json": {"schema": ERROR_SCHEMA}}}
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _unless_disconnected(request: Request, work):
    """Await ``work``; if the client disconnects first, cancel it (which aborts its
    requests) — a streaming response gets this from Starlette, a plain one needs it here."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if not work.done():  # cancelled just now: let it finish (its finally aborts the requests)
        await asyncio.wait({work})
    if work.cancelled():
        return Response(status_code=499)  # nobody is listening
    return work.result()


class _bad_input:
    """``with _bad_input(): ...`` turns a ValueError into a 400."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, _tb):
        if exc_type is not None and issubclass(exc_type, ValueError):
            raise APIError(400, str(exc)) from None
        return False


class _PromptEncoder:
    """Tokenises off the event loop, in one worker thread with a tokenizer of its own, and
    refuses prompts that cannot fit: by their bytes alone, before tokenising, where that
    already proves it (no token is longer than the longest the vocabulary spells)."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, tool_call_parser: str | None = None) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self._worker_tokenizer = copy.deepcopy(tokenizer)  # the event loop keeps the other (decoding)
        # How the chat template takes tools and how the model calls them (no template: no chat).
        self.chat_tools = ChatTools(self._worker_tokenizer, tool_call_parser) if tokenizer.chat_template else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-tokenize")
        self._max_token_bytes = _max_token_bytes(tokenizer)
        self._texts: dict[int, str] = {}

    async def run(self, fn, *args):
        """``fn(*args)`` on the tokenising thread: the event loop serves other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def encode(self, prompt, max_tokens: int | None) -> list[int]:
        if isinstance(prompt, str):
            self._fits_bytes(len(prompt.encode("utf-8", "surrogatepass")), max_tokens)
        _text, ids = tokenize_prompt(self._worker_tokenizer, prompt, self.vocab_size)
        return self._fits(ids, max_tokens)

    def encode_chat(self, messages: list[dict], max_tokens: int | None, tools: list[dict] | None = None) -> list[int]:
        self._fits_bytes(sum(len(str(m.get("content") or "").encode("utf-8", "surrogatepass")) for m in messages),
                         max_tokens)
        return self._fits(self.chat_ids(messages, tools=tools), max_tokens)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, fitting or not (``/tokenize``; on the tokenising thread)."""
        if add_special_tokens:
            return tokenize_prompt(self._worker_tokenizer, text, self.vocab_size)[1]
        return self._worker_tokenizer.encode(check_text(text), add_special_tokens=False)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        """A chat's token ids, with tools, tool calls and tool results written as the
        template takes them (``tools.ChatTools``)."""
        if self.chat_tools is not None:
            messages, tools = self.chat_tools.conversation(messages, tools)
        return chat_prompt_ids(self._worker_tokenizer, messages, add_generation_prompt, tools)

    def token_text(self, token_id: int) -> str:
        """A token's text as the API shows it alone (a piece of a character shows as U+FFFD)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def decode_prompt(self, prompts: list, prompt_ids: list[list[int]]) -> list[str]:
        """Each prompt's text: as given, or decoded from its token ids."""
        return [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(prompts, prompt_ids)]

    def _fits_bytes(self, num_bytes: int, max_tokens: int | None) -> None:
        if self._max_token_bytes is None:
            return
        at_least = -(-num_bytes // self._max_token_bytes)
        if at_least + (max_tokens or 1) > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; the "
                             f"prompt's {num_bytes} bytes make at least {at_least} tokens")

    def _fits(self, ids: list[int], max_tokens: int | None) -> list[int]:
        wanted = len(ids) + (max_tokens or 1)
        if wanted > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the request asks for {wanted} ({len(ids)} in the prompt, "
                             f"{max_tokens or 1} to generate)")
        return ids


def _max_token_bytes(tokenizer) -> int | None:
    """An upper bound of the UTF-8 bytes one token stands for: the longest any token of the
    vocabulary decodes to, and a few more for a leading space a decoder may drop. None
    without a fast tokenizer's backend (no bound: every prompt is tokenised)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    longest = max((len(backend.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass"))
                   for i in range(backend.get_vocab_size())), default=0)
    return longest + 4


class _Run:
    """One HTTP request's engine requests (``n`` choices per prompt, choice ``i * n + j``
    the j-th of prompt i, as OpenAI numbers them) and their metrics."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, prompt_ids: list[list[int]],
                 params: list[SamplingParams], prefix: str) -> None:
        self.engine, self.metrics = engine, metrics
        self.prompt_ids, self.params, self.n = prompt_ids, params, len(params)
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.streams: list[RequestStream] = []
        self.chunk_object, self.model = "", ""  # a streamed response's chunks: set by the stream
        self._timing: dict[str, list[float | None]] = {}  # req_id -> [first, last token time]

    async def start(self) -> None:
        """Queue every prompt, or none: a refusal aborts those already queued."""
        limit, wanted = self.engine.max_queued_requests, len(self.prompt_ids) * self.n
        if limit is not None:  # more than the queue and every slot: no use retrying
            room = limit + self.engine.engine.scheduler.max_num_seqs
            if wanted > room:
                raise APIError(400, f"this request asks for {wanted} choices; the server runs and queues "
                               f"at most {room}", param="n")
        try:
            for i, ids in enumerate(self.prompt_ids):
                first = f"{self.id}-{i * self.n}"
                for j, params in enumerate(self.params):  # later choices share the first's prompt
                    self.streams.append(await self.engine.add_request(
                        ids, params, f"{self.id}-{i * self.n + j}", prompt_from=first if j else None))
        except BaseException as exc:
            self.abort()
            if isinstance(exc, QueueFullError):
                # A queued request takes about a second or two on a small model: come back then.
                raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"}) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, str(exc), "service_unavailable") from None
            if isinstance(exc, ValueError):
                raise APIError(400, str(exc)) from None
            raise
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in self.prompt_ids))

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(choice index, output)`` as they come, all choices interleaved. Stopping
        early (a disconnect cancels us) aborts whatever has not finished."""
        reads: dict[asyncio.Future, int] = {}
        try:
            if len(self.streams) == 1:
                async for out in self.streams[0]:
                    self._observe(out)
                    yield 0, out
                return
            reads = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(self.streams)}
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = reads.pop(task)
                    out = task.result()
                    self._observe(out)
                    if not out.finished:
                        reads[asyncio.ensure_future(anext(self.streams[index]))] = index
                    yield index, out
        finally:
            for task in reads:
                task.cancel()
            self.abort()

    async def collect(self) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        async for index, out in self.outputs():
            if out.finished:
                final[index] = out
        outs = [final[i] for i in range(len(self.streams))]
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise APIError(500, f"generation failed: {failed[0].error}", "server_error")
        return outs

    def _observe(self, out: RequestOutput) -> None:
        """Latency and token metrics, as the client sees them."""
        now = time.monotonic()
        timing = self._timing.setdefault(out.req_id, [None, None])
        if out.delta_token_ids:
            self.metrics.generation_tokens.inc(len(out.delta_token_ids))
            if timing[0] is None:
                timing[0] = now
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - timing[1])
            timing[1] = now
        if out.finished:
            self.metrics.request_finished(out.finish_reason, now - self.arrival, timing[0], now,
                                          len(out.token_ids))


def _usage(outs: list[RequestOutput], n: int = 1, scores_only: bool = False) -> dict:
    """OpenAI's usage of a request's choices (``n`` per prompt, in order; best_of's all):
    each prompt counted once, with its first choice's cached tokens (``scores_only``: the
    one token generated for a max_tokens 0 request is not returned, nor counted)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs[::n])
    completion = 0 if scores_only else sum(len(o.token_ids) for o in outs)
    spec = SpecDecodeStats.total([o.spec_stats for o in outs if o.spec_stats])
    cached = sum(o.num_cached_tokens for o in outs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached},
            "speculation": spec.as_dict()}


# ---------------------------------------------------------------------- streaming
def _sse(events: AsyncIterator[dict], run: _Run) -> StreamingResponse:
    async def body():
        async for event in events:
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    # A client gone before the first chunk cancels the stream before its generator ever
    # runs (so no finally of ours would): the background task aborts whatever is left.
    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(run.abort),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream_events(run: _Run, include_usage: bool, chunk, scores_only: bool = False) -> AsyncIterator[dict]:
    """Content chunks (``chunk(index, out)``: ``out``'s delta; None when it has none), an
    error event if a request fails, then the usage chunk when asked for."""
    final: dict[int, RequestOutput] = {}
    try:
        async for index, out in run.outputs():
            if out.finished:
                final[index] = out
                if out.finish_reason == "error":
                    yield error_body(f"generation failed: {out.error}", "server_error")
                    return
            event = chunk(index, out)
            if event is not None:
                yield event
    except EngineDeadError as exc:  # headers are sent: the error travels as an event
        yield error_body(str(exc), "service_unavailable")
        return
    if include_usage:
        yield {"id": run.id, "object": run.chunk_object, "created": run.created, "model": run.model,
               "choices": [], "usage": _usage([final[i] for i in sorted(final)], run.n, scores_only)}


def _stream_completion(run: _Run, model: str, include_usage: bool, view: "_CompletionView") -> AsyncIterator[dict]:
    run.chunk_object, run.model = "text_completion", model

    def chunk(index, out):
        choice = view.delta(index, out)
        if choice is None:
            return None
        return {"id": run.id, "object": "text_completion", "created": run.created, "model": model,
                "choices": [choice]}

    return _stream_events(run, include_usage, chunk, view.scores_only)


def _chat_reply(body: ChatCompletionRequest, chat_tools: ChatTools | None):
    """A maker of each choice's ``ChatReply``, for the request's ``tool_choice``."""
    mode = body.tool_mode
    if mode == "none":
        return ChatReply
    if chat_tools is None:
        raise ValueError("this model's tokenizer has no chat template")
    if mode == "auto" and body.parallel_tool_calls is False and chat_tools.format != "hermes":
        raise APIError(400, f"parallel_tool_calls false is not supported with the {chat_tools.format} "
                       "tool-call format", param="parallel_tool_calls")
    named = body.tool_choice.function.name if mode == "named" else None
    return lambda: ChatReply(mode, chat_tools.format, named)


async def _stream_chat(run: _Run, model: str, include_usage: bool, logprobs, reply) -> AsyncIterator[dict]:
    run.chunk_object, run.model = "chat.completion.chunk", model
    replies: dict[int, ChatReply] = {}

    def event(index, delta, lps, finish_reason):
        return {"id": run.id, "object": "chat.completion.chunk", "created": run.created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason}]}

    def chunk(index, out):
        lps = logprobs(out.delta_logprobs) if out.delta_logprobs else None
        choice = replies.setdefault(index, reply())
        content, calls = choice.feed(out.delta_text, final=out.finished)
        if not (content or calls or out.finished or lps):
            return None
        delta = {"content": content} if content or not calls else {}
        if calls:
            delta["tool_calls"] = calls
        return event(index, delta, lps, choice.finish_reason(out.finish_reason) if out.finished else None)

    for index in range(len(run.prompt_ids) * run.n):  # each choice's first chunk names its role
        yield event(index, {"role": "assistant", "content": ""}, None, None)
    async for item in _stream_events(run, include_usage, chunk):
        yield item


# ---------------------------------------------------------------------- log-probabilities
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf: a token the sampler could not draw (vLLM's value)


def _finite(logprob: float) -> float:
    return logprob if logprob > NEG_INF_LOGPROB else NEG_INF_LOGPROB


def _chat_logprobs(lps: list[TokenLogprob] | None, top: int, text) -> dict | None:
    """OpenAI's chat ``logprobs``: per token its text, bytes, log-probability and the
    ``top`` likeliest."""
    if lps is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]} for lp in lps],
            "refusal": None}


def _best(outs: list[RequestOutput], best_of: int, n: int) -> list[tuple[int, RequestOutput]]:
    """Per prompt (``best_of`` outputs each, in order), the ``n`` whose tokens have the
    highest mean log-probability (OpenAI's best_of), as (index among ``outs``, output)."""
    if best_of == n:
        return list(enumerate(outs))
    chosen = []
    for start in range(0, len(outs), best_of):
        group = list(enumerate(outs[start:start + best_of], start))
        group.sort(key=lambda item: -item[1].cumulative_logprob / max(len(item[1].token_ids), 1))
        chosen += sorted(group[:n])
    return chosen


class _CompletionView:
    """How a completion choice reads: its text (after the prompt, with ``echo``) and the
    legacy ``logprobs`` object (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``; with ``echo`` the prompt's tokens first, the very first with null)."""

    def __init__(self, body: CompletionRequest, text, prompt_texts: list[str], num_generated: int) -> None:
        self.echo, self.logprobs, self.text = bool(body.echo), body.logprobs, text
        self.prompt_logprobs = body.prompt_logprobs
        self.scores_only, self.prompt_texts, self.num_generated = body.scores_only, prompt_texts, num_generated
        self._offsets: dict[int, int] = {}   # streaming: text offset reached per choice

    def choice(self, index: int, out: RequestOutput, prompt: int) -> dict:
        text, lps, finish = out.text, out.logprobs, out.finish_reason
        if self.scores_only:
            text, lps, finish = "", [], "length"
        lead = self.prompt_texts[prompt] if self.echo else ""
        choice = {"index": index, "text": lead + text, "finish_reason": finish,
                  "logprobs": self._logprobs(out, lps, self.echo, 0)}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        return choice

    def delta(self, index: int, out: RequestOutput) -> dict | None:
        """A streamed choice's chunk (None: nothing new); the prompt comes with its first."""
        first = index not in self._offsets
        offset = self._offsets.setdefault(index, 0)
        text, lps = out.delta_text, out.delta_logprobs
        if self.scores_only:
            text, lps = "", []
        echo = self.echo and first
        if echo:
            text = self.prompt_texts[index // self.num_generated] + text
        logprobs = self._logprobs(out, lps, echo, offset)
        if logprobs is not None:
            self._offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
        with_prompt_logprobs = first and self.prompt_logprobs is not None
        if not (text or out.finished or (logprobs and logprobs["tokens"]) or echo or with_prompt_logprobs):
            return None
        finish = ("length" if self.scores_only else out.finish_reason) if out.finished else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if with_prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs(out)
        return choice

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a map
        from token id to its log-probability, rank (the prompt token's own) and text: the
        prompt token and the ``prompt_logprobs`` likeliest."""
        entries: list[dict | None] = [None]
        for lp in out.prompt_logprobs or ():
            entry = {str(t): {"logprob": _finite(v), "rank": i + 1, "decoded_token": self.text(t)}
                     for i, (t, v) in enumerate(lp.top[:self.prompt_logprobs])}
            entry[str(lp.token_id)] = {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                       "decoded_token": self.text(lp.token_id)}
            entries.append(entry)
        return entries

    def _logprobs(self, out: RequestOutput, lps, with_prompt: bool, offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        entries: list[tuple[int, float | None, tuple]] = []
        if with_prompt:
            entries.append((out.prompt_token_ids[0], None, ()))
            entries += [(lp.token_id, lp.logprob, lp.top) for lp in out.prompt_logprobs or ()]
        entries += [(lp.token_id, lp.logprob, lp.top) for lp in lps or ()]
        tokens = [self.text(t) for t, _, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [None if v is None else _finite(v) for _, v, _ in entries],
                "top_logprobs": [None if v is None else {self.text(t): _finite(x) for t, x in top[:self.logprobs]}
                                 for _, v, top in entries],
                "text_offset": offsets}


# ---------------------------------------------------------------------- access and limits
# Routes that need no API key: probes and metrics scrapers rarely carry one, and neither
# says anything about the requests served. Everything else (the API, /tokenize, /docs and
# /openapi.json included) needs the key when one is set.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class _GuardMiddleware:
    """API key on every route but ``OPEN_PATHS`` (401) and a request-body limit (413),
    before any route runs.

    The body is read here (at most ``max_body_bytes``) and replayed to the app; after it,
    ``receive`` is the server's own, so disconnects still reach the app.
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            return await _send_error(send, 401, "missing or invalid API key: send "
                                     "'Authorization: Bearer <key>'", "invalid_request_error",
                                     "invalid_api_key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        # As bytes: compare_digest refuses str with non-ASCII characters (a 500, not a 401).
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode("latin-1"), self.api_key.encode())

    async def _too_large(self, send):
        await _send_error(send, 413, f"request body larger than {self.max_body_bytes} bytes",
                          "invalid_request_error", "request_too_large")


async def _send_error(send, status: int, message: str, type_: str, code: str) -> None:
    payload = json.dumps(error_body(message, type_, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
