"""OpenAI's Responses API, its text subset: ``POST /v1/responses`` served as a chat completion.

A request's ``input`` (a string, or a list of ``message`` items whose content is a string or
``input_text`` / ``output_text`` parts) and ``instructions`` (a system message before them)
become chat ``messages``; ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format``
(``text``, ``json_object``, ``json_schema``: the structured-output grammar) and Laser's SLO
fields and headers are those of ``/v1/chat/completions``, which does the rest (template, checks,
admission, engine). The answer is a ``response`` object: one assistant ``message`` item with one
``output_text`` part, ``status`` ``completed`` or ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``) and ``usage`` in input/output tokens; with ``stream`` the Responses
events (``response.created`` ... ``response.output_text.delta`` ... ``response.completed``, whose
``response.status`` may be ``incomplete``: the ``openai`` client's stream helper waits for
``response.completed`` and knows no ``response.incomplete``).

Not served (a 400 ``unsupported_parameter`` naming the field, never ignored): ``tools``,
``previous_response_id`` and ``conversation`` (nothing is stored: ``store`` is reported false),
``background``, and input items other than messages (function calls, images, files).
Reference: the OpenAI API reference, "Responses" (create, the response object, streaming events).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError

from .errors import APIError, format_validation
from .generation import Generation, Sub
from .openai import SLOHeaders
from .protocol import ChatCompletionRequest, _Request
from .streaming import EventStream, _batches, _error_event
from .tools import chat_messages

_NOT_SERVED = {"tools": "tools (function calling through the Responses API; use /v1/chat/completions)",
               "previous_response_id": "previous_response_id (responses are not stored)",
               "conversation": "conversation (responses are not stored)",
               "background": "background responses"}


class ResponsesRequest(_Request):
    """The fields of ``POST /v1/responses`` this server reads (unknown ones are ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(..., description="text, or a list of message items")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: dict[str, Any] | None = Field(None, description="{format: {type: text | json_object | json_schema}}")
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    tool_choice: Literal["none", "auto"] | None = None
    # Laser extension: the per-request SLO (as on the chat route)
    slo_class: str | None = None
    ttft_slo_ms: float | None = Field(None, gt=0)
    tbt_slo_ms: float | None = Field(None, gt=0)
    slo_demotable: bool | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request this response is served as. Raises APIError: 400 naming
        the field (a field not served, an input item that is not a message, a bad ``text.format``)."""
        for field, what in _NOT_SERVED.items():
            if getattr(self, field):
                raise APIError(400, f"{field}: {what} is not supported by this server", "unsupported_parameter", field)
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise APIError(400, "input: an empty list of input items (give a string or message items)", "invalid_value",
                           "input")
        for i, item in enumerate(items):
            messages.append(_message(i, item))
        chat = {"model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "user": self.user,
                "slo_class": self.slo_class, "ttft_slo_ms": self.ttft_slo_ms, "tbt_slo_ms": self.tbt_slo_ms,
                "slo_demotable": self.slo_demotable, "response_format": _response_format(self.text)}
        with self.named_fields():
            try:
                return ChatCompletionRequest.model_validate(chat)
            except ValidationError as e:
                msg, param = format_validation(e)
                raise APIError(400, msg, "invalid_value", param) from None

    @contextmanager
    def named_fields(self):
        """Re-raise a chat completion's 400 in this request's terms: ``messages[k]`` is
        ``instructions`` or ``input[i]``, ``response_format`` is ``text.format``,
        ``max_completion_tokens`` is ``max_output_tokens``."""
        try:
            yield
        except APIError as e:
            offset = int(self.instructions is not None)

            def item(m: re.Match) -> str:
                k = int(m.group(1))
                return "instructions" if k < offset else f"input[{k - offset}]"

            msg = re.sub(r"\bmessages\[(\d+)\]", item, e.message)
            msg = re.sub(r"^(input: )?messages\b", "input", msg)
            msg = re.sub(r"\bresponse_format\b", "text.format", msg).replace("max_completion_tokens",
                                                                              "max_output_tokens")
            param = {"messages": "input", "response_format": "text.format",
                     "max_completion_tokens": "max_output_tokens"}.get(e.param, e.param)
            raise APIError(e.status, msg, e.code, param, e.headers) from None


def _message(i: int, item: dict) -> dict:
    """Chat message of input item ``i``: a ``message`` (``type`` may be left out) with a string
    content or ``input_text`` / ``output_text`` parts."""
    if item.get("type", "message") != "message":
        raise APIError(400, f"input[{i}]: items of type {item.get('type')!r} are not supported (only messages)",
                       "unsupported_parameter", "input")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise APIError(400, f"input[{i}].content[{j}]: only input_text / output_text parts with their text "
                                    f"are supported (got type {kind!r})", "unsupported_parameter", "input")
            texts.append(part["text"])
        content = "\n".join(texts)
    return {"role": item.get("role"), "content": content}


def _response_format(text: dict | None) -> dict | None:
    """Chat ``response_format`` of ``text.format`` (its json_schema fields sit beside ``type``).
    Raises APIError: 400 naming ``text.format`` when it is not an object."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format: must be an object {\"type\": \"text\" | \"json_object\" | "
                            "\"json_schema\", ...}", "invalid_value", "text.format")
    if fmt is None or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        if fmt.get("schema") is None:
            raise APIError(400, "text.format: type json_schema needs its schema", "invalid_value", "text.format")
        return {"type": "json_schema", "json_schema": {k: fmt.get(k) for k in ("name", "schema", "strict")}}
    return {"type": fmt.get("type")}


def response_object(rid: str, created: int, model: str, body: ResponsesRequest, s: Sub | None, text: str,
                    status: str, usage: dict | None) -> dict:
    """The ``response`` object (``s``: the choice, None before it has output; ``status``:
    ``in_progress``, ``completed`` or ``incomplete``)."""
    item = {"type": "message", "id": f"msg_{rid}", "status": "completed" if status != "in_progress" else status,
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "output": [] if s is None else [item], "parallel_tool_calls": True,
            "previous_response_id": None, "store": False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt}, "tool_choice": "auto", "tools": [], "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled", "user": body.user, "usage": usage}


def response_usage(srv: Generation, subs: list[Sub]) -> dict:
    """The Responses API's ``usage`` (input/output tokens) of the chat ``usage``."""
    u = srv.usage(subs, 1)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _status(s: Sub) -> str:
    return "incomplete" if s.final.finish_reason == "length" else "completed"


async def _events(srv: Generation, q, subs: list[Sub], rid: str, created: int, model: str,
                  body: ResponsesRequest) -> AsyncIterator[str]:
    """The Responses API's SSE events of one streamed response (``event:`` and ``data:`` lines,
    a ``sequence_number`` on each; no ``[DONE]``)."""
    seq = iter(range(1 << 62))
    item_id, s = f"msg_{rid}", subs[0]

    def ev(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    head = response_object(rid, created, model, body, None, "", "in_progress", None)
    yield (ev("response.created", response=head) + ev("response.in_progress", response=head)
           + ev("response.output_item.added", output_index=0, item={"type": "message", "id": item_id,
                                                                     "status": "in_progress", "role": "assistant",
                                                                     "content": []})
           + ev("response.content_part.added", part={"type": "output_text", "text": "", "annotations": []}, **where))
    text = []
    try:
        async for batch in _batches(q, subs):
            deltas = [out.delta_text for _, out in batch if out.delta_text]
            text += deltas
            if deltas:
                yield "".join(ev("response.output_text.delta", delta=d, logprobs=[], **where) for d in deltas)
    except Exception as e:  # noqa: BLE001
        yield _error_event(e)
        return
    full = "".join(text)
    final = response_object(rid, created, model, body, s, full, _status(s), response_usage(srv, subs))
    part = {"type": "output_text", "text": full, "annotations": []}
    yield (ev("response.output_text.done", text=full, logprobs=[], **where)
           + ev("response.content_part.done", part=part, **where)
           + ev("response.output_item.done", output_index=0, item=final["output"][0])
           + ev("response.completed", response=final))  # also when incomplete: the client's stream helper waits for it


def add_route(router: APIRouter, srv: Generation) -> None:
    """``POST /v1/responses`` (SLO headers as on the chat route)."""

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request, h: SLOHeaders = Depends()):
        chat = body.as_chat()
        arrival, model, slo, stop, asked = srv.validate(chat, h.x_slo_class, h.x_slo_ttft_ms, h.x_slo_tbt_ms,
                                                        request)
        with body.named_fields():
            structured = await srv.structured_output(chat)
            ids = await srv.encode(chat_messages(chat.messages), "messages", None, **chat.template_switches())
            mt = srv.max_tokens_for(chat.max_completion_tokens, len(ids), None, "max_completion_tokens")
            sp = srv.sampling_params(chat, mt, stop, structured)
        subs = [Sub(0, ids, None, sp)]
        q, headers, rid, created = await srv.launch(subs, slo, arrival, "resp_", asked,
                                                   request.headers.get("x-request-id"))
        if body.stream:
            return EventStream(_events(srv, q, subs, rid, created, model, body), lambda: srv.abort(subs), headers)
        if not await srv.run_blocking(request, subs, q):
            return Response(status_code=499)
        srv.check_finished(subs)
        s = subs[0]
        return JSONResponse(response_object(rid, created, model, body, s, s.final.text, _status(s),
                                            response_usage(srv, subs)), headers=headers)
