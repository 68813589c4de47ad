"""OpenAI's legacy scoring request on ``/v1/completions``: ``echo: true`` with ``max_tokens: 0``
returns the prompt and, with ``logprobs``, its log-probabilities, and generates nothing (the old
OpenAI API's loglikelihood idiom; vLLM's ``echo_without_generation``). On main it was a 400
(``max_tokens`` >= 1). ``max_tokens: 0`` without ``echo`` stays a 400. Also: a Responses-style
``tool_choice`` on chat gets a 400 that names the chat form."""

from __future__ import annotations

import json

import httpx
import pytest

from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.engine import Engine
from serverutil import openai_client, serving

PROMPT = [(7 * i + 3) % 500 + 100 for i in range(40)]  # 40 token ids: more than two KV blocks


@pytest.fixture(scope="module")
def live(tiny_llama):
    # prefill chunks of 16 tokens: the prompts' logprobs are collected over several steps
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=128),
                    max_model_len=256, scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=16))
    yield from serving(engine)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(live):
    client = openai_client(live)
    kw = dict(model="tiny", prompt=[PROMPT, PROMPT[:23]], temperature=0, echo=True, logprobs=1)
    one = client.completions.create(max_tokens=1, **kw)  # lm-eval's form: the prompt, then one token
    zero = client.completions.create(max_tokens=0, **kw)
    tok = live.app.state.async_engine.engine.tokenizer
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == len(PROMPT) + 23
    for p, a, b in zip([PROMPT, PROMPT[:23]], one.choices, zero.choices):
        assert b.text == tok.decode(p) and b.finish_reason == "length"
        assert b.logprobs.tokens == a.logprobs.tokens[:-1] and len(b.logprobs.tokens) == len(p)
        assert b.logprobs.token_logprobs[0] is None and None not in b.logprobs.token_logprobs[1:]
        # fp32, in prefill chunks batched differently: equal to rounding
        assert b.logprobs.token_logprobs[1:] == pytest.approx(a.logprobs.token_logprobs[1:-1], abs=1e-4)
    # streamed: the same text and logprobs, then the usage chunk
    text, lps, usage = "", [], None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, max_tokens=0,
                                        **{**kw, "prompt": PROMPT}):
        for c in ch.choices:
            text += c.text
            lps += c.logprobs.token_logprobs if c.logprobs else []
        usage = ch.usage or usage
    assert text == zero.choices[0].text and lps[0] is None
    assert lps[1:] == pytest.approx(zero.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
    assert usage.completion_tokens == 0
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=0, echo=True,
                                      extra_body={"return_token_ids": True})
    assert plain.choices[0].text == "Hello there" and plain.choices[0].model_extra["token_ids"] == []


def test_max_tokens_0_without_echo_is_still_a_400(live):
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 0}, timeout=60)
    err = json.loads(r.text)["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and "greater than or equal to 1" in err["message"]
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": -1, "echo": True}, timeout=60)
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "max_tokens"
    ok = httpx.post(live.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and the server still serves


def test_a_responses_style_tool_choice_names_the_chat_form(live):
    """``{"type": "function", "name": ...}`` (the Responses API's flat form) on chat: the 400 says
    which form chat takes (main: "Input should be 'none', 'auto' or 'required'" only)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools, "max_tokens": 2,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    err = json.loads(r.text)["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice"
    assert "{'type': 'function', 'function': {'name': ...}}" in err["message"]
    body["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    assert httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
