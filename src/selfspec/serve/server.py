"""Run the app under uvicorn: listen at once, load the model in the background, drain on SIGTERM.

``/health`` answers 503 while the model loads and 200 once it is ready. SIGTERM (or Ctrl-C)
stops accepting connections, answers queued requests 503, lets the request that is decoding
finish, then exits; a second Ctrl-C answers that request 503 ``shutting_down`` too and exits.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn

from ..errors import SelfspecError
from .app import AppOptions, create_app
from .engine import Engine
from .metrics import Metrics

if TYPE_CHECKING:
    from ..generator import SpeculativeGenerator

log = logging.getLogger("selfspec.serve")
FORCE_EXIT_AFTER_S = 2.0  # after a second Ctrl-C: time for the aborted request's 503 to go out


@dataclass(frozen=True)
class ServeOptions:
    """``selfspec serve``'s settings (``selfspec serve --help`` describes each)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queue: int = 16
    max_batch: int | None = None
    request_timeout: float = 300.0
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    log_level: str = "info"


def url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) and listening, or a one-line error."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise SelfspecError(f"--host {host!r} is not an address here ({e}); use e.g. 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise SelfspecError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
                            "(0 picks a free one)") from None
    sock.listen(2048)  # connections queue from here on, so "listening on" is true once it is printed
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, whose exit signals also drain the engine (and are not re-raised)."""

    def __init__(self, config: uvicorn.Config, engine: Engine,
                 timer: Callable[[float, Callable[[], None]], threading.Timer] = threading.Timer) -> None:
        """``timer(seconds, fn)``: starts nothing; returns what calls ``fn`` after ``seconds`` once
        started (``threading.Timer``; tests pass one they fire themselves)."""
        super().__init__(config)
        self.engine = engine
        self.timer = timer
        self.stop_signal: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            print(f"selfspec serve: {signal.Signals(sig).name}: finishing the request in flight, then stopping",
                  file=sys.stderr, flush=True)
        self.stop_signal = sig
        self.engine.drain()
        if self.should_exit and sig == signal.SIGINT:
            # Forcing the exit at once cancelled the in-flight request's task: uvicorn answered it a plain-text
            # 500 and logged a traceback. Answer it 503 shutting_down first; force the exit if it still hangs.
            print("selfspec serve: SIGINT again: answering the request in flight 503 and stopping now",
                  file=sys.stderr, flush=True)
            self.engine.abort()
            timer = self.timer(FORCE_EXIT_AFTER_S, self._force_exit)
            timer.daemon = True
            timer.start()
        else:
            self.should_exit = True

    def _force_exit(self) -> None:
        self.force_exit = True


def serve(opts: ServeOptions, load: Callable[[], SpeculativeGenerator], warning: str | None = None) -> int:
    """Serve the generator ``load()`` returns (called in a background thread) until a signal;
    ``warning`` is printed once the socket is bound."""
    if not logging.getLogger("selfspec").handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("selfspec serve: %(levelname)s: %(message)s"))
        logging.getLogger("selfspec").addHandler(handler)
    logging.getLogger("selfspec").setLevel(opts.log_level.upper())
    sock = bind(opts.host, opts.port)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    host, port = sock.getsockname()[:2]
    engine = Engine(Metrics(), opts.max_queue, opts.request_timeout, opts.max_batch)
    model_id = opts.served_model_name or opts.model
    app = create_app(engine, AppOptions(model_id=model_id, aliases=(opts.model,), api_key=opts.api_key,
                                        max_body_bytes=opts.max_body_bytes,
                                        default_max_tokens=opts.default_max_tokens))
    config = uvicorn.Config(app, log_level=opts.log_level, lifespan="off", access_log=opts.log_level == "debug",
                            timeout_graceful_shutdown=int(opts.request_timeout) + 30)
    server = _Server(config, engine)
    failed: list[BaseException] = []
    base = url(opts.host, port)

    def load_model() -> None:
        try:
            g = load()
            engine.attach(g)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread after the server stops
            failed.append(e)
            server.should_exit = True
            return
        lossless = "lossless" if g.lossless else "NOT LOSSLESS"
        print(f"selfspec serve: ready: {model_id} with {g.method} ({lossless}, {g.kernels} kernels, context "
              f"{engine.context_length}) at {base}/v1{'; API key required' if opts.api_key else ''}",
              file=sys.stderr, flush=True)

    print(f"selfspec serve: listening on {base} (host {host}); loading {opts.model}: GET /health answers 503 until "
          "it is ready", file=sys.stderr, flush=True)
    loader = threading.Thread(target=load_model, name="selfspec-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(timeout=5.0)
        sock.close()
    if failed:
        raise failed[0]
    print("selfspec serve: stopped", file=sys.stderr, flush=True)
    return 130 if server.stop_signal == signal.SIGINT else 0
