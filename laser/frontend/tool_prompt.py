"""Tools in the prompt: how a conversation with tool definitions, assistant tool calls and tool
results is rendered for a model's chat template.

One output format is served: the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (the Hermes function-calling format, which the Qwen2 / Qwen2.5 / Qwen3 chat templates
teach their models). A chat template that knows tools *in that format* (it reads the ``tools``
variable and writes ``<tool_call>``) renders the tools, the calls and the results itself
(transformers' ``apply_chat_template(..., tools=...)``, as vLLM and SGLang do). Any other
template (the embedded SmolLM2's has no tools) gets the documented fallback of
:func:`fallback_messages`: the tools listed in a system message that asks for the same
``<tool_call>`` JSON blocks, earlier calls written as those blocks in the assistant's text and
tool results as ``<tool_response>`` user turns -- so one parser (:mod:`laser.server.tool_parser`)
reads every model's output and one grammar (:func:`laser.model.structured.tool_call_grammar`)
enforces ``tool_choice: required`` / a named function.
"""

from __future__ import annotations

import functools
import json

#: The tags around one call's JSON object (Hermes / Qwen format); a call is written as
#: ``CALL_OPEN + "\n" + json + "\n" + CALL_CLOSE`` and calls are separated by a newline.
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

#: The fallback prompt's tool section ({tools}: one JSON function definition per line).
FALLBACK_SYSTEM = (
    "# Tools\n\n"
    "You may call functions to answer. Each function is described by a JSON object (its name, what it does "
    "and a JSON Schema of its parameters), one per line, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call functions, write one block per call, each holding a JSON object with the function's name and "
    "its arguments:\n"
    f"{CALL_OPEN}\n"
    '{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}\n'
    f"{CALL_CLOSE}\n"
    f"A function's result comes back in a {RESPONSE_OPEN}...{RESPONSE_CLOSE} block."
)


def call_block(name: str, arguments) -> str:
    """One call in the output format (``arguments``: a dict, or a JSON text kept as written)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CALL_CLOSE}'


@functools.lru_cache(maxsize=8)
def template_knows_tools(template: str | None) -> bool:
    """Whether a Jinja chat template renders tools in the served format: it reads the ``tools``
    variable (found with Jinja's own parser, not a substring) and writes ``<tool_call>``."""
    if not template or CALL_OPEN not in template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


def tool_template(chat_template) -> str | None:
    """The template transformers applies to a request with tools: a tokenizer may hold named
    templates (a dict), of which ``tool_use`` is picked for tools, else ``default``."""
    if isinstance(chat_template, dict):
        return chat_template.get("tool_use") or chat_template.get("default")
    return chat_template


def has_tool_turns(messages: list[dict]) -> bool:
    """Whether a conversation holds tool results or assistant tool calls."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation rewritten for a template without tools: the tool section
    (:data:`FALLBACK_SYSTEM`) appended to the first system message (or a new system message
    first), each assistant's ``tool_calls`` appended to its text as ``<tool_call>`` blocks, and
    each tool result a user turn ``<tool_response>\\n...\\n</tool_response>``.

    ``messages``: the template's input (``tool_calls[*].function.arguments`` as dicts);
    ``tools``: OpenAI tool definitions (``{"type": "function", "function": {...}}``) or None.
    """
    out = []
    for m in messages:
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"{RESPONSE_OPEN}\n{m.get('content') or ''}\n{RESPONSE_CLOSE}"})
            continue
        m = {k: v for k, v in m.items() if k != "tool_calls"} | ({"content": _with_calls(m)} if m.get("tool_calls")
                                                                 else {})
        out.append(m)
    if tools:
        section = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{section}" if first else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _with_calls(m: dict) -> str:
    calls = "\n".join(call_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
    text = m.get("content") or ""
    return f"{text}\n{calls}" if text else calls
