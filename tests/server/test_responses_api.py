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
    ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({}, "input"),
])
def test_what_is_not_served_is_a_400_naming_it(live, body, param):
    r = httpx.post(live.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_the_header_id_is_the_response_id(live, stream):
    """The ``x-request-id`` header said ``resp-...`` while the body said ``resp_...`` (OpenAI's
    form): one id, also the one a client's ``X-Request-Id`` names."""
    body = {"input": "hi", "max_output_tokens": 2, "stream": stream}
    with httpx.stream("POST", live.url + "/v1/responses", json=body, timeout=60) as r:
        text = r.read().decode()
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("resp_"), r.headers
    assert f'"id": "{r.headers["x-request-id"]}"' in text or f'"id":"{r.headers["x-request-id"]}"' in text, text
    r = httpx.post(live.url + "/v1/responses", json={**body, "stream": False}, headers={"x-request-id": "t-1"},
                   timeout=60)
    assert r.json()["id"] == r.headers["x-request-id"] == "resp_t-1", r.text


@pytest.mark.parametrize("body,param,message", [
    ({"input": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]}, "input",
     "input[1].role: Input should be 'system'"),
    ({"instructions": "Be brief", "input": [{"role": "user", "content": "hi"}, {"role": "user"}]}, "input",
     "input[1].content: a user message needs content"),
    ({"input": []}, "input", "input: an empty list of input items"),
    ({"input": ["hi"]}, "input", "input: must be a string or a list of input items"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format", "text.format: must be an object"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format", "text.format.type: Input should be"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format",
     "text.format: type json_schema needs its schema"),
    ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens", "this model's context is 128 tokens"),
])
def test_errors_name_the_responses_fields(live, body, param, message):
    """Errors of the chat completion a response is served as named chat fields (``messages.1.role``,
    ``response_format``, ``max_tokens``) that the request does not have; ``text.format: "json"``
    was served as plain text and an empty ``input`` list said ``messages: List should have...``."""
    r = httpx.post(live.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(message), err
    assert not any(w in err["message"] for w in ("messages[", "messages:", "max_tokens", "response_format")), err
