"""The HTTP application of ``specjax serve``: OpenAI-compatible endpoints on Starlette, served by
uvicorn (:func:`make_server`).

Why Starlette + uvicorn (not FastAPI): the request bodies are validated by specjax's own
declarations (:class:`~specjax.core.sampling.Sampling` and :mod:`specjax.serve.protocol`, whose
messages are the CLI's), so FastAPI's pydantic layer would be a second, divergent validator and
one more dependency; Starlette is the ASGI toolkit FastAPI itself is built on (routing,
streaming responses, lifespan), small and well kept, and uvicorn is its reference server
(graceful shutdown on SIGTERM with a bounded timeout).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``POST /tokenize``, ``GET /health``, ``GET /metrics``. With an API key every
endpoint but ``/health`` and ``/metrics`` needs ``Authorization: Bearer KEY`` (401 otherwise).

A generation request: the body is validated (400 with an OpenAI error body naming the field),
refused with 429 and ``Retry-After`` when ``max_queue`` requests already wait for a slot (requests
in flight beyond the engine's slots), then
submitted to the engine thread (:class:`~specjax.serve.worker.EngineWorker`); its updates arrive
on an asyncio queue. Stop strings are found on the decoded text exactly as ``specjax generate``
finds them (:func:`specjax.api.stop_cut`, :class:`specjax.api.TextStream`): the text is cut
before the stop string and the request is cancelled in the engine. A client that disconnects
(mid-stream, or while waiting for a whole response) cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import traceback
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specjax.api import TextStream, logprob_records, stop_cut
from specjax.serve import protocol as P
from specjax.serve.metrics import CONTENT_TYPE, ServeMetrics
from specjax.serve.worker import EngineFault, EngineWorker, WorkerStopped

MAX_BODY_BYTES = 8 * 1024 * 1024
DISCONNECT_POLL_S = 1.0  # a non-streaming request checks this often whether its client is still there
SHUTDOWN_MARGIN_S = 5.0  # after the graceful window: time for the cancelled requests to end their responses
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health", "/metrics")


def _engine_request(req: P.GenerationRequest):
    """The :class:`~specjax.runtime.request.Request` the engine decodes (its prompt the token ids)."""
    return req.request


class _Run:
    """One request's output as its updates arrive: the kept token ids and log-probabilities (cut at
    a stop string), the text shown so far, the finish reason, the stats and the seed."""

    def __init__(self, req: P.GenerationRequest, tokenizer, t0: float, metrics: ServeMetrics):
        self.req, self.tok, self.t0, self.metrics = req, tokenizer, t0, metrics
        self.ids: list[int] = []
        self.records: list[dict] = []
        self.text = TextStream(tokenizer, req.stop)
        self.cut = False  # a stop string was found: the engine request was cancelled
        self.finish: str | None = None
        self.stats = None
        self.seed = req.seed
        self.last = None  # time of the last update with tokens
        self.sent_chars = 0

    def add(self, u) -> tuple[str, list[dict], bool]:
        """Take an update; returns ``(new text, new logprob records, just cut at a stop string)``."""
        self.seed = u.seed
        new, recs, cut_now = [], [], False
        if not self.cut and u.tokens:
            now = time.perf_counter()
            if self.last is None:
                self.metrics.ttft.observe(now - self.t0)
            else:
                self.metrics.itl.observe((now - self.last) / len(u.tokens))
            self.last = now
            start = len(self.ids)
            self.ids.extend(int(t) for t in u.tokens)
            lp = list(u.logprobs or [])
            if self.req.stop:
                k = stop_cut(self.tok, self.ids, self.req.stop)
                if k is not None:
                    self.cut = cut_now = True
                    del self.ids[k:]
            new = self.ids[start:]
            if self.req.logprobs is not None:
                recs = logprob_records(self.tok, lp[: len(new)])
                self.records.extend(recs)
        final = u.finish_reason is not None
        if final:
            self.stats = u.stats
            self.finish = "stop" if self.cut else P.FINISH.get(u.finish_reason, u.finish_reason)
        piece = self.text.feed(new, final=final or self.cut)
        self.sent_chars += len(piece)
        return piece, recs, cut_now

    def full_text(self) -> str:
        return self.text.text(final=True)

    def usage(self) -> dict:
        return P.usage(len(self.req.prompt_ids), len(self.ids))

    def ext(self) -> dict:
        return P.speculative_counters(self.stats, self.seed if self.seed is not None else 0)


class ServeApp:
    """The state behind the routes: the engine, its worker thread, the tokenizer, the defaults,
    the metrics. ``api_key``: ``None`` (open) or the key every ``/v1`` request must bear.
    ``max_queue``: requests that may wait for a slot before new ones get 429.
    ``shutdown_timeout``: seconds the engine thread gets to finish when the server stops."""

    def __init__(self, engine, tokenizer, defaults: P.ServeDefaults, api_key: str | None = None,
                 max_queue: int = 64, shutdown_timeout: float = 10.0):
        self.engine, self.tok, self.d = engine, tokenizer, defaults
        self.api_key, self.max_queue, self.shutdown_timeout = api_key, int(max_queue), float(shutdown_timeout)
        self.metrics = ServeMetrics(engine)
        self.worker: EngineWorker | None = None
        self.created = int(time.time())
        self.stopping = False

    # ---- lifespan
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.worker = EngineWorker(self.engine, asyncio.get_running_loop(), on_step=self.metrics.on_step)
        self.worker.start()
        try:
            yield
        finally:
            self.stopping = True
            ok = await asyncio.get_running_loop().run_in_executor(None, self.worker.stop, self.shutdown_timeout)
            if not ok:
                print(f"specjax serve: note: the engine thread did not stop within {self.shutdown_timeout:g} s; "
                      "exiting anyway", file=sys.stderr, flush=True)

    def begin_shutdown(self) -> None:
        """The server got SIGTERM/SIGINT (uvicorn stops accepting connections): new requests get 503,
        ``/health`` says ``stopping``, and the requests in flight get ``shutdown_timeout`` seconds
        to finish; then they are cancelled in the engine, and each ends its response normally with
        ``finish_reason`` ``"cancelled"`` (so no HTTP task is left for uvicorn to kill)."""
        self.stopping = True
        if self.worker is not None:
            asyncio.get_running_loop().call_later(self.shutdown_timeout, self.worker.cancel_all)

    # ---- helpers
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise P.RequestError("missing or wrong API key; send the header 'Authorization: Bearer KEY' with the "
                                 "server's --api-key", code="invalid_api_key", status=401,
                                 headers={"WWW-Authenticate": "Bearer"})

    async def _body(self, request: Request) -> dict:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise P.RequestError(f"the request body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}",
                                 code="request_too_large", status=413)
        return P.parse_json(raw)

    # ---- endpoints
    async def health(self, request: Request) -> Response:
        if self.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok", "queued": self.engine.queued, "running": self.engine.running,
                             "slots": self.engine.slots})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.d.model_name, "object": "model", "created": self.created, "owned_by": "specjax",
            "max_model_len": self.d.context_limit}]})

    async def tokenize(self, request: Request) -> Response:
        self._authorize(request)
        ids = P.parse_tokenize(await self._body(request), self.tok, self.d)
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": self.d.context_limit})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        t0 = time.perf_counter()
        self._authorize(request)
        body = await self._body(request)
        parse = P.parse_chat if kind == "chat" else P.parse_completion
        req = parse(body, self.tok, self.d)
        if self.stopping or self.worker is None:
            raise P.RequestError("the server is shutting down; retry on another server", code="shutting_down",
                                 status=503, type="server_error")
        waiting = self.worker.in_flight - self.engine.slots  # requests in flight beyond the slots wait
        if waiting >= self.max_queue:
            raise P.RequestError(f"the queue is full ({max(waiting, 0)} requests wait for a slot, --max-queue "
                                 f"{self.max_queue}); retry after a moment", code="queue_full", status=429,
                                 type="rate_limit_error", headers={"Retry-After": "1"})
        queue: asyncio.Queue = asyncio.Queue()
        try:
            rid = self.worker.submit(_engine_request(req), queue)
        except WorkerStopped as e:
            raise P.RequestError(str(e), code="shutting_down", status=503, type="server_error") from None
        except ValueError as e:
            raise P.RequestError(" ".join(str(e).split())) from None
        run = _Run(req, self.tok, t0, self.metrics)
        oid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._events(run, rid, queue, kind, oid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, run, rid, queue, kind, oid, created)

    def _ended(self, run: _Run) -> None:
        self.metrics.finished(len(run.req.prompt_ids), len(run.ids), run.stats, time.perf_counter() - run.t0)

    async def _whole(self, request, run: _Run, rid: int, queue, kind, oid, created) -> Response:
        """Wait for the request's last update (cancel it if the client goes away); the whole response."""
        done, getter = False, None
        try:
            while True:
                if getter is None:
                    getter = asyncio.ensure_future(queue.get())
                ready, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)  # (the getter is not cancelled)
                if not ready:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; the finally cancels the request
                    continue
                item, getter = getter.result(), None
                if isinstance(item, EngineFault):
                    done = True
                    raise P.RequestError(str(item), code="engine_error", status=500, type="server_error")
                _, _, cut_now = run.add(item)
                if cut_now and item.finish_reason is None:
                    self.worker.cancel(rid)
                if item.finish_reason is not None:
                    done = True
                    break
        finally:
            if getter is not None:
                getter.cancel()
            if not done:
                self.worker.cancel(rid)
        self._ended(run)
        build = P.chat_body if kind == "chat" else P.completion_body
        records = run.records if run.req.logprobs is not None else None
        return JSONResponse(build(oid, created, self.d.model_name, run.full_text(), run.finish, records, run.usage(),
                                  run.ext()))

    async def _events(self, run: _Run, rid: int, queue, kind, oid, created):
        """Server-sent events: one chunk per engine update with new text, a last chunk with the
        finish reason and the ``specjax`` counters, the usage chunk when asked, ``data: [DONE]``."""
        model = self.d.model_name
        done = False

        def sse(obj) -> str:
            return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"

        try:
            if kind == "chat":
                yield sse(P.chat_chunk(oid, created, model, {"role": "assistant", "content": ""}, None))
            while True:
                item = await queue.get()
                if isinstance(item, EngineFault):
                    done = True
                    yield sse(P.error_body(str(item), "server_error", None, "engine_error"))
                    break
                offset = run.sent_chars
                piece, recs, cut_now = run.add(item)
                if cut_now and item.finish_reason is None:
                    self.worker.cancel(rid)
                lp = recs if run.req.logprobs is not None else None
                if piece or recs:
                    if kind == "chat":
                        yield sse(P.chat_chunk(oid, created, model, {"content": piece}, None, lp))
                    else:
                        yield sse(P.completion_chunk(oid, created, model, piece, None, lp, offset))
                if item.finish_reason is not None:
                    done = True
                    self._ended(run)
                    ext = run.ext()
                    if kind == "chat":
                        yield sse(P.chat_chunk(oid, created, model, {}, run.finish, specjax=ext))
                    else:
                        yield sse(P.completion_chunk(oid, created, model, "", run.finish, specjax=ext))
                    if run.req.include_usage:
                        yield sse(P.usage_chunk(kind, oid, created, model, run.usage(), ext))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the slot
                self.worker.cancel(rid)


def _endpoint(fn):
    """A route handler whose :class:`~specjax.serve.protocol.RequestError` becomes its JSON error
    response and whose unexpected exception becomes a 500 (traceback on stderr), never a dead server."""
    async def handler(request: Request) -> Response:
        try:
            return await fn(request)
        except P.RequestError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error", None,
                                             "internal_error"), status_code=500)
    return handler


class _CountRequests:
    """ASGI middleware: ``specjax_requests_total{path, status}`` for every HTTP response."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        path = path if path in PATHS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path=path, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(engine, tokenizer, defaults: P.ServeDefaults, *, api_key: str | None = None, max_queue: int = 64,
               shutdown_timeout: float = 10.0) -> Starlette:
    """The ASGI app serving ``engine`` (a :class:`~specjax.runtime.engine.Engine`, warmed up or not).

    Args:
      tokenizer: the target's :class:`~specjax.io.tokenizer.Tokenizer` (prompts, text, stop strings).
      defaults: the server's :class:`~specjax.serve.protocol.ServeDefaults`.
      api_key: ``None`` or the bearer key every ``/v1`` and ``/tokenize`` request needs.
      max_queue: requests waiting for a slot beyond which new ones get 429 (≥ 0).
      shutdown_timeout: seconds the engine thread gets to end when the app shuts down.

    The app's ``state.serve`` is its :class:`ServeApp` (its ``metrics``, its ``worker``)."""
    s = ServeApp(engine, tokenizer, defaults, api_key=api_key, max_queue=max_queue, shutdown_timeout=shutdown_timeout)

    async def not_found(request, exc):
        code = getattr(exc, "status_code", 404)
        msg = (f"no route {request.method} {request.url.path}; endpoints: {', '.join(PATHS)}" if code == 404 else
               f"{request.method} is not allowed on {request.url.path}")
        return JSONResponse(P.error_body(msg, "invalid_request_error", None, "not_found" if code == 404 else
                                         "method_not_allowed"), status_code=code)

    routes = [
        Route("/v1/completions", _endpoint(s.completions), methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(s.chat), methods=["POST"]),
        Route("/v1/models", _endpoint(s.models), methods=["GET"]),
        Route("/tokenize", _endpoint(s.tokenize), methods=["POST"]),
        Route("/health", _endpoint(s.health), methods=["GET"]),
        Route("/metrics", _endpoint(s.metrics_endpoint), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=s.lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.serve = s
    app.add_middleware(_CountRequests, metrics=s.metrics)
    return app


def make_server(app, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 10.0, log_level="warning"):
    """A uvicorn server for ``app`` (from :func:`create_app`). On SIGTERM/SIGINT (or ``should_exit``)
    it stops accepting connections, lets the requests in flight finish for up to
    ``shutdown_timeout`` seconds, then cancels them in the engine (each response ends with
    ``finish_reason`` ``"cancelled"``: :meth:`ServeApp.begin_shutdown`), stops the engine thread
    (the app's lifespan), and returns: the caller exits 0. (uvicorn's default of re-raising the
    signal afterwards, which would end the process with status 143, is not used; its own task
    cancellation, ``SHUTDOWN_MARGIN_S`` later, is only a backstop.)"""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            serve = getattr(getattr(app, "state", None), "serve", None)
            if serve is not None:
                serve.begin_shutdown()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn's, without re-raising the signal after the graceful shutdown
            import signal
            import threading

            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, h in saved.items():
                    signal.signal(sig, h)

    # uvicorn's own deadline only backs ours up (ServeApp.begin_shutdown cancels the requests at shutdown_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_MARGIN_S)
    return _Server(config)
