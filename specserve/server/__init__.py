"""The OpenAI-compatible HTTP server: ``specserve serve`` (see ``app.py`` for the API)."""
from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import threading
import time

from specserve.async_engine import AsyncLLMEngine
from specserve.config import EngineConfig
from specserve.engine import LLMEngine

logger = logging.getLogger("specserve")


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, *,
          api_key: str | None = None, served_model_name: str | None = None,
          max_queued_requests: int | None = None, shutdown_timeout: float = 30.0,
          max_body_bytes: int | None = None, tool_call_parser: str | None = None,
          log_level: str = "info") -> None:
    """Load the engine and serve until SIGINT/SIGTERM. On shutdown the server stops
    accepting connections, gives in-flight requests ``shutdown_timeout`` seconds to finish,
    then aborts the rest and stops the engine."""
    import uvicorn  # lazy: uvicorn and fastapi (app.py) only to serve; GPU hosts may lack them

    from specserve.server.app import DEFAULT_MAX_BODY_BYTES, create_app  # lazy: fastapi, as above

    sock = bind_socket(host, port)  # before the slow model load, so a busy port fails fast
    engine = AsyncLLMEngine(LLMEngine(config), max_queued_requests=max_queued_requests)
    app = create_app(engine, served_model_name=served_model_name, api_key=api_key,
                     max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, tool_call_parser=tool_call_parser)
    host, port = sock.getsockname()[:2]
    logger.info("serving %s on http://%s:%d/v1%s", served_model_name or engine.engine.model_name,
                host, port, " (API key required)" if api_key else "")
    if not api_key and not _loopback(host):
        logger.warning("listening on %s with no API key: anyone who can reach this port can use the "
                       "model (set --api-key or $SPECSERVE_API_KEY)", host)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # uvicorn stops accepting at once; what is still running when the timeout ends
            # is aborted by the engine, so its stream ends with finish_reason "abort" and
            # [DONE] rather than a cut connection. uvicorn's own deadline comes later.
            if not self.should_exit:
                timer = threading.Timer(shutdown_timeout, engine.abort_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level=log_level,
                                   timeout_graceful_shutdown=shutdown_timeout + 5))
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises SIGTERM after its graceful shutdown; let that end this function
        # rather than the process (the other ranks of tensor parallelism are released
        # below), and the process with 0: the shutdown asked for is done.
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()               # the engine thread is done stepping (the app stopped it)
        engine.engine.shutdown()    # then release the other tensor-parallel ranks, if any


def _loopback(host: str) -> bool:
    """Whether ``host`` (an address this server bound) is reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _exit_on_signal(_signum, _frame) -> None:
    raise SystemExit(0)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket; ValueError with the reason when the address cannot be used."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, kind, proto, _name, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ThreadedServer:
    """``with ThreadedServer(app) as srv: srv.url`` — uvicorn on a free port of 127.0.0.1
    in a thread of this process (tests, and the benchmark's in-process mode)."""

    def __init__(self, app, timeout: float = 60.0) -> None:
        import uvicorn  # lazy: only to serve, as in serve()

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="specserve-http", daemon=True)
        self.timeout = timeout
        self.url = ""

    def __enter__(self) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process HTTP server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout)
