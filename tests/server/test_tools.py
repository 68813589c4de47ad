"""Tool calling (issue 30 item 4) through the official ``openai`` client.

The parser on fixed strings: streamed at every split position it gives exactly the calls and
content of the whole text. Tiny random-weight Llamas, so output is random: ``tool_choice``
``required`` and a named function must still always give calls whose arguments validate
against the function's schema (many random schemas, greedy and sampled, streamed or not),
enforced by the grammar. Two chat templates: the embedded SmolLM2's (no tools: the fallback
prompt format) and a Qwen2.5-style template that renders tools itself.
"""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.frontend.tool_prompt import FALLBACK_SYSTEM, fallback_messages, template_knows_tools
from laser.server.app import build_app
from laser.server.cli import LiveServer
from laser.server.tool_parser import ToolCallParser, parse_tool_calls
from simutil import random_schema

# A chat template in the style of Qwen2.5's (tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> user turns), written for this test.
QWEN_STYLE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

Function signatures within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

Return each function call as a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content or '' }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- the parser on fixed strings -----------------------------------------------------------------------

TEXTS = [
    "Hello world  \n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", "n": [1, {"x": "}</tool_call>"}]}}\n'
    "</tool_call>",
    'Let me check.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name":"g",'
    '"arguments":{"a":"b"}}\n</tool_call>\nDone.',
    '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',  # arguments first: parsed whole
    "x <tool_call>not json</tool_call> y",  # not a call: text
    '<tool_call>\n{"name": "f", "arguments": {"a": "tru',  # cut short (max_tokens)
    "a < b <tool_ca",
    '<tool_call>\n{"name": "f", "arguments": 5}\n</tool_call> <tool_call>\n{"name": "f", "arguments": "s"}',
]


def streamed(text: str, cuts: list[int], parallel: bool = True):
    """(content, [(name, arguments)]) from feeding ``text`` cut at ``cuts``, deltas accumulated as
    the openai client does (by index; a header delta carries id, type and name)."""
    p = ToolCallParser(parallel)
    content, calls = "", {}
    bounds = [0, *cuts, len(text)]
    outs = [p.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [p.finish()]
    for c, deltas in outs:
        content += c
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"].get("arguments", "")
    return ((content or None) if calls else content), [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("text", TEXTS, ids=[str(i) for i in range(len(TEXTS))])
def test_streamed_parse_equals_whole_parse_at_every_split(text):
    content, calls = parse_tool_calls(text)
    whole = (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert streamed(text, []) == whole
    assert streamed(text, list(range(1, len(text)))) == whole  # one character at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert streamed(text, [i, j]) == whole, (i, j)


_json = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | st.text("ab\"\\<>{}[], ", max_size=5),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text("xy<>\"", max_size=3), c, max_size=3),
                     max_leaves=6)
_block = st.builds(lambda name, args, sep, pre: (name, json.dumps(args, separators=sep), pre),
                   st.from_regex(r"[a-z_]{1,6}", fullmatch=True), st.dictionaries(st.text("kv", max_size=2), _json,
                                                                                   max_size=3),
                   st.sampled_from([(", ", ": "), (",", ":")]), st.sampled_from(["\n", "", " \n"]))
_text = st.text("ab <>/{}\"\n_lot", max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(_text, _block), max_size=5), st.lists(st.integers(0, 400), max_size=6))
def test_random_texts_stream_as_they_parse(parts, cuts):
    """Random mixes of text (tag fragments, brackets, quotes) and call blocks: streamed at random
    cuts equals the whole parse; when the text holds no '<', each block is a call, as written."""
    text, want = "", []
    for p in parts:
        if isinstance(p, tuple):
            name, args, pre = p
            text += f'<tool_call>{pre}{{"name": "{name}", "arguments": {args}}}{pre}</tool_call>'
            want.append((name, args))
        else:
            text += p
    content, calls = parse_tool_calls(text)
    whole = (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert streamed(text, sorted(c for c in cuts if c <= len(text))) == whole
    if not any("<" in p for p in parts if isinstance(p, str)):
        assert whole[1] == want


def test_parser_results_on_fixed_strings():
    def calls(text, parallel=True):
        c, cs = parse_tool_calls(text, parallel)
        return c, [(x["function"]["name"], x["function"]["arguments"]) for x in cs]

    assert calls(TEXTS[0]) == ("Hello world  \n", [])  # no call: the text as written
    assert calls(TEXTS[1]) == (None, [("get_weather", '{"city": "Pa\\"ris", "n": [1, {"x": "}</tool_call>"}]}')])
    assert calls(TEXTS[2]) == ("Let me check.\nDone.", [("f", "{}"), ("g", '{"a":"b"}')])
    assert calls(TEXTS[2], parallel=False) == ("Let me check.\nDone.", [("f", "{}")])
    assert calls(TEXTS[3]) == (None, [("f", '{"a": 1}')])
    assert calls(TEXTS[4]) == (TEXTS[4], [])
    assert calls(TEXTS[5]) == (None, [("f", '{"a": "tru')])
    assert calls(TEXTS[6]) == (TEXTS[6], [])
    for text in TEXTS[1:4]:
        for _, args in calls(text)[1]:
            json.loads(args)


def test_calls_only_never_sends_content_even_when_a_block_is_cut():
    """tool_choice required / named (the grammar writes only call blocks): a block cut by the
    length limit is dropped, not sent as content, whole or streamed at every split (a fresh-user
    try got ``content: "<tool_call>"`` at max_tokens 5 and after two complete calls at 80)."""
    from laser.server.tool_parser import ToolCallParser

    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    for text, want in [("<tool_call>", []), ("<tool_", []), (call + call + "<tool_call>\n{\"na", [("f", '{"a": 1}')] * 2),
                       (call, [("f", '{"a": 1}')])]:
        content, cs = parse_tool_calls(text, True, calls_only=True)
        assert content is None and [(x["function"]["name"], x["function"]["arguments"]) for x in cs] == want
        for cut in range(len(text) + 1):
            p = ToolCallParser(True, calls_only=True)
            sent = p.feed(text[:cut])[0] + p.feed(text[cut:])[0] + p.finish()[0]
            assert sent == "" and len(p.calls) == len(want), (text, cut)
    assert parse_tool_calls("<tool_call>")[0] == "<tool_call>"  # auto: the text as written


def test_template_detection_and_fallback_prompt(smollm2_dir):
    from transformers import AutoTokenizer

    assert template_knows_tools(QWEN_STYLE)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert not template_knows_tools(tok.chat_template)  # the embedded model's template has no tools
    conv = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}}]},
            {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
    out = fallback_messages(conv, [CLOCK])
    assert out[0] == {"role": "system", "content": FALLBACK_SYSTEM.format(tools=json.dumps(CLOCK))}
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    sys_first = fallback_messages([{"role": "system", "content": "Be brief."}, *conv[:1]], [CLOCK])
    assert sys_first[0]["content"].startswith("Be brief.\n\n# Tools") and len(sys_first) == 2


# -- through the server --------------------------------------------------------------------------------


def _serve(model_dir):
    engine = Engine(str(model_dir), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=512),
                    max_model_len=1024, scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=256))
    return LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))


@pytest.fixture(scope="module", params=["fallback", "qwen_style"])
def served(request, tiny_llama, smollm2_dir, tmp_path_factory):
    """(server, client, tokenizer, kind) of a tiny Llama with SmolLM2's template (no tools: the
    fallback prompt), or a tiny Qwen2 whose tokenizer has a Qwen2.5-style template and, as Qwen's,
    ``<tool_call>`` / ``</tool_call>`` as added (non-special) tokens."""
    from conftest import make_tiny_model
    from transformers import AutoTokenizer

    d = tiny_llama
    if request.param == "qwen_style":
        tok_dir, d = tmp_path_factory.mktemp("qwen-style-tok"), tmp_path_factory.mktemp("qwen-style")
        tok = AutoTokenizer.from_pretrained(smollm2_dir)
        tok.add_tokens(["<tool_call>", "</tool_call>"])
        tok.chat_template = QWEN_STYLE
        tok.save_pretrained(tok_dir)
        make_tiny_model("qwen2", d, tok_dir)
    srv = _serve(d)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield srv, client, AutoTokenizer.from_pretrained(d), request.param
    srv.stop()


def _tools(rng) -> list[dict]:
    return [{"type": "function", "function": {"name": f"fn_{i}", "description": f"tool {i}",
                                              "parameters": random_schema(rng)}} for i in range(rng.randint(1, 3))]


def _collect(stream) -> tuple[str | None, list[tuple[str, str]], str, int]:
    """(content, [(name, arguments)], finish reason, completion tokens) of a streamed choice."""
    content, calls, reason, usage = "", {}, None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.type == "function" and d.function.name and d.index not in calls
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            reason = c.finish_reason or reason
    return (content or None) if calls else content, [tuple(calls[i]) for i in sorted(calls)], reason, usage


def _check_calls(calls, tools, reason, exactly_one: bool):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert reason == "tool_calls" and calls, (reason, calls)
    assert len(calls) == 1 or not exactly_one
    for name, args in calls:
        jsonschema.validate(json.loads(args), schemas[name])


@pytest.mark.parametrize("seed", range(5))
def test_required_and_named_always_yield_valid_calls(served, seed):
    """Random schemas, sampled and greedy: the grammar forces calls that parse and validate,
    streamed and not, and the streamed calls equal the non-streamed ones for a fixed seed."""
    _, client, _, _ = served
    rng = random.Random(seed)
    tools = _tools(rng)
    named = {"type": "function", "function": {"name": rng.choice(tools)["function"]["name"]}}
    for choice, parallel in [("required", False), (named, True), ("required", True)]:
        kw = dict(model="tiny", messages=MSGS, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                  max_tokens=400, temperature=[0, 1.0][seed % 2], seed=seed)
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        if choice == "required" and parallel and ch.finish_reason == "length":
            calls = calls[:-1]  # many calls: the last one may be cut short
        else:
            _check_calls(calls, tools, ch.finish_reason, exactly_one=not parallel or choice is named)
            assert ch.message.content is None and all(c.id.startswith("call_") for c in ch.message.tool_calls)
        if choice is named:
            assert [n for n, _ in calls] == [named["function"]["name"]]
        content, s_calls, reason, usage = _collect(client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}))
        assert (s_calls, reason, usage) == ([(c.function.name, c.function.arguments)
                                             for c in ch.message.tool_calls or []], ch.finish_reason,
                                            r.usage.completion_tokens)


@pytest.mark.parametrize("seed", range(3))
def test_a_function_without_parameters_gets_empty_arguments(served, seed):
    """A tool defined without ``parameters`` takes no arguments (OpenAI's reading): a required
    call's arguments are exactly ``{}``, sampled or greedy (a bare object schema let the grammar
    write any keys: a fresh-user try got nested junk until the length limit)."""
    _, client, _, _ = served
    tools = [{"type": "function", "function": {"name": "ping"}}]
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=[0, 1.0][seed % 2],
                                       seed=seed)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [("ping", {})]


def _generated_tokens(srv) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return sum(x.value for f in text_string_to_metric_families(text) if f.name == "laser:generation_tokens"
               for x in f.samples if x.name.endswith("_total"))


def test_auto_parses_what_the_model_wrote(served):
    """tool_choice auto with a grammar forcing a text and a call (random weights would write neither):
    the text is content, the block a call, finish_reason tool_calls, streamed the same; usage
    counts every generated token. Without the regex: text only, as written."""
    _, client, tok, kind = served

    def tag(t: str) -> str:  # Qwen's tags are tokens of their own: named as tokens in the grammar
        return f"<[{tok.convert_tokens_to_ids(t)}]>" if kind == "qwen_style" else json.dumps(t)

    sure, head, tail = (json.dumps(x) for x in ("Sure.\n", '\n{"name": "get_weather", "arguments": {"city": "',
                                                 '", "unit": "C"}}\n'))
    grammar = f"start: {sure} {tag('<tool_call>')} {head} /[a-z]{{1,6}}/ {tail} {tag('</tool_call>')}"
    kw = dict(model="tiny", messages=MSGS, tools=[WEATHER, CLOCK], max_tokens=80, temperature=1.0, seed=3,
              extra_body={"guided_grammar": grammar, "return_token_ids": True})
    before = _generated_tokens(served[0])
    r = client.chat.completions.create(**kw)
    assert _generated_tokens(served[0]) - before == r.usage.completion_tokens  # /metrics exact
    ch = r.choices[0]
    assert ch.message.content == "Sure." and ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "C"
    ids = ch.model_extra["token_ids"]
    assert r.usage.completion_tokens == len(ids)
    if kind == "qwen_style":
        assert tok.convert_tokens_to_ids("<tool_call>") in ids
    assert parse_tool_calls(tok.decode(ids, skip_special_tokens=True))[1][0]["function"]["arguments"] == \
        call.function.arguments
    assert _collect(client.chat.completions.create(**kw, stream=True))[:3] == (
        "Sure.", [("get_weather", call.function.arguments)], "tool_calls")
    plain = client.chat.completions.create(model="tiny", messages=MSGS, tools=[WEATHER], max_tokens=12,
                                           temperature=0)
    text = tok.decode(plain.choices[0].model_extra.get("token_ids") or [], skip_special_tokens=True)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    assert text == "" or plain.choices[0].message.content == text


def _prompt_ids(client, **kw) -> list[int]:
    r = client.chat.completions.create(model="tiny", max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True}, **kw)
    return r.choices[0].model_extra["prompt_token_ids"]


def test_prompt_rendering(served):
    """The template's own tool rendering when it has one, else the fallback prompt; tool turns;
    tool_choice none and no tools: the prompt of a request without tools (as before tools)."""
    _, client, tok, kind = served
    conv = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    tmpl_conv = [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "C"}}}]},
                 {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    got = _prompt_ids(client, messages=conv, tools=[WEATHER])
    if kind == "qwen_style":
        want = tok.apply_chat_template(tmpl_conv, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    else:
        want = tok.apply_chat_template(fallback_messages(tmpl_conv, [WEATHER]), add_generation_prompt=True,
                                       tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert got == want
    r = httpx.post(served[0].url + "/tokenize", json={"messages": conv, "tools": [WEATHER]}, timeout=60)
    assert r.json()["tokens"] == got  # vLLM's /tokenize takes tools too
    text = tok.decode(got)
    if kind == "qwen_style":  # Qwen's tokenizer has the tags as tokens of their own
        assert tok.convert_tokens_to_ids("<tool_call>") in got
    assert '"name": "get_weather"' in text and "<tool_response>\n21 C\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    base = _prompt_ids(client, messages=MSGS)
    plain = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    assert base == list(plain["input_ids"] if hasattr(plain, "keys") else plain)
    assert _prompt_ids(client, messages=MSGS, tools=[WEATHER], tool_choice="none") == base


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "auto"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"{p}{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tool_input_is_400_naming_the_field(served, extra, param):
    srv = served[0]
    body = {"messages": MSGS, "max_tokens": 4, **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # everyone else is still served


def test_a_cluster_parses_auto_and_enforces_grammar_tool_choices(tiny_llama):
    """A cluster front end (one in-process mixed instance): tool_choice required / named is
    enforced by the instance's sampler with the grammar the front end spelled (a call of the
    named function that validates); auto needs no grammar and is served (the prompt rendered and
    the output parsed in the front end)."""
    from laser.cluster.engine import ClusterEngine
    from laser.cluster.handles import LocalHandle
    from laser.controller import get_controller
    from laser.core.slo import SLOClasses
    from laser.instance.worker import InstanceWorker
    from laser.model.loader import load_config, load_tokenizer

    kw = dict(model=str(tiny_llama), policy="sarathi", dtype="float32",
              scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=64))
    cl = ClusterEngine([LocalHandle(InstanceWorker(0, "mixed", kw))], get_controller("colocated")(),
                       load_tokenizer(str(tiny_llama)), load_config(str(tiny_llama)), "tiny", SLOClasses.load())
    srv = LiveServer(build_app(AsyncEngine(cl), served_model_names=["tiny"]))
    try:
        url = srv.url + "/v1/chat/completions"
        for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
            r = httpx.post(url, json={"messages": MSGS, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 200},
                           timeout=120)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            calls = [(c.function.name, c.function.arguments) for c in
                     openai.types.chat.ChatCompletion.model_validate(r.json()).choices[0].message.tool_calls or []]
            _check_calls(calls, [WEATHER], ch["finish_reason"], exactly_one=True)
        r = httpx.post(url, json={"messages": MSGS, "tools": [WEATHER], "max_tokens": 8, "temperature": 0,
                                  "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] in ("stop", "length") and "tool_calls" not in ch["message"]
        assert r.json()["usage"]["completion_tokens"] == len(ch["token_ids"])
    finally:
        srv.stop()
