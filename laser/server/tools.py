"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` checked and turned into a :class:`ToolPlan`, the conversation's tool
turns made into the chat template's input, and the answer's ``tool_calls`` (docs/server.md).

* ``tool_choice: none`` ignores the tools (the prompt and the output are those of a request
  without them); ``auto`` (the default with tools) renders them and parses what the model
  wrote (text and calls, :mod:`laser.server.tool_parser`); ``required`` and a named function
  are enforced by a grammar (:func:`laser.model.structured.tool_call_grammar`) applied as the
  structured-output logits mask, so the output is always one call (a named function, or
  ``parallel_tool_calls: false``) or one or more calls whose arguments match the schema.
* A bad field is a 400 naming it: ``tool_choice`` without tools or naming an unknown function,
  ``tools`` with a duplicate name or a parameters schema that is not an object schema or does
  not compile, a ``tool`` message without ``tool_call_id``, ``tool_calls`` on another role or
  with arguments that are not JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json

from ..frontend.inputs import UnsupportedContentPart, check_text, join_text_parts
from ..frontend.tool_prompt import CALL_CLOSE, CALL_OPEN
from ..core.request import InvalidRequestError
from ..model.structured import tool_call_grammar
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, ToolDefinition
from .tool_parser import ToolCallParser, parse_tool_calls

#: The parameters of a function defined without any: no arguments (``{}``, OpenAI's reading of a
#: missing ``parameters``; a bare object schema would let the grammar produce any keys).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools.

    Attributes:
        tools: OpenAI tool definitions rendered into the prompt.
        choice: ``auto``, ``required`` or ``named``.
        functions: (name, parameters schema) of the functions a call may name (``named``: one).
        parallel: more than one call may be reported (and, with ``required``, generated).
    """

    tools: list[dict]
    choice: str
    functions: list[tuple[str, dict]]
    parallel: bool

    @property
    def calls_only(self) -> bool:
        """The grammar allows only call blocks (``required`` / ``named``): no content is sent."""
        return self.choice != "auto"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.parallel, self.calls_only)


def _bad(field: str, msg: str) -> APIError:
    return APIError(400, f"{field}: {msg}", "invalid_value", field.split(".")[0].split("[")[0])


def _check_parameters(i: int, params: dict) -> str | None:
    """The grammar library's error for function ``i``'s parameters schema, else None."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(params), None) or None
    except (ValueError, TypeError) as e:
        return str(e)


async def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's :class:`ToolPlan`; None without tools or with ``tool_choice: none``.

    Raises:
        APIError: 400 naming ``tool_choice`` (without tools, an unknown function) or ``tools``
        (a duplicate name, a parameters schema that is not an object schema or does not compile).
    """
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools (the request has none)")
        return None
    if choice == "none":
        return None
    functions: dict[str, dict] = {}
    for i, t in enumerate(body.tools):
        f = t.function
        if f.name in functions:
            raise _bad(f"tools[{i}].function.name", f"function {f.name!r} is defined twice")
        params = NO_PARAMETERS if f.parameters is None else f.parameters
        if params.get("type", "object") != "object":
            raise _bad(f"tools[{i}].function.parameters", f"must be a JSON schema of an object, got type "
                                                          f"{params.get('type')!r}")
        err = await asyncio.get_running_loop().run_in_executor(None, _check_parameters, i, params)
        if err is not None:
            raise _bad(f"tools[{i}].function.parameters", f"not a usable JSON schema: {err}")
        functions[f.name] = params
    tools = tool_definitions(body.tools)
    try:
        check_text(json.dumps(tools, ensure_ascii=False), "tools")
    except InvalidRequestError as e:
        raise _bad("tools", str(e)) from None
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise _bad("tool_choice", f"function {name!r} is not among the tools ({', '.join(functions)})")
        return ToolPlan(tools, "named", [(name, functions[name])], False)
    return ToolPlan(tools, "required" if choice == "required" else "auto", list(functions.items()), parallel)


def tool_definitions(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The chat template's ``tools`` (OpenAI's dicts, unset fields left out); None for none."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


async def tool_constraint(srv, plan: ToolPlan | None, structured: tuple[str, str] | None) -> tuple[str, str] | None:
    """The structured-output constraint of a chat request: its tool grammar (``required`` / a
    named function, compiled by ``srv``'s grammar backend) or else ``structured`` (the
    request's response_format / guided decoding, or None).

    Raises:
        APIError: 400 naming ``tool_choice``: both a tool grammar and another constraint.
    """
    if plan is None or plan.choice == "auto":
        return structured
    if structured is not None:
        raise _bad("tool_choice", "required or a named function (a grammar) cannot be combined with "
                                  "response_format or guided decoding")
    literal = srv.ae.engine.grammars.lark_literal
    text = await asyncio.get_running_loop().run_in_executor(  # the first one builds llguidance's tokenizer
        None, functools.partial(tool_call_grammar, plan.functions, plan.parallel, CALL_OPEN, CALL_CLOSE, literal))
    grammar = ("lark", text)
    await srv.check_grammar("tool_choice", grammar)
    return grammar


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The chat template's input of a request's ``messages``: text parts joined by newlines;
    an assistant's ``tool_calls`` with their arguments parsed (templates write them with
    ``tojson``); a ``tool`` message's ``tool_call_id``.

    Raises APIError: 400 naming ``messages``: an empty or non-text content part list, a ``tool`` message
    without ``tool_call_id``, ``tool_calls`` not on an assistant message, arguments not JSON.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            try:
                content = join_text_parts(i, [(part.type, part.text) for part in content])
            except UnsupportedContentPart as e:
                raise APIError(400, str(e), "unsupported_parameter", "messages") from None
            except InvalidRequestError as e:
                raise APIError(400, str(e), "invalid_value", "messages") from None
        msg = {"role": m.role, "content": content}  # None: checked by the renderer (inputs.check_message)
        if m.name:
            msg["name"] = m.name
        if m.role == "tool":
            if not m.tool_call_id:
                raise _bad(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", f"only assistant messages make tool calls, not {m.role}")
            msg["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        out.append(msg)
    return out


def _template_call(i: int, j: int, call) -> dict:
    where = f"messages[{i}].tool_calls[{j}].function.arguments"
    try:
        check_text(call.function.arguments, where)
        args = json.loads(call.function.arguments)
    except InvalidRequestError as e:
        raise _bad(where, str(e)) from None
    except ValueError as e:
        raise _bad(where, f"not JSON ({e})") from None
    out = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    return {"id": call.id, **out} if call.id else out


def finish_reason(reason: str | None, calls: list) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason


def answer_message(plan: ToolPlan, text: str, reason: str | None) -> dict:
    """The ``message`` and ``finish_reason`` of a whole chat choice with tools."""
    content, calls = parse_tool_calls(text, plan.parallel, plan.calls_only)
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return {"message": msg, "finish_reason": finish_reason(reason, calls)}
