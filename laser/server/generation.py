"""Generation requests shared by ``/v1/completions``, ``/v1/chat/completions`` and the Batch API:
admission, queueing every choice for the engine, waiting for the outputs. Parsing a request's
fields lives in :mod:`laser.server.fields`, streaming (SSE) in :mod:`laser.server.streaming`,
route handlers in :mod:`laser.server.openai`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import uuid

from fastapi import Request

from ..frontend.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
    SLOInfeasibleError,
    StreamError,
)
from ..core.request import SLO, InvalidRequestError, SamplingParams
from ..frontend.inputs import ContextLengthError
from .errors import APIError, param_of, unavailable
from .fields import RequestFields
from .metrics import ServerMetrics
from .token_texts import TokenTexts

#: ASGI scope key of a request's arrival (engine clock, seconds), set by ``laser.server.app._Arrival``.
ARRIVAL_KEY = "laser.arrival"
#: A client's ``X-Request-Id`` that becomes the response id: at most 128 letters, digits and ``._:-``
#: (anything else, e.g. spaces or quotes, would make an id a log line or a URL cannot carry as is).
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class Sub:
    """One choice of an HTTP request: a prompt (x n) on its way through the engine."""

    __slots__ = ("index", "ids", "prompt_text", "sp", "stream", "final", "sent_ids", "sent_lps", "offset",
                 "tool_parser", "prompt_only")

    def __init__(self, index: int, ids: list[int], prompt_text: str | None, sp: SamplingParams):
        self.index, self.ids, self.prompt_text, self.sp = index, ids, prompt_text, sp
        self.stream: RequestStream | None = None
        self.final = None
        self.sent_ids = 0  # output token ids already streamed (return_token_ids)
        self.sent_lps = 0  # output tokens whose logprobs were streamed
        self.offset = 0  # text_offset of the next streamed token (completions logprobs)
        self.tool_parser = None  # a chat choice with tools: its ToolCallParser (laser.server.tool_parser)
        # completions' echo with max_tokens 0: the engine runs max_tokens 1 (its one forward pass
        # gives the prompt's logprobs) and the client sees no output token (see view)
        self.prompt_only = False

    def view(self, out):
        """``out`` (an engine :class:`~laser.frontend.outputs.RequestOutput` of this choice) as the
        client sees it: itself, or for a :attr:`prompt_only` choice the same with no output tokens,
        text or logprobs and ``finish_reason: "length"`` once finished (vLLM's
        ``echo_without_generation``), so every answer, stream and ``usage`` count reads it alike."""
        if not self.prompt_only:
            return out
        return dataclasses.replace(out, text="", token_ids=[], delta_text="", new_token_ids=[],
                                   logprobs=None if out.logprobs is None else [],
                                   finish_reason="length" if out.finished and out.finish_reason != "abort"
                                   else out.finish_reason)

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


class Generation(RequestFields):
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

    @staticmethod
    def final_note(note: dict | None, out) -> dict | None:
        """``note`` (:meth:`demotion_note`) for a choice's final SSE chunk, with ``failovers`` and
        ``seed_kept`` added when that choice failed over (``out``: its final output)."""
        if not out.num_failovers:
            return note
        return {**(note or {"slo_class": out.slo.name}), "failovers": out.num_failovers, "seed_kept": out.seed_kept}

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

    def validate(self, body, h_class: str | None, h_ttft: str | None, h_tbt: str | None, request=None):
        """Checks shared by the generation endpoints: (arrival time, model name, SLO served,
        stop strings, SLO asked for when it differs -- see :meth:`resolve_slo` -- else None).
        The arrival (engine clock, seconds) is the app's first sight of ``request`` (Starlette
        ``Request``; its ``scope[ARRIVAL_KEY]``, stamped by ``laser.server.app._Arrival`` before
        the body was read and validated), else the clock now.

        Raises APIError: 404 for an unknown model; 400 for an unsupported parameter, a bad SLO or stop list.
        """
        now = self.ae.engine.clock()
        arrival = request.scope.get(ARRIVAL_KEY) if request is not None else None
        model = self.check_model(body.model)
        self.check_unsupported(body)
        slo, asked = self.resolve_slo(body.slo_fields(), h_class, h_ttft, h_tbt,
                                      None if request is None else request.headers)
        if arrival is None:
            arrival = now
        else:
            self.metrics.handler_wait.labels(self.metrics.model_name, slo.name).observe(max(0.0, now - arrival))
        return arrival, model, slo, self.stop_strings(body), asked

    async def encode(self, prompt, param: str, tools: list[dict] | None = None, truncate: int | None = None,
                     **switches) -> list[int]:
        """Token ids of a prompt (chat messages rendered with ``tools`` and the chat template
        ``switches``: ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``), cut to their last ``truncate`` tokens (the request's
        ``truncate_prompt_tokens``, :meth:`~laser.frontend.inputs.InputProcessor.truncate`), checked
        against the context. Raises APIError: 400 naming ``param`` (or ``truncate_prompt_tokens``)."""
        try:
            self.ae.inputs.truncate([], truncate)  # its rule first: text is cut to what it keeps before tokenizing
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_value", "truncate_prompt_tokens") from None
        try:
            ids = await self.ae.encode(prompt, tools, truncate, **switches)
        except ContextLengthError as e:  # text too long to tokenize into the context (inputs.check_text_length)
            raise APIError(400, f"{param}: the {e}", "context_length_exceeded", param) from None
        except InvalidRequestError as e:
            msg = str(e)
            if param_of(msg) in switches:  # a template switch's own error: "chat_template_kwargs: ..."
                raise APIError(400, msg, "invalid_value", param_of(msg)) from None
            msg = "the " + msg if msg.startswith("prompt ") else msg
            msg = msg if msg.startswith(f"{param}[") else f"{param}: {msg}"  # messages[1].content: ...
            raise APIError(400, msg, "invalid_value", param) from None
        try:
            ids = self.ae.inputs.truncate(ids, truncate)
        except InvalidRequestError as e:
            raise APIError(400, str(e), "invalid_value", "truncate_prompt_tokens") from None
        try:
            self.ae.inputs.check_length(ids)  # the input path's rule (laser.frontend.inputs)
        except ContextLengthError as e:
            raise APIError(400, f"{param}: the {e}", "context_length_exceeded", param) from None
        except InvalidRequestError as e:
            raise APIError(400, f"{param}: the {e}", "invalid_value", param) from None
        return ids

    def max_tokens_for(self, requested: int | None, prompt_len: int, default: int | None,
                       field: str = "max_tokens") -> int:
        """The max_tokens of a choice: ``requested``, else ``default``, else the rest of the context.
        Raises APIError: 400 ``context_length_exceeded`` naming ``field`` (the request's name of
        max_tokens) when prompt plus max_tokens pass the context."""
        if requested is None:
            requested = default if default is not None else self.ae.max_model_len - prompt_len
        try:
            self.ae.inputs.check_budget(prompt_len, requested, field)
        except ContextLengthError as e:
            raise APIError(400, str(e), "context_length_exceeded", field) from None
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
            headers = {"x-laser-predicted-ttft-ms": f"{e.predicted_ttft * 1e3:.1f}"}
            if e.never:  # a target no retry can meet: not 429 (clients retry 429)
                raise APIError(400, str(e), "slo_infeasible", "slo_class", headers=headers) from None
            raise APIError(429, str(e), "slo_infeasible", "slo_class", headers={"retry-after": "1", **headers}) from None
        except EngineStoppedError as e:
            self.metrics.reject("unavailable", slo.name)
            raise APIError(503, str(e), "unavailable") from None
        except InvalidRequestError as e:  # more choices than the queue bound
            self.metrics.reject("invalid")
            raise APIError(400, str(e), "invalid_value", "prompt") from None
        q: asyncio.Queue = asyncio.Queue()
        for s, a in zip(subs, adms):
            self.metrics.admitted(a)
            s.stream = self.ae.submit(s.ids, s.sp, a, queue=q, arrival_time=arrival)
        a0 = adms[0]
        headers = {"x-slo-class": a0.slo.name}
        if a0.demoted:
            # "warm": a demotable hot request under pressure (or --on-infeasible demote to a warm class);
            # "hot": --on-infeasible demote to a looser hot class; "true": infeasible, served as best_effort;
            # "cold": a Batch API line naming another class, served in the batch tier
            headers["x-slo-demoted"] = "true" if a0.demoted_to == "best_effort" else a0.demoted_to
            headers["x-slo-requested-class"] = a0.requested.name
        preds = [a.predicted_ttft for a in adms if a.predicted_ttft is not None]
        if preds:
            headers["x-laser-predicted-ttft-ms"] = f"{max(preds) * 1e3:.1f}"
        return q, headers

    async def resolve_bad_words(self, subs: list[Sub]) -> None:
        """Tokenize the choices' ``bad_words`` before admission (once per request: its choices share
        the words), so that a bad word is a 400 before the request is admitted or counted, and the
        engine thread does not tokenize them. Raises APIError: 400 naming ``bad_words``."""
        done: dict[tuple[str, ...], SamplingParams] = {}
        for s in subs:
            words = s.sp.bad_words
            if not words or s.sp.bad_words_token_ids is not None:
                continue
            if words not in done:
                try:
                    done[words] = await self.ae.resolve_bad_words(s.sp)
                except InvalidRequestError as e:
                    raise APIError(400, str(e), "invalid_value", "bad_words") from None
            s.sp = dataclasses.replace(s.sp, bad_words_token_ids=done[words].bad_words_token_ids)

    async def launch(self, subs: list[Sub], slo: SLO, arrival: float, id_prefix: str, asked: SLO | None = None,
                     client_id: str | None = None):
        """:meth:`start`, then wait until the engine has every choice: (queue, headers, id, created).
        The id (also the ``x-request-id`` header) is ``<id_prefix><client_id>`` when the client
        sent an ``X-Request-Id`` header that :data:`CLIENT_ID` accepts (vLLM's convention: a
        trace id the client already logs), else ``<id_prefix><random hex>``; ``id_prefix`` ends
        with its separator (``chatcmpl-``, OpenAI's ``resp_``)."""
        await self.resolve_bad_words(subs)
        q, headers = self.start(subs, slo, arrival, asked)
        ok = client_id is not None and CLIENT_ID.fullmatch(client_id)
        rid = f"{id_prefix}{client_id if ok else uuid.uuid4().hex}"
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
            raise APIError(400, str(err), "invalid_value", param_of(str(err)))
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
                    s.final = s.view(item)
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
            added = getattr(subs[0].stream, "added_time", None)
            if added is not None:  # the engine's own TTFT: from when it took the request (no front end)
                info["engine_ttft_ms"] = (reqs[0].token_times[0] - added) * 1e3
        if reqs and all(s.final.finish_reason in ("stop", "length") for s in subs):
            info["slo_met"] = all(all(r.slo_outcome()) for r in reqs)
        moved = [r for r in reqs if r.num_failovers]
        if moved:
            info["failovers"] = sum(r.num_failovers for r in moved)
            kept = [r.seed_kept for r in moved if r.seed_kept is not None]
            info["seed_kept"] = all(kept) if kept else None
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
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": cached}}
        deep = [s.final for s in subs if s.final is not None and s.final.num_depth_tokens]
        if deep:  # dynamic depth (laser.core.depth): the mean layers its decode tokens ran
            tokens = sum(f.num_depth_tokens for f in deep)
            out["dynamic_depth"] = {"decode_tokens": tokens,
                                    "mean_layers": sum(f.mean_depth * f.num_depth_tokens for f in deep) / tokens}
        return out
