"""OpenAI-compatible generation routes: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models[/{id}]``, the Laser extension ``/v1/slo_classes``, vLLM's tokenizer routes, and a
clear OpenAI-style 404 for the OpenAI endpoints this server does not serve (:data:`UNSUPPORTED`); ``/v1/responses``
lives in :mod:`laser.server.responses`."""

from __future__ import annotations

import dataclasses
from typing import Callable

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from ..core.request import InvalidRequestError, choice_seed
from .errors import APIError
from .generation import Generation, Sub, token_ids_fields
from .streaming import EventStream, stream_chat, stream_completion
from .tools import answer_message, chat_messages, tool_constraint, tool_definitions, tool_plan
from .protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)

ERRORS = {
    400: {"model": ErrorResponse, "description": "malformed request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    429: {"model": ErrorResponse, "description": "queue full, or TTFT target infeasible"},
    503: {"model": ErrorResponse, "description": "shutting down"},
}


@dataclasses.dataclass
class SLOHeaders:
    """The SLO request headers of both generation routes (``x-slo-class``, ``x-slo-ttft-ms``,
    ``x-slo-tbt-ms``, and ``x-slo-tpot-ms`` -- llm-d's name of the TBT target, read when
    ``x-slo-tbt-ms`` is absent; a body field of the same meaning wins, see docs/server.md)."""

    x_slo_class: str | None = Header(None)
    x_slo_ttft_ms: str | None = Header(None)
    x_slo_tbt_ms: str | None = Header(None)
    x_slo_tpot_ms: str | None = Header(None)


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's ``/tokenizer_info``: the tokenizer's class, its JSON-representable init settings,
    special tokens, chat template and the served context length (what lm-eval's remote
    tokenizer reads: ``eos_token``, ``bos_token``, ``pad_token``, ``chat_template``)."""
    info = {"tokenizer_class": type(tokenizer).__name__}
    for k, v in getattr(tokenizer, "init_kwargs", {}).items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            info[k] = v
        elif hasattr(v, "content"):  # AddedToken
            info[k] = v.content
    for k in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[k] = getattr(tokenizer, k, None)
    info.update(chat_template=tokenizer.chat_template, model_max_length=max_model_len, vocab_size=len(tokenizer))
    return info


def router(srv: Generation) -> APIRouter:
    """The routes over one :class:`Generation` (one app's engine, metrics and model names)."""
    router = APIRouter()
    from . import responses  # imports this module's SLOHeaders

    for add in (_model_routes, _completions_route, _chat_route, _tokenizer_routes, responses.add_route,
                _unsupported_routes):
        add(router, srv)
    return router


def _model_routes(router: APIRouter, srv: Generation) -> None:
    """``/v1/models[/{id}]`` and the Laser extension ``/v1/slo_classes``."""
    ae, names = srv.ae, srv.names
    cards = {n: ModelCard(id=n, max_model_len=ae.max_model_len) for n in names}  # created: when the app was built

    @router.get("/v1/models", response_model=ModelList)
    async def models():
        return ModelList(data=list(cards.values()))

    @router.get("/v1/models/{model:path}", response_model=ModelCard,
                responses={404: {"model": ErrorResponse, "description": "no such model"}})
    async def model(model: str):
        """One served model (OpenAI's ``models.retrieve``); ``model`` may hold slashes (``org/name``)."""
        if model not in cards:
            raise srv.unknown_model(model, 404)
        return cards[model]

    @router.get("/v1/slo_classes")
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


def _completions_route(router: APIRouter, srv: Generation) -> None:
    """``/v1/completions``."""
    ae, errors = srv.ae, ERRORS

    @router.post("/v1/completions", responses=errors)
    async def completions(body: CompletionRequest, request: Request, h: SLOHeaders = Depends()):
        arrival, model, slo, stop, asked = srv.validate(body, h.x_slo_class, h.x_slo_ttft_ms, h.x_slo_tbt_ms,
                                                 request)
        p = body.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif not p:
            raise APIError(400, "prompt: the prompt is empty", "invalid_value", "prompt")
        elif isinstance(p[0], int):
            prompts = [p]
        else:
            prompts = list(p)
        prompt_only = body.echo and body.max_tokens == 0  # OpenAI's legacy scoring: the prompt alone (vLLM too)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: Input should be greater than or equal to 1 (0 only with echo: the "
                                "prompt and its logprobs alone)", "invalid_value", "max_tokens")
        if body.n > 1 and len(prompts) * body.n > MAX_CHOICES:  # a prompt list alone has no cap (as vLLM)
            raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n) when n > 1, got "
                                f"{len(prompts)} x {body.n}", "invalid_value", "n")
        structured = await srv.structured_output(body)
        subs: list[Sub] = []
        for i, pr in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = await srv.encode(pr, param, truncate=body.truncate_prompt_tokens)
            mt = srv.max_tokens_for(1 if prompt_only else body.max_tokens, len(ids), 16)
            sp = srv.sampling_params(body, mt, stop, structured)
            text = pr if isinstance(pr, str) and body.truncate_prompt_tokens is None else None  # echo: what ran
            for j in range(body.n):  # each choice its own reproducible stream (vLLM: seed + j)
                subs.append(Sub(len(subs), ids, text, dataclasses.replace(sp, seed=choice_seed(sp.seed, j))))
                subs[-1].prompt_only = prompt_only
        if body.echo:
            for s in subs:
                if s.prompt_text is None:
                    s.prompt_text = await ae.decode(s.ids)
        q, headers, rid, created = await srv.launch(subs, slo, arrival, "cmpl-", asked,
                                                   request.headers.get("x-request-id"))
        if body.stream:
            return EventStream(stream_completion(srv, q, subs, rid, created, model, body), lambda: srv.abort(subs),
                               headers)

        def content(s: Sub) -> dict:
            text = (s.prompt_text if body.echo else "") + s.final.text
            if body.logprobs is None:
                return {"text": text}
            ids, entries = list(s.final.token_ids), list(s.final.logprobs)
            if body.echo:
                ids, entries = list(s.ids) + ids, list(s.final.prompt_logprobs or [None] * len(s.ids)) + entries
            return {"text": text, "logprobs": srv.token_texts.completion(ids, entries, 0)}

        return await answer(srv, request, body, subs, q, headers, {"id": rid, "object": "text_completion",
                                                               "created": created, "model": model}, content)


def _chat_route(router: APIRouter, srv: Generation) -> None:
    """``/v1/chat/completions`` (tools: :mod:`laser.server.tools`)."""
    errors = ERRORS

    @router.post("/v1/chat/completions", responses=errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request, h: SLOHeaders = Depends()):
        arrival, model, slo, stop, asked = srv.validate(body, h.x_slo_class, h.x_slo_ttft_ms, h.x_slo_tbt_ms,
                                                 request)
        tools = await tool_plan(body)
        structured = await tool_constraint(srv, tools, await srv.structured_output(body))
        ids = await srv.encode(chat_messages(body.messages), "messages", tools and tools.tools,
                               truncate=body.truncate_prompt_tokens, **body.template_switches())
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        mt = srv.max_tokens_for(getattr(body, field), len(ids), None, field)
        sp = srv.sampling_params(body, mt, stop, structured)
        subs = [Sub(i, ids, None, dataclasses.replace(sp, seed=choice_seed(sp.seed, i))) for i in range(body.n)]
        for s in subs if tools is not None else ():
            s.tool_parser = tools.parser()
        q, headers, rid, created = await srv.launch(subs, slo, arrival, "chatcmpl-", asked,
                                                   request.headers.get("x-request-id"))
        if body.stream:
            return EventStream(stream_chat(srv, q, subs, rid, created, model, body), lambda: srv.abort(subs), headers)

        def content(s: Sub) -> dict:
            if tools is not None:
                out = answer_message(tools, s.final.text, s.final.finish_reason)
            else:
                out = {"message": {"role": "assistant", "content": s.final.text}}
            if body.logprobs:
                out["logprobs"] = {"content": srv.token_texts.chat(s.final.token_ids, s.final.logprobs)}
            return out

        return await answer(srv, request, body, subs, q, headers, {"id": rid, "object": "chat.completion",
                                                               "created": created, "model": model}, content)


def _tokenizer_routes(router: APIRouter, srv: Generation) -> None:
    """vLLM's ``/tokenizer_info``, ``/tokenize`` and ``/detokenize``."""
    ae, errors = srv.ae, ERRORS
    info = tokenizer_info(ae.inputs.tokenizer, ae.max_model_len)

    @router.get("/tokenizer_info")
    async def get_tokenizer_info():
        """vLLM's tokenizer description (lm-eval's remote tokenizer probes it)."""
        return info

    @router.post("/tokenize", responses=errors)
    async def tokenize(body: TokenizeRequest):
        """vLLM's ``/tokenize``: ``count``, ``max_model_len``, ``tokens`` (and ``token_strs``)."""
        srv.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt and messages", "invalid_value", "prompt")
        if body.messages is not None:
            ids = await srv.encode(chat_messages(body.messages), "messages", tool_definitions(body.tools),
                                   **body.template_switches())
        else:
            try:
                ids = await ae.encode_text(body.prompt, body.add_special_tokens)
            except InvalidRequestError as e:
                raise APIError(400, str(e), "invalid_value", "prompt") from None
        strs = srv.token_texts.pieces(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": ae.max_model_len, "tokens": ids, "token_strs": strs}

    @router.post("/detokenize", responses=errors)
    async def detokenize(body: DetokenizeRequest):
        """vLLM's ``/detokenize``: ``{"prompt": text}`` of token ids."""
        srv.check_model(body.model)
        vocab = ae.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} out of range [0, {vocab})", "invalid_value", "tokens")
        return {"prompt": await ae.decode(body.tokens)}


async def answer(srv: Generation, request: Request, body, subs: list[Sub], q, headers: dict, head: dict,
                 content: Callable[[Sub], dict]) -> Response:
    """The non-streaming answer of both generation routes, once every choice has finished:
    ``head`` (id, object, created, model), the choices (``content(sub)``: the ``text`` or
    ``message`` field, and ``logprobs`` when asked), ``usage`` and ``slo``; 499 (no body) when the client went away."""
    if not await srv.run_blocking(request, subs, q):
        return Response(status_code=499)
    srv.check_finished(subs)
    choices = []
    for s in subs:
        c = content(s)
        reason = c.pop("finish_reason", s.final.finish_reason)  # tool_calls (laser.server.tools)
        choices.append({"index": s.index, "logprobs": None, **c, "finish_reason": reason,
                        **token_ids_fields(s, body.return_token_ids)})
    return JSONResponse({**head, "choices": choices, "usage": srv.usage(subs, body.n), "slo": srv.slo_info(subs)},
                        headers=headers)


#: OpenAI endpoints this server does not serve -> why, and what to use instead (the 404's message).
UNSUPPORTED = {
    "/v1/embeddings": "this server serves a generation model, not an embedding (pooling) model",
}
SERVED = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (text), GET /v1/models, POST "
          "/tokenize, POST /detokenize "
          "(and /v1/files, /v1/batches with --data-dir)")


def _unsupported_routes(router: APIRouter, srv: Generation) -> None:
    """``POST`` on each of :data:`UNSUPPORTED`: a 404 ``unsupported_endpoint`` in OpenAI's error
    format naming what is served (an unknown route's bare "Not Found" tells a client nothing; a
    404, not a 501, so that the ``openai`` client does not retry it as a server error)."""
    for path, why in UNSUPPORTED.items():
        def refuse(why: str = why, path: str = path):
            raise APIError(404, f"POST {path} is not supported: {why}. This server serves {SERVED}.",
                           "unsupported_endpoint")
        router.add_api_route(path, refuse, methods=["POST"], include_in_schema=False,
                             operation_id=f"unsupported_{path.strip('/').replace('/', '_')}")
