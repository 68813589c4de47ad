"""vLLM's extra sampling parameters on the OpenAI routes, through the official ``openai`` client's
``extra_body`` (as a vLLM user sends them): ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, ``skip_special_tokens`` / ``spaces_between_special_tokens`` on
``/v1/completions`` and ``/v1/chat/completions``; ``best_of`` above ``n``, ``logits_processors``
and a request's own ``chat_template`` are clear 400s naming the field (vLLM V1 refuses them
too), and the server keeps serving everyone else. A tiny random-weight Llama, greedy fp32."""

from __future__ import annotations

import openai
import pytest

from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer

PROMPT = [(7 * i + 3) % 500 + 100 for i in range(30)]
MSGS = [{"role": "user", "content": "Tell me a story"}]
GREEDY = dict(temperature=0, max_tokens=6, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=64), max_model_len=64)


@pytest.fixture(scope="module")
def client(engine):
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    srv.stop()


def extra(**kw) -> dict:
    return {**GREEDY, "extra_body": {**GREEDY["extra_body"], **kw}}


def completion_ids(client, prompt=PROMPT, **kw) -> list[int]:
    r = client.completions.create(model="tiny", prompt=prompt, **extra(return_token_ids=True, **kw))
    return r.choices[0].token_ids


def test_completion_fields(client, engine):
    free = completion_ids(client)
    assert set(completion_ids(client, allowed_token_ids=[free[2], 300])) <= {free[2], 300}
    t = next(t for t in free if (t,) in engine.inputs.bad_words_ids((engine.tokenizer.decode([t]),)))
    banned = completion_ids(client, bad_words=[engine.tokenizer.decode([t])])
    assert t not in banned
    r = client.completions.create(model="tiny", prompt=PROMPT, **extra(truncate_prompt_tokens=8, return_token_ids=True))
    assert r.usage.prompt_tokens == 8 and r.choices[0].prompt_token_ids == PROMPT[-8:]
    assert r.choices[0].token_ids == completion_ids(client, PROMPT[-8:])
    text = engine.tokenizer.decode(engine.tokenizer.encode("The quick brown fox jumps over")[-3:])
    echo = client.completions.create(model="tiny", prompt="The quick brown fox jumps over", echo=True,
                                     **extra(truncate_prompt_tokens=3))
    assert echo.choices[0].text.startswith(text) and echo.usage.prompt_tokens == 3  # the prompt that ran
    special = next(s for s in engine.tokenizer.all_special_ids if s != engine.tokenizer.eos_token_id)
    kept = client.completions.create(model="tiny", prompt=PROMPT, **extra(
        allowed_token_ids=[special], skip_special_tokens=False, spaces_between_special_tokens=False))
    assert kept.choices[0].text == engine.tokenizer.convert_ids_to_tokens(special) * 6
    skipped = client.completions.create(model="tiny", prompt=PROMPT, **extra(allowed_token_ids=[special]))
    assert skipped.choices[0].text == ""


def test_chat_fields(client, engine):
    body = dict(model="tiny", messages=MSGS)
    free = client.chat.completions.create(**body, **extra(return_token_ids=True)).choices[0].token_ids
    r = client.chat.completions.create(**body, **extra(allowed_token_ids=[free[0], 301], return_token_ids=True))
    assert set(r.choices[0].token_ids) <= {free[0], 301}
    ids = engine.inputs.apply_chat_template(MSGS)
    r = client.chat.completions.create(**body, **extra(truncate_prompt_tokens=5, return_token_ids=True))
    assert r.usage.prompt_tokens == 5 and r.choices[0].prompt_token_ids == ids[-5:]
    ok = client.chat.completions.create(**body, **extra(best_of=2), n=2)  # best_of == n: as n alone
    assert len(ok.choices) == 2


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("fields, param, match", [
    ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids", "out of range"),
    ({"bad_words": ["  "]}, "bad_words", "non-blank"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens", "more than this model's context"),
    ({"best_of": 2}, "best_of", "vLLM V1"),
    ({"logits_processors": ["my.module.Processor"]}, "logits_processors", "not supported"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", ""),
])
def test_bad_values_are_400s_and_everyone_else_is_served(client, route, fields, param, match):
    body = {"model": "tiny", "max_tokens": 2, **fields}
    path, body = ("/chat/completions", {**body, "messages": MSGS}) if route == "chat" else \
        ("/completions", {**body, "prompt": PROMPT})
    with pytest.raises(openai.BadRequestError) as e:
        client.post(path, body=body, cast_to=object)
    err = e.value.body
    assert err["param"] == param and match in err["message"], err
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].finish_reason


def test_request_chat_template_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2,
                                       extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    assert e.value.body["param"] == "chat_template"

