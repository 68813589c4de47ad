"""``POST /v1/responses`` (OpenAI's Responses API, text subset) served as a chat completion:
the ``openai`` client's ``responses.create`` and ``responses.stream`` read what it answers, and
greedy output is the chat route's for the same conversation."""

from __future__ import annotations

import httpx
import pytest

from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from serverutil import openai_client, serving


@pytest.fixture(scope="module")
def live(tiny_llama):
    yield from serving(Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                              max_model_len=128))


@pytest.fixture(scope="module")
def client(live):
    return openai_client(live)


def _chat(client, messages, n):
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content


def test_text_input_matches_chat(client):
    r = client.responses.create(model="tiny", input="Tell me a story", instructions="Be brief",
                                max_output_tokens=6, temperature=0)
    want = _chat(client, [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Tell me a story"}], 6)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == want
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_message_items_and_stream(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "Tell me more"}]
    whole = client.responses.create(model="tiny", input=items, max_output_tokens=5, temperature=0)
    with client.responses.stream(model="tiny", input=items, max_output_tokens=5, temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert kinds[-1] == "response.completed" and final.status == whole.status
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": "hi", "max_output_tokens": 1000}, "max_tokens"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({}, "input"),
])
def test_what_is_not_served_is_a_400_naming_it(live, body, param):
    r = httpx.post(live.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
