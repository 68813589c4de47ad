"""Server-sent events (SSE) of both generation endpoints: one write per batch of ready outputs,
the chunks of each choice (text or delta, logprobs, token ids, usage), errors and ``[DONE]``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from ..frontend.async_engine import EngineStepError, EngineUnavailableError, StreamError
from .errors import error_body
from .generation import Sub
from .tools import finish_reason

log = logging.getLogger(__name__)


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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


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


def new_logprobs(s: Sub, out) -> tuple[list[int], list]:
    """(token ids, TokenLogprobs) of ``s``'s output tokens whose logprobs were not streamed yet."""
    if out.logprobs is None:
        return [], []
    n = len(out.logprobs)
    ids, lps = list(out.token_ids[s.sent_lps:n]), out.logprobs[s.sent_lps:n]
    s.sent_lps = n
    return ids, lps


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
            item = s.view(item)
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
            return [chunk(s, out, d, out.finish_reason if out.finished else None,
                          srv.final_note(note, out) if out.finished else None,
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
        delta = {"content": d}
        reason = out.finish_reason if out.finished else None
        if s.tool_parser is not None:  # tools: text and tool_calls deltas (laser.server.tool_parser)
            delta = tool_delta(s.tool_parser, d, out.finished)
            reason = finish_reason(reason, s.tool_parser.calls)
        new = delta.get("content") or "tool_calls" in delta or ids or lps
        buf = [chunk(s, out, delta, None, None, ids, lps)] if new else []
        if out.finished:
            buf.append(chunk(s, out, {}, reason, srv.final_note(note, out)))
        return buf

    prologue = "".join(chunk(s, None, {"role": "assistant", "content": ""}, None) for s in subs)
    return _event_stream(srv, q, subs, base, body.n, _include_usage(body), prologue, events)


def tool_delta(parser, text: str, finished: bool) -> dict:
    """A chat chunk's ``delta`` with tools: ``content`` (the text outside calls; left out when
    empty beside calls) and ``tool_calls`` when a call began or its arguments grew; ``finished``
    ends the parser."""
    content, calls = parser.feed(text)
    if finished:
        more, rest = parser.finish()
        content, calls = content + more, calls + rest
    if calls:  # OpenAI's shape: content only where there is some
        return {"content": content, "tool_calls": calls} if content else {"tool_calls": calls}
    return {"content": content}


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
