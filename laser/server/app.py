"""FastAPI app: OpenAI-compatible completions and chat completions with per-request SLOs.

``build_app(async_engine)`` returns the app; ``laser serve`` runs it under uvicorn. Every
route handler only parses, tokenizes (in a helper thread), decides admission and reads
outputs from a queue: the engine loop runs in its own thread and never waits on HTTP.

Failures are OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` bodies:
400 for anything wrong with the request (never a 500), 401 for a bad API key, 429 when the
queue is full or the TTFT target is infeasible (``--on-infeasible reject``), 503 while
shutting down. A client that disconnects has its request aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineStoppedError,
    QueueFullError,
    RequestStream,
    SLOInfeasibleError,
    StreamError,
)
from .. import __version__
from ..request import SLO, InvalidRequestError, SamplingParams
from .metrics import CONTENT_TYPE, ServerMetrics, slo_outcome
from .protocol import (
    MAX_CHOICES,
    MAX_STOP,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    choice_seed,
    unsupported_chat_fields,
)

log = logging.getLogger(__name__)

# Temperatures below this are greedy (as vLLM): dividing logits by ~0 overflows.
MIN_TEMPERATURE = 1e-5
DEFAULT_MAX_BODY_BYTES = 16 << 20

_ERRORS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered as an OpenAI-style body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERRORS.get(status, "error"), "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


# What a union-typed field accepts, for messages (pydantic reports one error per member).
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string or a list of strings",
}
_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")


def _format_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message (and the offending field) from pydantic errors."""
    parts, param, seen = [], None, set()
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        kind = e.get("type", "")
        if kind == "json_invalid":
            err = (e.get("ctx") or {}).get("error", e.get("msg", "invalid JSON"))
            return f"malformed JSON body: {err}", None
        if not loc and kind in _NOT_AN_OBJECT:
            return "the request body must be a JSON object (Content-Type: application/json)", None
        if not loc and kind == "missing":
            return "the request body is empty; expected a JSON object", None
        field = loc[0] if loc else "body"
        if field in seen:  # a union reports once per member: keep the first
            continue
        seen.add(field)
        param = param or (field if loc else None)
        if field in _EXPECTED and kind != "missing":
            parts.append(f"{field}: must be {_EXPECTED[field]}")
        else:
            # drop union-member tags such as 'str' or 'list[int]' from the location
            where = ".".join(x for x in loc if not (x in ("str", "int", "float", "bool") or "[" in x)) or "body"
            msg = "field required" if kind == "missing" else e.get("msg", "invalid value")
            parts.append(f"{where}: {msg}")
        if len(parts) == 3:
            break
    return "; ".join(parts) or "invalid request", param


class _Guard:
    """Pure-ASGI middleware (keeps disconnect detection intact): Bearer API key on ``/v1``
    routes, and a request-body size limit."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_reject: Callable[[str], None]):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope.get("path", "").startswith("/v1"):
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
                resp = error_response(413, f"request body larger than {self.max_body_bytes} bytes", "request_too_large")
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


class _EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (finished, client gone)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(BaseException):
                await self.body_iterator.aclose()


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class _Sub:
    """One choice of an HTTP request: a prompt (x n) on its way through the engine."""

    __slots__ = ("index", "ids", "prompt_text", "sp", "stream", "final", "sent_ids")

    def __init__(self, index: int, ids: list[int], prompt_text: str | None, sp: SamplingParams):
        self.index, self.ids, self.prompt_text, self.sp = index, ids, prompt_text, sp
        self.stream: RequestStream | None = None
        self.final = None
        self.sent_ids = 0  # output token ids already streamed (return_token_ids)

    def new_ids(self, out) -> list[int]:
        """Output token ids not streamed yet (the ``token_ids`` of the next chunk)."""
        ids = out.token_ids[self.sent_ids:]
        self.sent_ids = len(out.token_ids)
        return list(ids)


class _Server:
    """Request handling shared by both endpoints (state of one app)."""

    def __init__(self, ae: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str]):
        self.ae = ae
        self.metrics = metrics
        self.names = served_model_names

    # -- parsing --------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.names[0]
        if model not in self.names:
            raise APIError(400, f"model {model!r} does not exist; this server serves {', '.join(self.names)}",
                           "model_not_found", "model")
        return model

    def resolve_slo(self, body, h_class: str | None, h_ttft: str | None, h_tbt: str | None) -> SLO:
        name = body.slo_class
        if name is not None and not name.strip():
            raise APIError(400, "slo_class must be a non-empty SLO class name", "invalid_slo", "slo_class")
        if name is None and h_class is not None and h_class.strip():
            name = h_class.strip()

        def ms(v_body: float | None, v_header: str | None, header: str) -> float | None:
            if v_body is not None:
                return v_body / 1e3
            if v_header is None or not v_header.strip():
                return None
            try:
                v = float(v_header)
            except ValueError:
                v = math.nan
            if not (v > 0 and math.isfinite(v)):
                raise APIError(400, f"header {header} must be a positive number of milliseconds, got {v_header!r}",
                               "invalid_slo", header)
            return v / 1e3

        ttft = ms(body.ttft_slo_ms, h_ttft, "x-slo-ttft-ms")
        tbt = ms(body.tbt_slo_ms, h_tbt, "x-slo-tbt-ms")
        try:
            return self.ae.slo_classes.resolve(name, ttft, tbt)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_slo", "slo_class") from None

    @staticmethod
    def check_unsupported(body) -> None:
        def bad(field: str, what: str):
            raise APIError(400, f"{field}: {what} is not supported by this server", "unsupported_parameter", field)

        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(body, f)
            if v not in (None, 0):
                bad(f, "a non-zero value")
        if body.logit_bias:
            bad("logit_bias", "a non-empty logit_bias")
        if isinstance(body, CompletionRequest):
            if body.logprobs is not None:
                bad("logprobs", "logprobs")
            if body.suffix:
                bad("suffix", "suffix")
            if body.best_of not in (None, 1):
                bad("best_of", "best_of > 1")
        else:
            if body.logprobs:
                bad("logprobs", "logprobs")
            if body.top_logprobs:
                bad("top_logprobs", "top_logprobs")
            tool = unsupported_chat_fields(body)
            if tool is not None:
                bad(*tool)
            if body.response_format is not None and body.response_format.type != "text":
                bad("response_format", f"response_format type {body.response_format.type!r}")

    @staticmethod
    def stop_strings(body) -> tuple[str, ...]:
        stop = body.stop
        if stop is None:
            return ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "invalid_value", "stop")
        if any(not s for s in stop):
            raise APIError(400, "stop: stop strings must be non-empty", "invalid_value", "stop")
        return stop

    def validate(self, body, h_class: str | None, h_ttft: str | None, h_tbt: str | None):
        """Checks shared by both generation endpoints: (arrival time, model name, SLO, stop strings).

        Raises APIError (400) for an unknown model, an unsupported parameter, a bad SLO or stop list.
        """
        arrival = self.ae.engine.clock()
        model = self.check_model(body.model)
        self.check_unsupported(body)
        slo = self.resolve_slo(body, h_class, h_ttft, h_tbt)
        return arrival, model, slo, self.stop_strings(body)

    def sampling_params(self, body, max_tokens: int, stop: tuple[str, ...]) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_k = body.top_k or 0
        if top_k < 0:
            top_k = 0
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                seed=body.seed,
                stop=stop,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
            )
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_value") from None

    async def encode(self, prompt, param: str) -> list[int]:
        try:
            ids = await self.ae.encode(prompt)
        except InvalidRequestError as e:
            msg = str(e)
            msg = "the " + msg if msg.startswith("prompt ") else msg
            raise APIError(400, f"{param}: {msg}", "invalid_value", param) from None
        if not ids:
            raise APIError(400, f"{param}: the prompt encodes to zero tokens", "invalid_value", param)
        limit = self.ae.max_model_len
        if len(ids) >= limit:
            raise APIError(400, f"{param}: the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                                "(prompt plus at least one generated token)", "context_length_exceeded", param)
        return ids

    def max_tokens_for(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        limit = self.ae.max_model_len
        if requested is None:
            requested = default if default is not None else limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"this model's context is {limit} tokens; the request needs {prompt_len + requested} "
                                f"({prompt_len} in the prompt, {requested} max_tokens); lower max_tokens",
                           "context_length_exceeded", "max_tokens")
        return requested

    # -- running --------------------------------------------------------------------------------------
    def start(self, subs: list[_Sub], slo: SLO, arrival: float) -> tuple[asyncio.Queue, dict[str, str]]:
        """Admission control, then queue every choice for the engine (one event-loop turn)."""
        try:
            adms = self.ae.admit([len(s.ids) for s in subs], slo, arrival)
        except QueueFullError as e:
            self.metrics.reject("queue_full", slo.name)
            raise APIError(429, str(e), "queue_full", headers={"retry-after": "1"}) from None
        except SLOInfeasibleError as e:
            self.metrics.reject("slo_infeasible", slo.name)
            pred = f"{e.predicted_ttft * 1e3:.1f}"
            raise APIError(429, str(e), "slo_infeasible", "slo_class",
                           headers={"retry-after": "1", "x-laser-predicted-ttft-ms": pred}) from None
        except EngineStoppedError as e:
            self.metrics.reject("unavailable", slo.name)
            raise APIError(503, str(e), "unavailable") from None
        q: asyncio.Queue = asyncio.Queue()
        for s, a in zip(subs, adms):
            self.metrics.admitted(a)
            s.stream = self.ae.submit(s.ids, s.sp, a, queue=q, arrival_time=arrival)
        a0 = adms[0]
        headers = {"x-slo-class": a0.slo.name}
        if a0.demoted:
            headers["x-slo-demoted"] = "true"
            headers["x-slo-requested-class"] = a0.requested.name
        preds = [a.predicted_ttft for a in adms if a.predicted_ttft is not None]
        if preds:
            headers["x-laser-predicted-ttft-ms"] = f"{max(preds) * 1e3:.1f}"
        return q, headers

    def abort(self, subs: list[_Sub]) -> None:
        for s in subs:
            if s.stream is not None and not s.stream.done:
                self.metrics.aborted_request(s.stream.admission.slo.name)
                self.ae.abort(s.stream.req_id)

    async def wait_added(self, subs: list[_Sub]) -> None:
        """Wait until the engine has every choice; on a failure abort them all and raise."""
        res = await asyncio.gather(*(s.stream.added for s in subs), return_exceptions=True)
        err = next((r for r in res if isinstance(r, BaseException)), None)
        if err is None:
            return
        self.abort(subs)
        if isinstance(err, InvalidRequestError):
            raise APIError(400, str(err), "invalid_value")
        if isinstance(err, EngineStoppedError):
            raise APIError(503, str(err), "unavailable")
        raise err

    async def collect(self, q: asyncio.Queue, subs: list[_Sub]) -> None:
        by_id = {s.stream.req_id: s for s in subs}
        left = len(subs)
        while left:
            item = await q.get()
            if isinstance(item, StreamError):
                raise item.error
            if item.finished:
                s = by_id[item.req_id]
                if s.final is None:
                    s.final = item
                    left -= 1

    async def run_blocking(self, request: Request, subs: list[_Sub], q: asyncio.Queue) -> bool:
        """Wait for every choice to finish; False when the client went away (then all are aborted)."""
        collect = asyncio.ensure_future(self.collect(q, subs))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect in done:
                collect.result()
                return True
            return False
        finally:
            for t in (collect, watch):
                t.cancel()
            self.abort(subs)

    def slo_info(self, subs: list[_Sub]) -> dict:
        s0 = subs[0].stream.admission
        slo = s0.slo
        info = {
            "slo_class": slo.name,
            "ttft_slo_ms": None if slo.ttft is None else slo.ttft * 1e3,
            "tbt_slo_ms": None if slo.tbt is None else slo.tbt * 1e3,
            "demoted": s0.demoted,
            "predicted_ttft_ms": None if s0.predicted_ttft is None else s0.predicted_ttft * 1e3,
            "ttft_ms": None,
            "slo_met": None,
        }
        reqs = [s.final.request for s in subs if s.final is not None and s.final.request is not None]
        if reqs and reqs[0].token_times:
            info["ttft_ms"] = (reqs[0].token_times[0] - reqs[0].arrival_time) * 1e3
        if reqs and all(s.final.finish_reason in ("stop", "length") for s in subs):
            info["slo_met"] = all(all(slo_outcome(r)) for r in reqs)
        return info

    def check_finished(self, subs: list[_Sub]) -> None:
        if any(s.final.finish_reason == "abort" for s in subs):
            raise APIError(503, "the request was aborted because the server is shutting down", "aborted")

    @staticmethod
    def usage(subs: list[_Sub], n: int) -> dict:
        prompt = sum(len(s.ids) for s in subs[::n])
        completion = sum(len(s.final.token_ids) if s.final is not None else 0 for s in subs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_app(
    async_engine: AsyncEngine,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    metrics: ServerMetrics | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout_s: float = 0.0,
) -> FastAPI:
    """The OpenAI-compatible app over ``async_engine`` (started/stopped by the app's lifespan).

    Args:
        served_model_names: names accepted in ``model`` (default: the engine's model name).
        api_key: require ``Authorization: Bearer <api_key>`` on ``/v1/*`` routes.
        metrics: collectors (default: new ones in a private registry).
        drain_timeout_s: at app shutdown, let in-flight requests finish this long before aborting.
    """
    ae = async_engine
    names = list(served_model_names or [ae.model_name])
    metrics = metrics or ServerMetrics(names[0], ae)
    metrics.async_engine = ae
    if metrics.on_output not in ae.listeners:
        ae.listeners.append(metrics.on_output)
    srv = _Server(ae, metrics, names)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ae.start()
        try:
            yield
        finally:
            await ae.shutdown(drain_timeout_s)

    app = FastAPI(
        title="Laser",
        version=__version__,
        description="OpenAI-compatible LLM serving with per-request SLOs (layer-level scheduling).",
        lifespan=lifespan,
    )
    app.state.async_engine = ae
    app.state.metrics = metrics
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, on_reject=metrics.reject)

    # -- errors ---------------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        metrics.reject("invalid")
        msg, param = _format_validation(exc)
        return error_response(400, msg, "invalid_value", param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status == 400:
            metrics.reject("invalid")
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(EngineStepError)
    async def _step_error(request: Request, exc: EngineStepError):
        return error_response(500, str(exc), "engine_error")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error serving %s", request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", "internal_error")

    errors = {
        400: {"model": ErrorResponse, "description": "malformed request"},
        401: {"model": ErrorResponse, "description": "missing or wrong API key"},
        429: {"model": ErrorResponse, "description": "queue full, or TTFT target infeasible"},
        503: {"model": ErrorResponse, "description": "shutting down"},
    }

    # -- routes ---------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if ae.dead is not None:
            return JSONResponse({"status": "dead", "error": str(ae.dead)}, status_code=503)
        if ae.draining or not ae.running:
            return JSONResponse({"status": "draining" if ae.draining else "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=[ModelCard(id=n, max_model_len=ae.max_model_len) for n in names])

    @app.get("/v1/slo_classes")
    async def slo_classes():
        """Laser extension: the SLO classes requests may name (targets in ms)."""
        table = ae.slo_classes
        return {
            "default": table.default,
            "scale": table.scale,
            "classes": {
                n: {"ttft_ms": None if s.ttft is None else s.ttft * 1e3, "tbt_ms": None if s.tbt is None else s.tbt * 1e3}
                for n, s in sorted(table.classes.items())
            },
            "on_infeasible": ae.on_infeasible,
        }

    @app.post("/v1/completions", responses=errors)
    async def completions(
        body: CompletionRequest,
        request: Request,
        x_slo_class: str | None = Header(None),
        x_slo_ttft_ms: str | None = Header(None),
        x_slo_tbt_ms: str | None = Header(None),
    ):
        arrival, model, slo, stop = srv.validate(body, x_slo_class, x_slo_ttft_ms, x_slo_tbt_ms)
        p = body.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif not p:
            raise APIError(400, "prompt: the prompt is empty", "invalid_value", "prompt")
        elif isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n), got "
                                f"{len(prompts)} x {body.n}", "invalid_value", "n")
        subs: list[_Sub] = []
        for i, pr in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = await srv.encode(pr, param)
            mt = srv.max_tokens_for(body.max_tokens, len(ids), 16)
            sp = srv.sampling_params(body, mt, stop)
            text = pr if isinstance(pr, str) else None
            for j in range(body.n):
                subs.append(_Sub(len(subs), ids, text, dataclasses.replace(sp, seed=choice_seed(sp.seed, j))))
        if body.echo:
            for s in subs:
                if s.prompt_text is None:
                    s.prompt_text = await ae.decode(s.ids)
        q, headers = srv.start(subs, slo, arrival)
        rid = f"cmpl-{uuid.uuid4().hex}"
        headers["x-request-id"] = rid
        try:
            await srv.wait_added(subs)
        except BaseException:
            srv.abort(subs)
            raise
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _EventStream(_stream_completion(srv, q, subs, rid, created, model, body.echo, include_usage, body.n,
                                                   body.return_token_ids), lambda: srv.abort(subs), headers)
        if not await srv.run_blocking(request, subs, q):
            return Response(status_code=499)
        srv.check_finished(subs)
        choices = [
            {"index": s.index, "text": (s.prompt_text if body.echo else "") + s.final.text, "logprobs": None,
             "finish_reason": s.final.finish_reason, **token_ids_fields(s, body.return_token_ids)}
            for s in subs
        ]
        return JSONResponse(
            {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
             "usage": srv.usage(subs, body.n), "slo": srv.slo_info(subs)},
            headers=headers,
        )

    @app.post("/v1/chat/completions", responses=errors)
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        x_slo_class: str | None = Header(None),
        x_slo_ttft_ms: str | None = Header(None),
        x_slo_tbt_ms: str | None = Header(None),
    ):
        arrival, model, slo, stop = srv.validate(body, x_slo_class, x_slo_ttft_ms, x_slo_tbt_ms)
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: only text content parts are supported "
                                            f"(got type {part.type!r})", "unsupported_parameter", "messages")
                    texts.append(part.text)
                content = "\n".join(texts)
            msg = {"role": m.role, "content": content or ""}
            if m.name:
                msg["name"] = m.name
            messages.append(msg)
        ids = await srv.encode(messages, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        mt = srv.max_tokens_for(requested, len(ids), None)
        sp = srv.sampling_params(body, mt, stop)
        subs = [_Sub(i, ids, None, dataclasses.replace(sp, seed=choice_seed(sp.seed, i))) for i in range(body.n)]
        q, headers = srv.start(subs, slo, arrival)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        headers["x-request-id"] = rid
        try:
            await srv.wait_added(subs)
        except BaseException:
            srv.abort(subs)
            raise
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _EventStream(_stream_chat(srv, q, subs, rid, created, model, include_usage, body.n,
                                             body.return_token_ids), lambda: srv.abort(subs), headers)
        if not await srv.run_blocking(request, subs, q):
            return Response(status_code=499)
        srv.check_finished(subs)
        choices = [
            {"index": s.index, "message": {"role": "assistant", "content": s.final.text}, "logprobs": None,
             "finish_reason": s.final.finish_reason, **token_ids_fields(s, body.return_token_ids)}
            for s in subs
        ]
        return JSONResponse(
            {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
             "usage": srv.usage(subs, body.n), "slo": srv.slo_info(subs)},
            headers=headers,
        )

    return app


def token_ids_fields(s: _Sub, want: bool) -> dict:
    """``return_token_ids`` (vLLM extension) of a whole choice: prompt and output token ids."""
    if not want:
        return {}
    return {"prompt_token_ids": list(s.ids), "token_ids": list(s.final.token_ids)}


def stream_token_ids(s: _Sub, out, want: bool) -> dict | None:
    """``return_token_ids`` of one streamed chunk: the output token ids new since the last chunk
    (the prompt's ids with the choice's first chunk); None when not asked or nothing is new.
    A chunk is sent for every output with new tokens, even with no text yet (an incomplete
    UTF-8 character, a special token), so a client times every token exactly."""
    if not want:
        return None
    first = s.sent_ids == 0
    ids = s.new_ids(out)
    if not ids:
        return None
    return {"token_ids": ids, **({"prompt_token_ids": list(s.ids)} if first else {})}


async def _batches(q: asyncio.Queue, subs: list[_Sub]) -> AsyncIterator[list[tuple[_Sub, Any]]]:
    """Yields every (choice, output) ready now, as one batch (one write per batch under load),
    until every choice finished; raises the error of a failed choice."""
    by_id = {s.stream.req_id: s for s in subs}
    left = len(subs)
    while left:
        items = [await q.get()]
        while not q.empty():
            items.append(q.get_nowait())
        batch = []
        for item in items:
            if isinstance(item, StreamError):
                raise item.error
            s = by_id[item.req_id]
            if s.final is not None:
                continue
            if item.finished:
                s.final = item
                left -= 1
            batch.append((s, item))
        yield batch


def _error_event(exc: BaseException) -> str:
    if isinstance(exc, EngineStepError):
        return _sse(error_body(500, str(exc), "engine_error"))
    log.error("stream failed", exc_info=exc)
    return _sse(error_body(500, f"internal server error: {type(exc).__name__}", "internal_error"))


async def _stream_completion(srv, q, subs, rid, created, model, echo, include_usage, n,
                             want_ids=False) -> AsyncIterator[str]:
    def chunk(index: int, text: str, reason: str | None, ids: dict | None = None) -> str:
        return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason,
                                  **(ids or {})}]})

    if echo:
        yield "".join(chunk(s.index, s.prompt_text, None) for s in subs)
    try:
        async for batch in _batches(q, subs):
            buf = []
            for s, out in batch:
                d = out.delta_text  # stop-string hold-back applied by the engine (OutputText)
                ids = stream_token_ids(s, out, want_ids)
                if d or out.finished or ids:
                    buf.append(chunk(s.index, d, out.finish_reason if out.finished else None, ids))
            if buf:
                yield "".join(buf)
    except Exception as e:  # noqa: BLE001
        yield _error_event(e) + "data: [DONE]\n\n"
        return
    if include_usage:
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
                    "usage": srv.usage(subs, n)})
    yield "data: [DONE]\n\n"


async def _stream_chat(srv, q, subs, rid, created, model, include_usage, n, want_ids=False) -> AsyncIterator[str]:
    def chunk(index: int, delta: dict, reason: str | None, ids: dict | None = None) -> str:
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason,
                                  **(ids or {})}]})

    yield "".join(chunk(s.index, {"role": "assistant", "content": ""}, None) for s in subs)
    try:
        async for batch in _batches(q, subs):
            buf = []
            for s, out in batch:
                d = out.delta_text  # stop-string hold-back applied by the engine (OutputText)
                ids = stream_token_ids(s, out, want_ids)
                if d or ids:
                    buf.append(chunk(s.index, {"content": d}, None, ids))
                if out.finished:
                    buf.append(chunk(s.index, {}, out.finish_reason))
            if buf:
                yield "".join(buf)
    except Exception as e:  # noqa: BLE001
        yield _error_event(e) + "data: [DONE]\n\n"
        return
    if include_usage:
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                    "usage": srv.usage(subs, n)})
    yield "data: [DONE]\n\n"
