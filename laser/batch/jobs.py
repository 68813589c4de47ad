"""Parsing a Batch API input file into request rows (OpenAI's JSONL format), torch-free.

Each line is ``{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}``. A line
that is not that gets its own error record (``response: null``, ``error: {code, message}``) and
the rest of the job runs; an upload with no JSON-object line at all is refused.
"""

from __future__ import annotations

import json
import uuid

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


class InputFileError(ValueError):
    """The file is not UTF-8 JSONL with at least one JSON object line."""


def check_jsonl(data: bytes) -> int:
    """Number of non-blank lines of an upload. Raises InputFileError when it is not UTF-8, is
    empty, or has no line that is a JSON object."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"the file is not UTF-8 text (byte {e.start}); expected JSONL") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise InputFileError("the file is empty; expected JSONL, one request per line")
    for ln in lines:
        try:
            if isinstance(json.loads(ln), dict):
                return len(lines)
        except json.JSONDecodeError:
            continue
    raise InputFileError("invalid JSONL: no line of the file is a JSON object")


def error_record(custom_id, code: str, message: str) -> dict:
    """An error-file line for a request that got no HTTP response (OpenAI's shape)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def parse_lines(data: bytes, endpoint: str) -> list[dict]:
    """Rows for :meth:`laser.store.BatchStore.create_batch` (``prompt_tokens``/``max_tokens`` not
    yet set): valid lines ``pending`` with their body, bad ones ``failed`` with an error record.
    Line numbers are 1-based lines of the file; blank lines are skipped."""
    rows, seen = [], set()
    for i, raw in enumerate(data.decode("utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        cid, err, body = None, None, None
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            obj, err = None, f"line {i}: invalid JSON ({e.msg} at column {e.colno})"
        if err is None and not isinstance(obj, dict):
            err = f"line {i}: expected a JSON object with custom_id, method, url and body"
        if err is None:
            cid = obj.get("custom_id")
            body = obj.get("body")
            if not isinstance(cid, str) or not cid:
                err, cid = f"line {i}: custom_id must be a non-empty string", None
            elif cid in seen:
                err = f"line {i}: duplicate custom_id {cid!r} (custom_ids must be unique in a batch)"
            elif str(obj.get("method", "POST")).upper() != "POST":
                err = f"line {i}: method must be POST, got {obj.get('method')!r}"
            elif obj.get("url") != endpoint:
                err = f"line {i}: url {obj.get('url')!r} does not match the batch endpoint {endpoint!r}"
            elif not isinstance(body, dict):
                err = f"line {i}: body must be a JSON object"
            elif body.get("stream"):
                err = f"line {i}: stream is not supported in a batch"
        if isinstance(cid, str) and cid:
            seen.add(cid)
        if err is not None:
            rows.append({"line": i, "custom_id": cid, "body": None, "state": "failed",
                         "record": error_record(cid, "invalid_request", err)})
        else:
            rows.append({"line": i, "custom_id": cid, "body": json.dumps(body), "state": "pending", "record": None})
    return rows


def prompt_of(body: dict, endpoint: str):
    """What :meth:`laser.frontend.async_engine.AsyncEngine.encode` takes for a body (for the work estimate):
    the prompt (first one of a list) or the chat messages with text parts joined; None if absent."""
    if endpoint == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]
        return p if p else None
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return None
    out = []
    for m in msgs:
        if not isinstance(m, dict):
            return None
        c = m.get("content") or ""
        if isinstance(c, list):
            c = "\n".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
        out.append({"role": str(m.get("role", "user")), "content": str(c)})
    return out or None


def max_tokens_of(body: dict, endpoint: str, prompt_tokens: int, max_model_len: int) -> int:
    """The body's output-token budget as the server resolves it (completions: ``max_tokens``,
    default 16, also when null; chat: ``max_completion_tokens`` or ``max_tokens``, default the
    rest of the context), times ``n`` and, for completions, the number of prompts (tokens; each
    prompt priced at ``prompt_tokens``, the first one's length). 0 for a body the endpoint
    rejects before it generates anything -- a field out of range (``max_tokens: 0``, ``n: 0``) or
    ``max_tokens`` past the context (``prompt_tokens`` of ``max_model_len``): such a line costs the
    job no decode time, so it must not make the job's window look infeasible."""
    from pydantic import ValidationError

    from laser.server.protocol import ChatCompletionRequest, CompletionRequest

    try:
        if endpoint == "/v1/completions":
            req = CompletionRequest.model_validate(body)
            mt = 16 if req.max_tokens is None else req.max_tokens
            p = req.prompt
            choices = req.n * (len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1)
        else:
            req = ChatCompletionRequest.model_validate(body)
            mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            choices = req.n
    except ValidationError:
        return 0
    rest = max_model_len - prompt_tokens
    if mt is None:
        mt = rest
    return mt * choices if 1 <= mt <= rest else 0
