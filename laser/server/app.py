"""FastAPI app: OpenAI-compatible completions and chat completions with per-request SLOs.

``build_app(async_engine)`` returns the app; ``laser serve`` runs it under uvicorn. Every
route handler only parses, tokenizes (in a helper thread), decides admission and reads
outputs from a queue: the engine loop runs in its own thread and never waits on HTTP.

Failures are OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` bodies:
400 for anything wrong with the request (never a 500), 401 for a bad API key, 429 when the
queue is full or the TTFT target is infeasible (``--on-infeasible reject``), 503 while
shutting down. A client that disconnects has its request aborted at once.

Routes live in :mod:`laser.server.openai` (generation) and :mod:`laser.server.batches`
(files and batches); this module builds the app: lifespan, middleware, error handlers,
``/health`` (``GET`` and ``HEAD``), ``/version`` and ``/metrics``. An unhandled exception in a handler (a
bug) is a JSON 500 ``internal_error`` that leaves a keep-alive connection open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import os
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..frontend.async_engine import AsyncEngine, EngineStepError, EngineUnavailableError
from . import openai as openai_routes
from .errors import APIError, error_response, format_validation, unavailable
from .generation import ARRIVAL_KEY, Generation
from .heap import GC_PAUSES
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 << 20


class _BodyTooLarge(StarletteHTTPException):
    """Raised from the guarded ``receive`` once a body passes the limit; FastAPI re-raises an
    HTTPException met while reading the body, so it reaches :func:`build_app`'s handler."""

    error_code = "request_too_large"


#: Paths that answer without the API key: probes, metrics and the API's own documentation.
#: Every other route (``/v1/*``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ...) needs it:
#: vLLM checks only ``/v1/*`` (its ``/tokenize`` runs the tokenizer for anyone), SGLang every path
#: but ``/health*`` and ``/metrics``; a route that runs the model's code is one a key should guard.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class _Guard:
    """Pure-ASGI middleware (keeps disconnect detection intact): Bearer API key on every route
    but :data:`OPEN_PATHS`, and a request-body size limit: by ``Content-Length`` before anything
    is read, and by counting the bytes received (a chunked body has no ``Content-Length``)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_reject: Callable[[str], None]):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope.get("path", "").rstrip("/") not in OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            ok = auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.api_key)
            if not ok:
                self.on_reject("unauthorized")
                resp = error_response(401, "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                                      "invalid_api_key", headers={"www-authenticate": "Bearer"})
                return await resp(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                too_big = False
            if too_big:
                self.on_reject("too_large")
                resp = error_response(413, self._too_large_message(), "request_too_large")
                return await resp(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body_bytes:
                    self.on_reject("too_large")
                    raise _BodyTooLarge(413, self._too_large_message())
            return msg

        await self.app(scope, limited_receive, send)

    def _too_large_message(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes"


class _Unhandled:
    """Pure-ASGI middleware, the outermost of ours: an exception that no handler of the app
    took (a bug) is logged once and answered as an OpenAI-style JSON 500
    (``internal_error``), and the connection stays open for its next request.

    Starlette's own last resort (``ServerErrorMiddleware``) sends the 500 and then re-raises,
    so that the server logs it; uvicorn then closes the connection, and a client reusing a
    keep-alive connection (the ``openai`` client, httpx, aiohttp) meets a dropped connection on
    its next request. vLLM answers such errors with a JSON 500 the same way. An exception
    raised after the response has started (a stream cut mid-way) is re-raised: that response is
    incomplete, and closing the connection is the only way to tell the client.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error serving %s %s", scope.get("method"), scope.get("path"))
            resp = error_response(500, f"internal server error: {type(exc).__name__}", "internal_error")
            await resp(scope, receive, send)



class _Arrival:
    """Pure-ASGI middleware, the outermost of ours: stamps each HTTP request's arrival
    (``clock()``, the engine's clock in seconds) into ``scope[ARRIVAL_KEY]`` as the app first
    sees it -- before its body is read, parsed and validated (pydantic) and the handler runs.
    The handlers plan the TTFT deadline from this stamp (:meth:`laser.server.generation.
    Generation.validate`): under load the event loop may take milliseconds from here to the
    handler, slack a deadline stamped in the handler would not know it had lost (vLLM stamps
    ``arrival_time`` later still, in its input processor).
    """

    def __init__(self, app, clock: Callable[[], float]):
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[ARRIVAL_KEY] = self.clock()
        await self.app(scope, receive, send)


def _price(plan) -> float | None:
    """The scheduler's price of ``plan`` when it planned it (``plan.predicted``; seconds), or None."""
    return None if plan.predicted is None else plan.predicted[1]


def build_app(
    async_engine: AsyncEngine,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    metrics: ServerMetrics | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout_s: float = 0.0,
    data_dir: str | os.PathLike | None = None,
    batch_concurrency: int = 8,
    batch_accept_infeasible: bool = False,
    batch_store=None,
    cors: dict | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine`` (started/stopped by the app's lifespan).

    Args:
        served_model_names: names accepted in ``model`` (default: the engine's model name).
        api_key: require ``Authorization: Bearer <api_key>`` on every route but :data:`OPEN_PATHS`.
        metrics: collectors (default: new ones in a private registry).
        drain_timeout_s: at app shutdown, let in-flight requests finish this long before aborting.
        data_dir: where the Batch API keeps its SQLite store and files (``/v1/files``,
            ``/v1/batches``); None: no Batch API (those routes answer 404). Raises
            :class:`laser.store.DataDirInUseError` when another process serves from it.
        batch_store: an open :class:`laser.store.BatchStore` to use instead of opening ``data_dir``
            (``laser serve`` opens it before building the engine, so a second server on the same
            directory is refused at once).
        batch_concurrency: batch lines in flight at most (:class:`laser.batch.manager.BatchManager`).
        batch_accept_infeasible: accept, with a warning, batch jobs predicted to miss their window.
        cors: Starlette ``CORSMiddleware`` keyword arguments (:func:`laser.server.cli.cors_options`),
            the outermost middleware (a preflight needs no API key); None: no CORS (``OPTIONS`` 405).
    """
    ae = async_engine
    names = list(served_model_names or [ae.model_name])
    metrics = metrics or ServerMetrics(names[0], ae)
    metrics.async_engine = ae
    if metrics.on_output not in ae.listeners:
        ae.listeners.append(metrics.on_output)
    srv = Generation(ae, metrics, names)

    mgr = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ae.start()
        try:
            if mgr is not None:
                await mgr.start()
            yield
        finally:
            if mgr is not None:
                await mgr.stop()
            await ae.shutdown(drain_timeout_s)

    app = FastAPI(
        title="Laser",
        version=__version__,
        description="OpenAI-compatible LLM serving with per-request SLOs (layer-level scheduling).",
        lifespan=lifespan,
    )
    app.state.async_engine = ae
    app.state.metrics = metrics
    _middleware(app, api_key, max_body_bytes, metrics, cors, lambda: ae.engine.clock())

    _api_error = _error_handlers(app, metrics)
    _health_routes(app, ae, metrics)
    app.include_router(openai_routes.router(srv))
    if data_dir is not None or batch_store is not None:
        from ..batch.manager import BatchError, BatchManager
        from ..store import BatchStore
        from . import batches as batch_routes

        mgr = BatchManager(batch_store if batch_store is not None else BatchStore(data_dir), ae, srv, app, metrics.registry, names[0],
                           concurrency=batch_concurrency, accept_infeasible=batch_accept_infeasible, api_key=api_key)
        app.state.batches = mgr

        @app.exception_handler(BatchError)
        async def _batch_error(request: Request, exc: BatchError):
            return await _api_error(request, batch_routes.as_api_error(exc))
        app.include_router(batch_routes.router(mgr))
    return app


def _middleware(app: FastAPI, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics,
                cors: dict | None, clock: Callable[[], float]) -> None:
    """The app's middleware, innermost first: :class:`_Guard` (API key, body size), then
    :class:`_Unhandled` (a JSON 500, around _Guard too), then CORS when ``cors`` is given
    (so a preflight is answered before the API key check and every answer carries its
    headers), then :class:`_Arrival` outermost (the request's arrival on ``clock``)."""
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, on_reject=metrics.reject)
    app.add_middleware(_Unhandled)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)
    app.add_middleware(_Arrival, clock=clock)


def _error_handlers(app: FastAPI, metrics: ServerMetrics):
    """OpenAI-style error bodies for validation errors, :class:`APIError`, HTTP errors and engine
    step failures (any other exception: a JSON 500 from ``_Unhandled``); returns the
    :class:`APIError` handler (the Batch API's errors reuse it)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        metrics.reject("invalid")
        msg, param = format_validation(exc)
        return error_response(400, msg, "invalid_value", param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 400:
            metrics.reject("invalid")
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = getattr(exc, "error_code", None)
        detail = str(exc.detail)
        if exc.status_code == 400 and code is None and exc.__cause__ is not None:
            # FastAPI's "There was an error parsing the body": JSON it cannot even decode
            # (invalid UTF-8, nesting deeper than the parser's recursion limit), a broken form
            metrics.reject("invalid")
            kind = "JSON" if "json" in request.headers.get("content-type", "") else "request"
            code, detail = "invalid_value", f"malformed {kind} body: {exc.__cause__}"
        return error_response(exc.status_code, detail, code, None, getattr(exc, "headers", None))

    @app.exception_handler(EngineStepError)
    async def _step_error(request: Request, exc: EngineStepError):
        return error_response(500, str(exc), "engine_error")

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(request: Request, exc: EngineUnavailableError):
        return await _api_error(request, unavailable(exc))
    return _api_error


def _health_routes(app: FastAPI, ae: AsyncEngine, metrics: ServerMetrics) -> None:
    """``/health`` (GET and HEAD), ``/version`` and ``/metrics``."""
    @app.get("/health")
    async def health():
        """200 ``{"status": "ok"}`` while serving (``HEAD`` too, for load balancers and probes);
        503 while draining, stopped, after an engine failure, or when a cluster cannot serve."""
        if ae.dead is not None:
            return JSONResponse({"status": "dead", "error": str(ae.dead)}, status_code=503)
        if ae.draining or not ae.running:
            return JSONResponse({"status": "draining" if ae.draining else "stopped"}, status_code=503)
        alive = getattr(ae.engine, "alive", None)  # a cluster: its instances, as the controller sees them
        if alive is None:
            return {"status": "ok"}
        instances = {str(i): {"role": ae.engine.handles[i].role, "alive": a} for i, a in alive().items()}
        if not ae.engine.can_serve():
            return JSONResponse({"status": "degraded", "instances": instances}, status_code=503)
        return {"status": "ok", "instances": instances}

    app.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head")

    @app.get("/version")
    async def version():
        """vLLM's ``GET /version``: ``{"version": "<laser version>"}`` (``HEAD`` too; no API key needed)."""
        return {"version": __version__}

    app.add_api_route("/version", version, methods=["HEAD"], operation_id="version_head")

    @app.get("/metrics")
    async def prometheus():
        """Prometheus text exposition (``HEAD`` too: aiperf probes the endpoint with it)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_api_route("/metrics", prometheus, methods=["HEAD"], operation_id="metrics_head")

    @app.get("/engine/steps")
    async def engine_steps(since: int = 0):
        """The engine's logged steps numbered ``since`` or later (``laser serve --step-log N``:
        the last N): ``{"total": steps logged so far, "steps": [[number, seconds, plan, ended,
        predicted, cut], ...]}`` (plan: :meth:`laser.core.plan.StepPlan.to_json`; seconds: the
        step's wall time on the engine's clock; ended: the engine's clock when it ended, s;
        predicted: the scheduler's price of the whole plan when it planned it, s, or null when it
        priced none; cut: the layer a step cut short stopped at, null when it ran its plan), the
        core's cumulative ``step_stats``, the engine thread's time split
        (:class:`laser.frontend.engine_thread.EngineThreadTimes`) and the process's garbage
        collections (``"gc"``: :meth:`laser.server.heap.GcPauses.to_json`). A stall shows as a
        step far over its price, or a gap between one step's end and the next one's start
        (``ended - seconds``). 404 without a step log."""
        core = getattr(ae.engine, "core", None)
        log = getattr(core, "step_log", None)
        if not hasattr(log, "since"):
            raise StarletteHTTPException(404, "no step log: start laser serve with --step-log N")
        st, t = core.step_stats, ae.times
        return {"total": log.total, "steps": [[i, s, plan.to_json(), end, _price(plan), cut]
                                              for i, plan, s, end, cut in log.since(since)],
                "step_stats": {"steps": st.steps, "schedule_s": st.schedule_s, "execute_s": st.execute_s},
                "engine_thread": dataclasses.asdict(t), "gc": GC_PAUSES.to_json()}
