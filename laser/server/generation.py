"""Generation requests shared by ``/v1/completions``, ``/v1/chat/completions`` and the Batch API:
parsing and validation, admission, queueing every choice for the engine, waiting for or
streaming (SSE) the outputs. Route handlers live in :mod:`laser.server.openai`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..frontend.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineStoppedError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
    SLOInfeasibleError,
    StreamError,
)
from ..core.request import SLO, InvalidRequestError, SamplingParams
from ..frontend.inputs import ContextLengthError
from .errors import APIError, error_body, unavailable
from .metrics import ServerMetrics, slo_outcome
from ..model.structured import choice_grammar
from .protocol import MAX_STOP, CompletionRequest, unsupported_chat_fields

log = logging.getLogger(__name__)

# Temperatures below this are greedy (as vLLM): dividing logits by ~0 overflows.
MIN_TEMPERATURE = 1e-5
# Internal header: a Batch API line carries a one-use token naming its cold SLO (laser.batch).
BATCH_SLO_HEADER = "x-laser-batch-slo"


class EventStream(StreamingResponse):
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


class Sub:
    """One choice of an HTTP request: a prompt (x n) on its way through the engine."""

    __slots__ = ("index", "ids", "prompt_text", "sp", "stream", "final", "sent_ids", "sent_lps", "offset")

    def __init__(self, index: int, ids: list[int], prompt_text: str | None, sp: SamplingParams):
        self.index, self.ids, self.prompt_text, self.sp = index, ids, prompt_text, sp
        self.stream: RequestStream | None = None
        self.final = None
        self.sent_ids = 0  # output token ids already streamed (return_token_ids)
        self.sent_lps = 0  # output tokens whose logprobs were streamed
        self.offset = 0  # text_offset of the next streamed token (completions logprobs)

    def new_ids(self, out) -> list[int]:
        """Output token ids not streamed yet (the ``token_ids`` of the next chunk)."""
        ids = out.token_ids[self.sent_ids:]
        self.sent_ids = len(out.token_ids)
        return list(ids)


def token_ids_fields(s: Sub, want: bool) -> dict:
    """``return_token_ids`` (vLLM extension) of a whole choice: prompt and output token ids."""
    if not want:
        return {}
    return {"prompt_token_ids": list(s.ids), "token_ids": list(s.final.token_ids)}


def stream_token_ids(s: Sub, out, want: bool) -> dict | None:
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


#: The logprob reported for a token of probability 0 in fp32 (JSON has no -Infinity; vLLM's value).
MIN_LOGPROB = -9999.0


class TokenTexts:
    """Token id -> its text (``tokenizer.decode([id])``, as vLLM reports logprob tokens), cached;
    a private tokenizer copy used on the event loop only (a Rust tokenizer must not be shared
    between threads)."""

    def __init__(self, tokenizer):
        self.tok = tok = copy.deepcopy(tokenizer)
        self.text = functools.lru_cache(maxsize=1 << 16)(lambda i: tok.decode([i]))

    def pieces(self, ids: list[int]) -> list[str]:
        """The tokenizer's own token strings (``convert_ids_to_tokens``, vLLM's ``token_strs``)."""
        return self.tok.convert_ids_to_tokens(list(ids))

    def completion(self, ids, entries, offset: int) -> dict:
        """OpenAI's legacy completions ``logprobs`` of tokens ``ids`` (``entries``: their
        :class:`~laser.request.TokenLogprob`, None for the prompt's first token): ``tokens``,
        ``token_logprobs``, ``top_logprobs`` (token text -> logprob: the top tokens and the token
        itself, as vLLM) and ``text_offset`` (character offsets from ``offset``)."""
        tokens, lps, tops, offsets = [], [], [], []
        for i, e in zip(ids, entries):
            t = self.text(i)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(max(e.logprob, MIN_LOGPROB))
            top = {self.text(j): max(v, MIN_LOGPROB) for j, v in e.top}
            top.setdefault(t, lps[-1])
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, ids, entries) -> list[dict]:
        """The ``logprobs.content`` list of chat: per token ``token``, ``logprob``, ``bytes`` (UTF-8)
        and ``top_logprobs`` (the same fields of the most likely tokens)."""
        def one(i, v):
            t = self.text(i)
            return {"token": t, "logprob": max(v, MIN_LOGPROB), "bytes": list(t.encode("utf-8"))}

        return [{**one(i, e.logprob), "top_logprobs": [one(j, v) for j, v in e.top]} for i, e in zip(ids, entries)]


def new_logprobs(s: Sub, out) -> tuple[list[int], list]:
    """(token ids, TokenLogprobs) of ``s``'s output tokens whose logprobs were not streamed yet."""
    if out.logprobs is None:
        return [], []
    n = len(out.logprobs)
    ids, lps = list(out.token_ids[s.sent_lps:n]), out.logprobs[s.sent_lps:n]
    s.sent_lps = n
    return ids, lps


class Generation:
    """Request handling shared by both endpoints (state of one app)."""

    def __init__(self, ae: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str]):
        self.ae = ae
        self.metrics = metrics
        self.names = served_model_names
        self.token_texts = TokenTexts(ae.inputs.tokenizer)
        # one-use tokens (BATCH_SLO_HEADER) -> the cold SLO of a Batch API line (laser.batch)
        self.batch_slos: dict[str, SLO] = {}

    def demotion_note(self, subs: list[Sub]) -> dict | None:
        """The ``slo`` field of a final SSE chunk when the request was demoted (else None)."""
        a = subs[0].stream.admission
        if not a.demoted:
            return None
        return {"slo_class": a.slo.name, "requested_slo_class": a.requested.name, "demoted": True,
                "demoted_to": a.demoted_to}

    # -- parsing --------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> str:
        """The served name a request's ``model`` field selects (the first name when it is empty).

        Raises:
            APIError: 404 ``model_not_found`` for a name this server does not serve (as OpenAI
            and vLLM answer it; the ``openai`` client raises ``NotFoundError``).
        """
        if model is None or model == "":
            return self.names[0]
        if model not in self.names:
            raise self.unknown_model(model, 404)
        return model

    def unknown_model(self, model: str, status: int) -> APIError:
        """The ``model_not_found`` error for ``model`` (``status``: 404, in a request body and for ``/v1/models/{id}``)."""
        return APIError(status, f"model {model!r} does not exist; this server serves {', '.join(self.names)}",
                        "model_not_found", "model")

    def resolve_slo(self, body, h_class: str | None, h_ttft: str | None, h_tbt: str | None,
                    headers=None) -> tuple[SLO, SLO | None]:
        """(the SLO a request is served under, the one it asked for when that differs, else None).

        A line of a Batch API job (``BATCH_SLO_HEADER``) is served under its job's cold SLO; when
        its body names a class or targets of its own (``slo_class: "chat"``), that is what it asked
        for, checked like any request's, and the response reports both.

        Raises APIError: 400 for an unknown class, bad targets or headers, an unknown batch token.
        """
        headers = headers or {}
        token = headers.get(BATCH_SLO_HEADER)
        if token is not None:  # a line of a Batch API job, sent by laser.batch (cold SLO with its EDF key)
            slo = self.batch_slos.pop(token, None)
            if slo is None:
                raise APIError(400, f"header {BATCH_SLO_HEADER}: unknown token", "invalid_slo", BATCH_SLO_HEADER)
            asked = None
            if any(getattr(body, f) is not None for f in ("slo_class", "ttft_slo_ms", "tbt_slo_ms", "slo_demotable")):
                asked = self._requested_slo(body, None, None, None, {})
            return slo, (asked if asked is not None and asked.name != slo.name else None)
        return self._requested_slo(body, h_class, h_ttft, h_tbt, headers), None

    def _requested_slo(self, body, h_class: str | None, h_ttft: str | None, h_tbt: str | None, headers) -> SLO:
        """The SLO a request names by its body fields, else its headers, else the default class."""
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
        h_tpot = headers.get("x-slo-tpot-ms")  # llm-d / inference-perf's name: TPOT is our TBT target
        if h_tbt is None or not h_tbt.strip():
            tbt = ms(body.tbt_slo_ms, h_tpot, "x-slo-tpot-ms")
        else:
            tbt = ms(body.tbt_slo_ms, h_tbt, "x-slo-tbt-ms")
        demotable = body.slo_demotable
        h_dem = headers.get("x-slo-demotable")
        if demotable is None and h_dem is not None and h_dem.strip():
            if h_dem.strip().lower() not in ("true", "false", "1", "0"):
                raise APIError(400, f"header x-slo-demotable must be true or false, got {h_dem!r}", "invalid_slo",
                               "x-slo-demotable")
            demotable = h_dem.strip().lower() in ("true", "1")
        try:
            return self.ae.slo_classes.resolve(name, ttft, tbt, demotable)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_slo", "slo_class") from None

    @staticmethod
    def check_unsupported(body) -> None:
        def bad(field: str, what: str):
            raise APIError(400, f"{field}: {what} is not supported by this server", "unsupported_parameter", field)

        if isinstance(body, CompletionRequest):
            if body.suffix:
                bad("suffix", "suffix")
            if body.best_of not in (None, 1):
                bad("best_of", "best_of > 1")
        else:
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs: needs logprobs set to true", "invalid_value", "top_logprobs")
            tool = unsupported_chat_fields(body)
            if tool is not None:
                bad(*tool)

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

    def validate(self, body, h_class: str | None, h_ttft: str | None, h_tbt: str | None, headers=None):
        """Checks shared by both generation endpoints: (arrival time, model name, SLO served,
        stop strings, SLO asked for when it differs -- see :meth:`resolve_slo` -- else None).

        Raises APIError: 404 for an unknown model; 400 for an unsupported parameter, a bad SLO or stop list.
        """
        arrival = self.ae.engine.clock()
        model = self.check_model(body.model)
        self.check_unsupported(body)
        slo, asked = self.resolve_slo(body, h_class, h_ttft, h_tbt, headers)
        return arrival, model, slo, self.stop_strings(body), asked

    async def structured_output(self, body) -> tuple[str, str] | None:
        """The (kind, spec) of the request's structured-output constraint (``response_format``
        json_object / json_schema, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
        ``guided_grammar`` / ``structured_outputs``; at most one), compiled once against the
        tokenizer in a helper thread (the first one builds llguidance's tokenizer). None: free text.

        Raises:
            APIError: 400 naming the field: two constraints, a schema or regex that does not
            compile, ``json_schema`` without a schema; a cluster (no grammar backend yet).
        """
        found: list[tuple[str, tuple[str, str]]] = []

        def as_json(v) -> str:
            return v if isinstance(v, str) else json.dumps(v)

        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", ("json", '{"type": "object"}')))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format: type json_schema needs json_schema.schema", "invalid_value",
                               "response_format")
            found.append(("response_format", ("json", as_json(rf.json_schema.schema_))))
        so = body.structured_outputs
        for field, v, kind in (("guided_json", body.guided_json, "json"), ("guided_regex", body.guided_regex, "regex"),
                               ("guided_choice", body.guided_choice, "choice"),
                               ("guided_grammar", body.guided_grammar, "lark"),
                               ("structured_outputs", so and so.json_, "json"),
                               ("structured_outputs", so and so.regex, "regex"),
                               ("structured_outputs", so and so.choice, "choice"),
                               ("structured_outputs", so and so.grammar, "lark")):
            if v is None:
                continue
            if kind == "json":
                found.append((field, ("json", as_json(v))))
            elif kind == "choice":
                if not v or any(not c for c in v):
                    raise APIError(400, f"{field}: the choices must be non-empty strings", "invalid_value", field)
                found.append((field, ("lark", choice_grammar(v))))
            else:
                found.append((field, (kind, v)))
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(f for f, _ in found)
            raise APIError(400, f"{found[1][0]}: give one structured output constraint, got {names}",
                           "invalid_value", found[1][0])
        field, spec = found[0]
        backend = getattr(self.ae.engine, "grammars", None)
        if backend is None:
            raise APIError(400, f"{field}: structured output is not supported by a cluster yet", "unsupported_parameter",
                           field)
        err = await asyncio.get_running_loop().run_in_executor(None, backend.validate, *spec)
        if err is not None:
            raise APIError(400, f"{field}: {err}", "invalid_value", field)
        return spec

    def sampling_params(self, body, max_tokens: int, stop: tuple[str, ...],
                        structured: tuple[str, str] | None = None) -> SamplingParams:
        """The engine's :class:`SamplingParams` of ``body``. Raises APIError: 400 naming the
        field (a bad ``logit_bias`` key, ``min_tokens`` above ``max_tokens``, ...)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < MIN_TEMPERATURE:
            temperature = 0.0
        top_k = body.top_k or 0
        if top_k < 0:
            top_k = 0
        bias = {}
        for k, v in (body.logit_bias or {}).items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise APIError(400, f"logit_bias: keys must be token ids, got {k!r}", "invalid_value",
                               "logit_bias") from None
        if isinstance(body, CompletionRequest):
            logprobs = body.logprobs
            prompt_logprobs = body.logprobs if body.echo else None
        else:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs = None
        if logprobs is not None and not getattr(self.ae.engine, "serves_logprobs", True):
            raise APIError(400, "logprobs: log-probabilities are not supported by a cluster yet",
                           "unsupported_parameter", "logprobs")
        try:
            sp = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=top_k,
                seed=body.seed,
                stop=stop,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=bias,
                min_tokens=body.min_tokens or 0,
                min_p=body.min_p or 0.0,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_output=structured,
            )
            sp.check_vocab(self.ae.engine.model_config.vocab_size)
            return sp
        except InvalidRequestError as e:
            msg = str(e)
            field = msg.split()[0].rstrip(":")
            raise APIError(400, msg, "invalid_value", field if field in type(body).model_fields else None) from None

    async def encode(self, prompt, param: str) -> list[int]:
        try:
            ids = await self.ae.encode(prompt)
        except InvalidRequestError as e:
            msg = str(e)
            msg = "the " + msg if msg.startswith("prompt ") else msg
            raise APIError(400, f"{param}: {msg}", "invalid_value", param) from None
        try:
            self.ae.inputs.check_length(ids)  # the input path's rule (laser.frontend.inputs)
        except ContextLengthError as e:
            raise APIError(400, f"{param}: the {e}", "context_length_exceeded", param) from None
        except InvalidRequestError as e:
            raise APIError(400, f"{param}: the {e}", "invalid_value", param) from None
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
    def start(self, subs: list[Sub], slo: SLO, arrival: float,
              asked: SLO | None = None) -> tuple[asyncio.Queue, dict[str, str]]:
        """Admission control, then queue every choice for the engine (one event-loop turn).
        ``asked``: the SLO the client named when it is served under ``slo`` regardless (a Batch
        API line naming a class: served in the batch tier, reported as demoted to ``cold``)."""
        try:
            adms = self.ae.admit([len(s.ids) for s in subs], slo, arrival,
                                 cached=[self.ae.cached_prompt_tokens(s.ids) for s in subs])
            if asked is not None:
                adms = [dataclasses.replace(a, requested=asked, demoted=True, demoted_to=a.demoted_to or slo.tier)
                        for a in adms]
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
            # "warm": a demotable hot request under pressure; "true": infeasible, served as best_effort;
            # "cold": a Batch API line naming another class, served in the batch tier
            headers["x-slo-demoted"] = "true" if a0.demoted_to == "best_effort" else a0.demoted_to
            headers["x-slo-requested-class"] = a0.requested.name
        preds = [a.predicted_ttft for a in adms if a.predicted_ttft is not None]
        if preds:
            headers["x-laser-predicted-ttft-ms"] = f"{max(preds) * 1e3:.1f}"
        return q, headers

    async def launch(self, subs: list[Sub], slo: SLO, arrival: float, id_prefix: str, asked: SLO | None = None):
        """:meth:`start`, then wait until the engine has every choice: (queue, headers, id, created)."""
        q, headers = self.start(subs, slo, arrival, asked)
        rid = f"{id_prefix}-{uuid.uuid4().hex}"
        headers["x-request-id"] = rid
        try:
            await self.wait_added(subs)
        except BaseException:
            self.abort(subs)
            raise
        return q, headers, rid, int(time.time())

    def abort(self, subs: list[Sub]) -> None:
        for s in subs:
            if s.stream is not None and not s.stream.done:
                self.metrics.aborted_request(s.stream.admission.slo.name)
                self.ae.abort(s.stream.req_id)

    async def wait_added(self, subs: list[Sub]) -> None:
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
        if isinstance(err, EngineUnavailableError):
            raise unavailable(err) from None
        raise err

    async def collect(self, q: asyncio.Queue, subs: list[Sub]) -> None:
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

    async def run_blocking(self, request: Request, subs: list[Sub], q: asyncio.Queue) -> bool:
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

    def slo_info(self, subs: list[Sub]) -> dict:
        s0 = subs[0].stream.admission
        slo = s0.slo
        info = {
            "slo_class": slo.name,
            "ttft_slo_ms": None if slo.ttft is None else slo.ttft * 1e3,
            "tbt_slo_ms": None if slo.tbt is None else slo.tbt * 1e3,
            "demoted": s0.demoted,
            "demoted_to": s0.demoted_to,
            "requested_slo_class": s0.requested.name,
            "predicted_ttft_ms": None if s0.predicted_ttft is None else s0.predicted_ttft * 1e3,
            "ttft_ms": None,
            "slo_met": None,
        }
        reqs = [s.final for s in subs if s.final is not None]  # the outputs' copies, not live requests
        if reqs and reqs[0].token_times:
            info["ttft_ms"] = (reqs[0].token_times[0] - reqs[0].arrival_time) * 1e3
        if reqs and all(s.final.finish_reason in ("stop", "length") for s in subs):
            info["slo_met"] = all(all(slo_outcome(r)) for r in reqs)
        return info

    def check_finished(self, subs: list[Sub]) -> None:
        if any(s.final.finish_reason == "abort" for s in subs):
            raise APIError(503, "the request was aborted because the server is shutting down", "aborted")

    @staticmethod
    def usage(subs: list[Sub], n: int) -> dict:
        """OpenAI's ``usage``: tokens of the prompt (once per prompt, not per choice), of the
        completions, and ``prompt_tokens_details.cached_tokens``: prompt tokens read from the
        prefix cache instead of computed."""
        prompt = sum(len(s.ids) for s in subs[::n])
        cached = sum(s.final.num_cached_tokens if s.final is not None else 0 for s in subs[::n])
        completion = sum(len(s.final.token_ids) if s.final is not None else 0 for s in subs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}



async def _batches(q: asyncio.Queue, subs: list[Sub]) -> AsyncIterator[list[tuple[Sub, Any]]]:
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
    if isinstance(exc, EngineUnavailableError):  # a cluster lost a role it needs: the client sees why
        return _sse(error_body(503, str(exc), "unavailable"))
    log.error("stream failed", exc_info=exc)
    return _sse(error_body(500, f"internal server error: {type(exc).__name__}", "internal_error"))


async def _event_stream(srv, q, subs, base: dict, n: int, include_usage: bool, prologue: str,
                        events: Callable[[Sub, Any], list[str]]) -> AsyncIterator[str]:
    """The SSE body shared by both endpoints: ``prologue``, then the chunks ``events(choice, output)``
    makes of each output (one write per batch of ready outputs), an error event if a choice failed,
    the usage chunk when asked, ``[DONE]``. ``base`` holds the id/object/created/model fields."""
    if prologue:
        yield prologue
    try:
        async for batch in _batches(q, subs):
            buf = [c for s, out in batch for c in events(s, out)]
            if buf:
                yield "".join(buf)
    except Exception as e:  # noqa: BLE001
        yield _error_event(e) + "data: [DONE]\n\n"
        return
    if include_usage:
        yield _sse({**base, "choices": [], "usage": srv.usage(subs, n)})
    yield "data: [DONE]\n\n"


def _usage_so_far(s: Sub, out) -> dict:
    """``stream_options.continuous_usage_stats``: choice ``s``'s usage after ``out`` (None: none yet)."""
    done = 0 if out is None else len(out.token_ids)
    return {"prompt_tokens": len(s.ids), "completion_tokens": done, "total_tokens": len(s.ids) + done}


def _chunker(base: dict, field: str, continuous_usage: bool = False) -> Callable[..., str]:
    """SSE chunk maker of one endpoint: ``chunk(sub, out, value, reason, slo=None, ids=None, logprobs=None)``
    puts ``value`` under ``field`` (``text`` or ``delta``) of choice ``sub.index``, the finish
    reason, the choice's ``logprobs``, the ``return_token_ids`` fields, the final ``slo`` note and,
    with ``continuous_usage``, the choice's usage so far (``out``: its latest output, or None)."""

    def chunk(s: Sub, out, value, reason: str | None, slo: dict | None = None, ids: dict | None = None,
              logprobs=None) -> str:
        obj = {**base, "choices": [{"index": s.index, field: value, "logprobs": logprobs, "finish_reason": reason,
                                    **(ids or {})}]}
        if slo is not None:
            obj["slo"] = slo
        if continuous_usage:
            obj["usage"] = _usage_so_far(s, out)
        return _sse(obj)

    return chunk


def _continuous_usage(body) -> bool:
    o = body.stream_options
    return bool(o and o.include_usage and o.continuous_usage_stats)


def stream_completion(srv, q, subs, rid, created, model, body) -> AsyncIterator[str]:
    """The SSE body of ``/v1/completions`` (``body``: the request). With ``echo``, each choice
    starts with its prompt (and, with ``logprobs``, the prompt's logprobs, known with the first
    output); with ``logprobs``, each chunk carries its new tokens' logprobs."""
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    note = srv.demotion_note(subs)
    chunk = _chunker(base, "text", _continuous_usage(body))
    want_ids, echo, want_lps = body.return_token_ids, body.echo, body.logprobs is not None
    texts = srv.token_texts

    def events(s: Sub, out) -> list[str]:
        first = s.sent_ids == 0 and s.sent_lps == 0
        d = out.delta_text  # stop-string hold-back applied by the engine (OutputText)
        ids = stream_token_ids(s, out, want_ids)
        lps = None
        if want_lps:
            new_ids, entries = new_logprobs(s, out)
            if echo and first:
                new_ids = list(s.ids) + new_ids
                entries = list(out.prompt_logprobs or [None] * len(s.ids)) + entries
            lps = texts.completion(new_ids, entries, s.offset)
            s.offset = lps["text_offset"][-1] + len(lps["tokens"][-1]) if new_ids else s.offset
            if echo and first:
                d = s.prompt_text + d
        if d or out.finished or ids or (lps and lps["tokens"]):
            return [chunk(s, out, d, out.finish_reason if out.finished else None, note if out.finished else None,
                          ids, lps)]
        return []

    prologue = "".join(chunk(s, None, s.prompt_text, None) for s in subs) if echo and not want_lps else ""
    return _event_stream(srv, q, subs, base, body.n, _include_usage(body), prologue, events)


def stream_chat(srv, q, subs, rid, created, model, body) -> AsyncIterator[str]:
    """The SSE body of ``/v1/chat/completions`` (``body``: the request): a role chunk per
    choice, content deltas (with their tokens' ``logprobs.content`` when asked), a finish chunk."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    note = srv.demotion_note(subs)
    chunk = _chunker(base, "delta", _continuous_usage(body))
    want_ids, want_lps = body.return_token_ids, bool(body.logprobs)
    texts = srv.token_texts

    def events(s: Sub, out) -> list[str]:
        d = out.delta_text  # stop-string hold-back applied by the engine (OutputText)
        ids = stream_token_ids(s, out, want_ids)
        lps = None
        if want_lps:
            new_ids, entries = new_logprobs(s, out)
            lps = {"content": texts.chat(new_ids, entries)} if new_ids else None
        buf = [chunk(s, out, {"content": d}, None, None, ids, lps)] if d or ids or lps else []
        if out.finished:
            buf.append(chunk(s, out, {}, out.finish_reason, note))
        return buf

    prologue = "".join(chunk(s, None, {"role": "assistant", "content": ""}, None) for s in subs)
    return _event_stream(srv, q, subs, base, body.n, _include_usage(body), prologue, events)


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
