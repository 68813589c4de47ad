"""OpenAI-style error bodies (``{"error": {"message", "type", "param", "code"}}``) and the
readable message made of a pydantic validation error. Shared by every route module."""

from __future__ import annotations

import collections
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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


def unavailable(exc: BaseException) -> APIError:
    """The 503 answer of an :class:`~laser.frontend.admission.EngineUnavailableError` (a cluster
    that lost a role it needs): its message, code ``unavailable``, ``Retry-After`` in whole
    seconds (vLLM and OpenAI answer an overloaded or unavailable engine the same way)."""
    import math

    retry = max(1, math.ceil(getattr(exc, "retry_after_s", 1.0)))
    return APIError(503, str(exc), "unavailable", headers={"retry-after": str(retry)})


def param_of(message: str) -> str | None:
    """The request field a front-end error message names (``"dynamic_depth: ..."`` ->
    ``"dynamic_depth"``), or None when it does not start with a field name."""
    head, sep, _ = message.partition(":")
    return head if sep and re.fullmatch(r"[a-z][a-z0-9_]*", head) else None


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERRORS.get(status, "error"), "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


# What a union-typed field accepts, for messages (pydantic reports one error per member).
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
    "stop": "a string or a list of strings",
    "input": "a string or a list of input items (objects)",  # /v1/responses
    # the Responses API's flat {"type": "function", "name": ...} is not the chat form
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}
_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")


def _where(loc: list) -> str:
    """A field's location as OpenAI writes it (``messages[0].role``), without the union-member
    tags pydantic adds (``str``, ``list[int]``, ``function-after[...]``)."""
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif not (x in ("str", "int", "float", "bool") or "[" in x):
            out += f".{x}" if out else x
    return out or "body"


def _body_loc(e: dict) -> list:
    """A pydantic error's location within the request: without where a parameter came from (query, path,
    header, cookie) and without ``body``."""
    loc = list(e.get("loc", ()))
    if loc[:1] and loc[0] in ("query", "path", "header", "cookie"):
        loc = loc[1:]
    return [x for x in loc if x != "body"]


def format_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message (and the offending field) from pydantic errors."""
    parts, param, seen = [], None, set()
    errors = [(_body_loc(e), e) for e in exc.errors()]
    per_field = collections.Counter(str(loc[0]) if loc else "body" for loc, _ in errors)  # a union: one per member
    for loc, e in errors:
        kind = e.get("type", "")
        if kind == "json_invalid":
            err = (e.get("ctx") or {}).get("error", e.get("msg", "invalid JSON"))
            return f"malformed JSON body: {err}", None
        if not loc and kind in _NOT_AN_OBJECT:
            return "the request body must be a JSON object (Content-Type: application/json)", None
        if not loc and kind == "missing":
            return "the request body is empty; expected a JSON object", None
        field = str(loc[0]) if loc else "body"
        if field in seen:  # a union reports once per member: keep the first
            continue
        seen.add(field)
        param = param or (field if loc else None)
        if field in _EXPECTED and kind != "missing" and per_field[field] > 1:  # (not /tokenize's plain str)
            parts.append(f"{field}: must be {_EXPECTED[field]}")
        else:
            where = _where(loc)
            msg = "field required" if kind == "missing" else e.get("msg", "invalid value")
            parts.append(f"{where}: {msg}")
        if len(parts) == 3:
            break
    return "; ".join(parts) or "invalid request", param

