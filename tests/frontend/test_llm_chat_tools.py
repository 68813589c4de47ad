"""``LLM.chat(messages, tools=...)`` (vLLM's offline chat with tools): the tools are rendered
into the prompt as the server renders them, a grammar from ``tool_call_grammar`` enforces a
call the server's parser reads, and a bad tool definition is an InvalidRequestError naming it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from laser.core.request import InvalidRequestError, SamplingParams
from laser.frontend.llm import LLM
from laser.frontend.tool_prompt import CALL_CLOSE, CALL_OPEN
from laser.model.structured import tool_call_grammar
from laser.server.tool_parser import parse_tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=1024)


def test_chat_renders_the_tools_into_the_prompt(llm):
    sp = SamplingParams(max_tokens=4, temperature=0)
    inputs = llm.engine.inputs
    with_tools = llm.chat(MSGS, sp, tools=[WEATHER])[0]
    plain = llm.chat(MSGS, sp)[0]
    assert with_tools.prompt_token_ids == inputs.apply_chat_template(MSGS, [WEATHER])
    assert plain.prompt_token_ids == inputs.apply_chat_template(MSGS) != with_tools.prompt_token_ids
    assert "get_weather" in llm.engine.tokenizer.decode(with_tools.prompt_token_ids)
    both = llm.chat([MSGS, MSGS + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and Rome?"}]],
                    sp, tools=[WEATHER])
    assert both[0].token_ids == with_tools.token_ids and len(both) == 2


def test_chat_with_a_tool_grammar_yields_a_call(llm):
    params = WEATHER["function"]["parameters"]
    grammar = tool_call_grammar([("get_weather", params)], False, CALL_OPEN, CALL_CLOSE, llm.engine.grammars.lark_literal)
    out = llm.chat(MSGS, SamplingParams(max_tokens=200, temperature=0, structured_output=("lark", grammar)),
                   tools=[WEATHER])[0]
    content, calls = parse_tool_calls(out.text)
    assert out.finish_reason == "stop" and content is None and len(calls) == 1, out.text
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), params)


@pytest.mark.parametrize("tools,needle", [
    ({"type": "function"}, "tools must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\]"),
    ([{"type": "function", "function": {"name": ""}}], r"tools\[0\].function.name"),
    ([WEATHER, WEATHER], r"tools\[1\].function.name: 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], r"tools\[0\].function.parameters"),
])
def test_bad_tools_are_refused_before_anything_runs(llm, tools, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        llm.chat(MSGS, SamplingParams(max_tokens=2), tools=tools)
    assert not llm.engine.has_unfinished()
