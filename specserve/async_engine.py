"""AsyncLLMEngine: the synchronous engine driven by one background thread, for asyncio callers.

The engine is not thread-safe, so exactly one thread touches it: the engine thread runs
commands (add, abort) between steps and steps while any request is unfinished; it sleeps
when idle. Callers on the event loop submit commands and read per-request queues, so a
step (tens of milliseconds of compute) never blocks the HTTP server.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from specserve.engine import LLMEngine
from specserve.metrics import SpecDecodeStats
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.spec.calibration import ConfidenceCalibration

logger = logging.getLogger("specserve")


class QueueFullError(ValueError):
    """The waiting queue is at ``max_queued_requests``; try again later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a bug or shutdown); no request can run."""


@dataclass
class EngineSnapshot:
    """Engine state published by the engine thread after every loop turn; read by
    /metrics and /health from other threads without touching the engine."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0           # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_rope_restarts: int = 0            # LongRoPE requests recomputed in long mode
    prefix_cache_queries: int = 0         # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0            # of which found there
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    draft_length_counts: dict[int, int] = field(default_factory=dict)  # k chosen -> requests
    tree_size_counts: dict[int, int] = field(default_factory=dict)  # further tree nodes -> requests
    draft_calibration: ConfidenceCalibration | None = None  # live: read with ``describe()``
    num_steps: int = 0


class RequestStream:
    """The outputs of one request, in order, ending with the finished one.

    Whoever stops reading before the end must call ``abort()`` (a ``finally`` does it), so
    the request's KV blocks are freed before the engine's next step.
    """

    def __init__(self, engine: "AsyncLLMEngine", req_id: str, outputs: asyncio.Queue) -> None:
        self.engine, self.req_id, self._outputs = engine, req_id, outputs
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = out.finished
        return out

    def abort(self) -> None:
        """Cancel the request unless it already finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.req_id)


class AsyncLLMEngine:
    """``async for out in engine.generate(prompt, params, req_id): ...``

    Leaving the ``async for`` early (a client disconnect cancels the task) aborts the
    request; its KV blocks are freed by the engine thread before its next step.
    """

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.snapshot = EngineSnapshot()
        self.error: str | None = None         # why the engine thread died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._num_steps = 0
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        engine.rank_lost_listeners.append(self._rank_lost)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._publish()
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every unfinished request and stop the engine thread."""
        if not self._thread.is_alive():
            return
        self.abort_all()
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ requests
    async def add_request(self, prompt: str | Sequence[int], params: SamplingParams,
                          req_id: str, prompt_from: str | None = None) -> RequestStream:
        """Queue a request; returns the stream of its outputs. Bad input raises ValueError
        (QueueFullError when the waiting queue is full) and queues nothing. ``prompt_from``:
        see ``LLMEngine.add_request``."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        try:
            await self._call(self._add, prompt, params, req_id, loop, outputs, prompt_from)
        except asyncio.CancelledError:
            # The engine thread may have added it before the cancel came: nobody will read it.
            self._call_nowait(self._abort_unread, req_id, outputs)
            raise
        return RequestStream(self, req_id, outputs)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams,
                       req_id: str) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate; leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, params, req_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, req_id: str) -> None:
        self._call_nowait(self._abort, req_id)

    def abort_all(self) -> None:
        """Abort every unfinished request (each stream ends with finish_reason "abort")."""
        self._call_nowait(self._abort_all)

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run ``fn(engine)`` on the engine thread between steps (probes, tests)."""
        return await self._call(fn, self.engine)

    # ------------------------------------------------------------------ engine thread side
    def _add(self, prompt, params, req_id, loop, outputs, prompt_from=None) -> None:
        # A burst onto free sequence slots is not a queue: only what must wait for a slot counts.
        if self.max_queued_requests is not None and \
                self.engine.scheduler.num_queued >= self.max_queued_requests:
            raise QueueFullError(f"the server's queue is full ({self.max_queued_requests} "
                                 "requests waiting for a free slot); retry later")
        self.engine.add_request(prompt, params, req_id, prompt_from)
        self._streams[req_id] = (loop, outputs)

    def _abort(self, req_id: str) -> None:
        self._streams.pop(req_id, None)  # its reader left: no output to deliver
        self.engine.abort(req_id)

    def _abort_unread(self, req_id: str, outputs: asyncio.Queue) -> None:
        """Abort ``req_id`` if ``outputs`` is its stream (not another request's of that id)."""
        stream = self._streams.get(req_id)
        if stream is not None and stream[1] is outputs:
            self._abort(req_id)

    def _abort_all(self) -> None:
        # Streams stay registered, so each reader still gets its final "abort" output.
        for req_id in list(self._streams):
            self.engine.abort(req_id)

    def _run(self) -> None:
        try:
            while not self._stopping or self.engine.has_unfinished_requests():
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self._num_steps += 1
                    self._publish()
                elif not self._stopping:
                    self._publish()
                    self._wake.wait()
                    self._wake.clear()
            self._run_commands()
        except BaseException as exc:  # a bug: fail every stream rather than hang them
            logger.exception("the engine thread died")
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            self._fail_all(EngineDeadError(f"the engine stopped: {self.error}"))
        finally:
            self._publish()
            self._fail_all(EngineDeadError("the engine has stopped"))
            self._fail_commands()

    def _queued_commands(self):
        """Take the queued commands, oldest first, until the queue is empty."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_commands(self) -> None:
        for fn, args, future in self._queued_commands():
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except Exception as exc:
                if future is None:
                    logger.exception("engine command %s failed", getattr(fn, "__name__", fn))
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _fail_commands(self) -> None:
        """Commands that arrive after the thread ended are answered, never left pending."""
        for _fn, _args, future in self._queued_commands():
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine has stopped"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue  # aborted by its caller
            if out.finished:
                del self._streams[out.req_id]
            loop, q = stream
            self._put(loop, q, out)

    def _rank_lost(self, why: str) -> None:
        """(The rank watch's thread) another tensor-parallel rank died: the engine thread
        may be stuck in a collective for good, so every stream is failed from here."""
        self.error = why
        self._fail_all(EngineDeadError(f"the engine stopped: {why}"))

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for loop, q in streams.values():
            self._put(loop, q, exc)

    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, item) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # that event loop is closed: nobody is listening
            pass

    def _publish(self) -> None:
        engine, kv = self.engine, self.engine.kv
        self.snapshot = EngineSnapshot(
            num_running=engine.scheduler.num_running, num_waiting=engine.scheduler.num_waiting,
            kv_cache_usage=1.0 - kv.num_free_blocks / kv.num_blocks,
            num_free_blocks=kv.num_free_blocks, num_preemptions=engine.scheduler.num_preemptions,
            num_rope_restarts=engine.scheduler.num_rope_restarts,
            prefix_cache_queries=kv.num_query_tokens, prefix_cache_hits=kv.num_hit_tokens,
            spec_stats=engine.spec_stats.copy(), draft_length_counts=dict(engine.draft_length_counts),
            tree_size_counts=dict(engine.tree_size_counts),
            draft_calibration=engine.draft_calibration,
            num_steps=self._num_steps)

    # ------------------------------------------------------------------ plumbing
    def _call_nowait(self, fn, *args) -> None:
        self._commands.put((fn, args, None))
        self._wake.set()

    async def _call(self, fn, *args):
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running{': ' + self.error if self.error else ''}")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, args, future))
        self._wake.set()
        if not self._thread.is_alive():  # it ended after the check: answer the command here
            self._fail_commands()
        return await asyncio.wrap_future(future)

