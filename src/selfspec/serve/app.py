"""The ASGI application: OpenAI routes, the API key, server-sent events, metrics.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed or not),
``GET /v1/models[/{id}]``, ``GET /health`` (200 ready, 503 loading or shutting down) and
``GET /metrics``. With an API key, every route but ``/health`` needs ``Authorization: Bearer
KEY`` (compared in constant time). Every error is ``{"error": {"message", "type", "param",
"code"}}``: a bad request is a 4xx, never a 500 or a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .. import __version__
from .engine import Engine, Job
from .metrics import CONTENT_TYPE
from .protocol import chunk, response, sse
from .requests import ApiError, parse_json, parse_request

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
STATUS_KEY = "selfspec_status"  # request.state: the status the metrics count (499: the client went away)


@dataclass
class AppOptions:
    """What the app serves.

    Attributes:
        model_id: the name ``/v1/models`` lists and requests' ``model`` must match.
        aliases: other names accepted in ``model`` (e.g. what ``--model`` was given).
        api_key: None: no key needed.
        max_body_bytes: larger request bodies get 413.
        default_max_tokens: for requests without ``max_tokens`` (capped by the context).
    """

    model_id: str
    aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 256
    created: int = field(default_factory=lambda: int(time.time()))


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Gate:
    """Pure ASGI middleware: the API key on every route but /health, and the requests counter by
    status for the completion routes."""

    def __init__(self, app, options: AppOptions, engine: Engine) -> None:
        self.app = app
        self.key = options.api_key.encode() if options.api_key else None
        self.engine = engine

    def _authorized(self, scope) -> ApiError | None:
        assert self.key is not None  # asked only where an API key is set
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                given = token.strip() if scheme.lower() == b"bearer" else b""
                break
        ok = hmac.compare_digest(given, self.key)  # constant time in the key's length and content
        if ok:
            return None
        if not given:
            return ApiError(401, "missing API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        return ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            denied = self._authorized(scope) if self.key is not None and scope["path"] != "/health" else None
            if denied is not None:
                await _error(denied)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            if scope["path"] in COMPLETION_PATHS:
                final = scope.get("state", {}).get(STATUS_KEY) or status[0] or 500
                self.engine.metrics.inc("requests", status=str(final))


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_big
        parts.append(part)
    return b"".join(parts)


class _ClientGone(Exception):
    pass


async def _disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_event(engine: Engine, job: Job, request: Request, until: tuple[str, ...]) -> tuple:
    """The job's next event of a kind in ``until`` (or an error), cancelling the job if the
    client disconnects first."""
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while True:
            get = asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                event = get.result()
                if event[0] in until or event[0] == "error":
                    return event
                continue
            get.cancel()
            engine.cancel(job)
            raise _ClientGone
    except asyncio.CancelledError:
        engine.cancel(job)
        raise
    finally:
        gone.cancel()


def create_app(engine: Engine, options: AppOptions) -> FastAPI:
    """The FastAPI application serving ``engine``."""
    app = FastAPI(title="selfspec", docs_url=None, redoc_url=None, openapi_url=None)
    names = {options.model_id, *options.aliases}

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        what = {404: f"no route {request.method} {request.url.path}; see GET /v1/models",
                405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error(ApiError(e.status_code, what, code=code, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:  # logged by the server, no traceback here
        return _error(ApiError(500, f"internal error ({type(e).__name__}); see the server log",
                               code="internal_error"))

    def model_card() -> dict:
        card: dict[str, Any] = {"id": options.model_id, "object": "model", "created": options.created,
                                "owned_by": "selfspec"}
        g = engine.generator
        card["selfspec"] = {"version": __version__}
        if g is not None:
            card["max_model_len"] = engine.context_length
            card["selfspec"].update(method=g.method, lossless=g.lossless, kernels=g.kernels)
        return card

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
        waiting, running = engine.queue_sizes()
        return JSONResponse({"status": "ok", "active_slots": running,
                             "max_batch": engine.batcher.max_batch if engine.batcher is not None else 1,
                             "waiting": waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model not in names:
            raise ApiError(404, f"model {model!r} not found; this server serves {options.model_id!r}", "model",
                           "model_not_found")
        return JSONResponse(model_card())

    async def complete(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        req = parse_request(parse_json(await _read_body(request, options.max_body_bytes)), chat)
        if req.model is not None and req.model not in names:
            raise ApiError(404, f"model {req.model!r} not found; this server serves {options.model_id!r}", "model",
                           "model_not_found")
        if engine.draining:
            raise ApiError(503, "the server is shutting down; retry later", code="shutting_down")
        if not engine.ready:
            raise ApiError(503, "the model is still loading; retry shortly (GET /health says when it is ready)",
                           code="model_loading", headers={"Retry-After": "5"})
        ids = await anyio.to_thread.run_sync(engine.encode, req)
        ctx = engine.context_length
        param = "messages" if chat else "prompt"
        if len(ids) >= ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context is {ctx}; shorten it",
                           param, "context_length_exceeded")
        if req.max_tokens is None:
            max_new = min(options.default_max_tokens, ctx - len(ids))
        elif len(ids) + req.max_tokens > ctx:
            raise ApiError(400, f"max_tokens {req.max_tokens} is beyond the context: the prompt has {len(ids)} "
                                f"tokens and the model's context is {ctx}; ask for {ctx - len(ids)} or fewer",
                           "max_tokens", "context_length_exceeded")
        else:
            max_new = req.max_tokens
        job = Job(req, ids, max_new, arrived)
        engine.submit(job)
        model_name = options.model_id
        try:
            event = await _next_event(engine, job, request, ("started",) if req.stream else ("done",))
        except _ClientGone:
            setattr(request.state, STATUS_KEY, 499)
            return Response(status_code=499)
        if event[0] == "error":
            raise event[1]
        if not req.stream:
            return JSONResponse(response(req, model_name, event[1]))

        async def events():
            finished = False
            try:
                if req.chat:
                    yield sse(chunk(req, model_name, first=True))
                while True:
                    kind, *rest = await job.events.get()
                    if kind == "delta":
                        yield sse(chunk(req, model_name, text=rest[0]))
                    elif kind == "done":
                        out = rest[0]
                        yield sse(chunk(req, model_name, out=out))
                        if req.include_usage:
                            yield sse(chunk(req, model_name, usage_only=out))
                        finished = True
                        yield sse("[DONE]")
                        return
                    elif kind == "error":
                        setattr(request.state, STATUS_KEY, rest[0].status)
                        finished = True
                        yield sse(rest[0].body())
                        yield sse("[DONE]")
                        return
            finally:
                if not finished:  # the client went away (or the server is being killed)
                    engine.cancel(job)
                    setattr(request.state, STATUS_KEY, 499)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    app.add_middleware(_Gate, options=options, engine=engine)
    return app
