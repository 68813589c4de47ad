"""API details (issue 11, item 7): per-choice seeds, exact top-p at the argmax, refused legacy
function-calling fields (in test_server.py's BAD list) and a context length the KV pool cannot hold; and
(item 6) per-chunk token ids with exact client-side token timing."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from laser.frontend.async_engine import AsyncEngine
from laser.bench.client_timing import ChunkTokenTimer
from laser.core.config import CacheConfig, ConfigError, resolve_max_model_len
from laser.frontend.engine import Engine
from laser.core.request import SLO, Request, SamplingParams
from laser.model.sampler import Sampler
from laser.server.app import build_app
from laser.server.cli import LiveServer
from laser.core.request import SEED_MAX, SEED_MIN, choice_seed


@pytest.fixture(scope="module")
def live(tiny_llama):
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=128),
                    max_model_len=256)
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))
    yield srv
    srv.stop()


def _texts(live, path, body):
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    ch = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["text"] if "text" in c else c["message"]["content"] for c in ch]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_with_seed_gives_distinct_reproducible_choices(live, path):
    body = {"max_tokens": 12, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me a story"}]
    else:
        body["prompt"] = "Once upon a time"
    a = _texts(live, path, {**body, "n": 3})
    assert len(set(a)) == 3, a  # each choice its own stream
    assert _texts(live, path, {**body, "n": 3}) == a  # reproducible per seed
    # choice i is the n=1 answer of seed + i (vLLM's convention)
    assert _texts(live, path, {**body, "n": 1}) == a[:1]
    assert _texts(live, path, {**body, "n": 1, "seed": 8}) == a[1:2]


def test_choice_seed_wraps_into_range():
    assert choice_seed(None, 3) is None
    assert choice_seed(5, 0) == 5 and choice_seed(5, 2) == 7
    s = choice_seed(SEED_MAX, 1)
    assert SEED_MIN <= s <= SEED_MAX and s != SEED_MAX


def test_top_p_tiny_keeps_exactly_the_argmax_token():
    """Many tied maxima: the only kept token is the first one, as argmax breaks the tie."""
    V = 4096
    logits = torch.zeros(1, V)
    logits[0, 100:4000] = 5.0
    sampler = Sampler(0)
    for seed in range(20):
        req = Request(prompt_token_ids=[1], sampling_params=SamplingParams(temperature=1.0, top_p=1e-9, seed=seed),
                      slo=SLO(), arrival_time=0.0)
        assert sampler.sample(logits, [req]) == [int(logits[0].argmax())] == [100]
    # and with a distinct maximum, top_p tiny is greedy whatever the temperature
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    reqs = [Request(prompt_token_ids=[1], sampling_params=SamplingParams(temperature=t, top_p=1e-9, seed=1),
                    slo=SLO(), arrival_time=0.0) for t in (0.5, 1.0, 2.0)]
    assert sampler.sample(logits, reqs) == logits.argmax(-1).tolist()


def test_top_p_below_float32_range_still_keeps_the_argmax_token():
    """A top_p that rounds to 0 in float32 (1e-300 passes the API's top_p > 0 check) must still
    keep the top-1 token: it used to mask every token, so softmax gave NaNs, torch.multinomial
    raised, and the engine step failed every request batched with it (HTTP 500 for all)."""
    logits = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(0)
    reqs = [Request(prompt_token_ids=[1], sampling_params=SamplingParams(temperature=1.0, top_p=p, seed=3),
                    slo=SLO(), arrival_time=0.0) for p in (1e-300, 5e-324)]
    assert sampler.sample(logits, reqs) == logits.argmax(-1).tolist()


def test_max_model_len_beyond_the_kv_pool_is_refused(caplog):
    assert resolve_max_model_len(1024, 2048, 1024) == 1024
    with pytest.raises(ConfigError, match=r"max_model_len 2048 .* room for 1024 tokens"):
        resolve_max_model_len(2048, 4096, 1024)
    with pytest.raises(ConfigError, match="maximum context"):
        resolve_max_model_len(4096, 2048, 8192)
    with caplog.at_level(logging.WARNING, logger="laser.frontend.engine"):
        assert resolve_max_model_len(None, 2048, 1024) == 1024
    assert "1024" in caplog.text and "2048" in caplog.text
    assert resolve_max_model_len(None, 2048, 4096) == 2048


def test_engine_refuses_max_model_len_beyond_pool(tiny_llama):
    with pytest.raises(ConfigError, match="room for 1024 tokens"):
        Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
               max_model_len=2048)


# -- per-chunk token ids and client-side token timing (issue 11, item 6) --------------------------------------


def _stream(live, path, body):
    objs = []
    with httpx.stream("POST", live.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                objs.append(json.loads(line[5:]))
    return objs


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_streams_every_token_once(live, path):
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "😀 你好 ü"}]
    else:
        body["prompt"] = "😀 你好 ü"
    plain = {k: v for k, v in body.items() if k != "stream_options"}  # a 400 without stream (as vLLM)
    whole = httpx.post(live.url + path, json=plain, timeout=60).json()
    choice = whole["choices"][0]
    assert len(choice["token_ids"]) == 40 and choice["prompt_token_ids"]
    objs = _stream(live, path, body)
    chunks = [c for o in objs for c in o.get("choices", [])]
    streamed = [t for c in chunks for t in c.get("token_ids", [])]
    assert streamed == choice["token_ids"]
    assert [c for c in chunks if "prompt_token_ids" in c][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert objs[-1]["usage"]["completion_tokens"] == 40
    # the client timer counts exactly, with token ids and (ids stripped) from the usage chunk
    timer = ChunkTokenTimer()
    for i, o in enumerate(objs):
        timer.feed(o, float(i))
    assert len(timer.token_times()) == 40 and timer.exact
    timer = ChunkTokenTimer()
    for i, o in enumerate(objs):
        timer.feed({**o, "choices": [{k: v for k, v in c.items() if k != "token_ids"} for c in o.get("choices", [])]},
                   float(i))
    assert len(timer.token_times()) == 40 and not timer.exact


def test_chunk_timer_tbt_convention():
    """A chunk of k tokens: its gap counts once, its other tokens count 0 (vLLM's client)."""
    t = ChunkTokenTimer()
    t.feed({"choices": [{"text": "a", "token_ids": [1]}]}, 1.0)
    t.feed({"choices": [{"text": "", "token_ids": [2]}]}, 1.5)  # an incomplete character: no text
    t.feed({"choices": [{"text": "😀", "token_ids": [3, 4, 5]}]}, 2.0)
    t.feed({"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}]}, 2.1)
    t.feed({"choices": [], "usage": {"completion_tokens": 5}}, 2.2)
    assert t.token_times() == [1.0, 1.5, 2.0, 2.0, 2.0] and t.finish_reason == "length"
    # without ids: one per text chunk, the rest of the usage total at the last chunk
    t = ChunkTokenTimer()
    t.feed({"choices": [{"delta": {"content": "a"}}]}, 1.0)
    t.feed({"choices": [{"delta": {"content": "😀"}}]}, 2.0)
    t.feed({"choices": [{"delta": {}, "finish_reason": "stop"}]}, 2.1)
    t.feed({"choices": [], "usage": {"completion_tokens": 4}}, 2.2)
    assert t.token_times() == [1.0, 2.0, 2.0, 2.0]


def test_a_request_model_states_its_slo_fields_and_unsupported_legacy_fields():
    """The body's SLO fields and the legacy fields this server refuses are the request model's own
    (laser.server.protocol): the field parser sees the four SLO fields, not the body."""
    from laser.server.protocol import ChatCompletionRequest, CompletionRequest, SLOFields

    msgs = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(messages=msgs, slo_class="chat", tbt_slo_ms=50)
    assert chat.slo_fields() == SLOFields("chat", None, 50, None)
    assert CompletionRequest(prompt="hi", ttft_slo_ms=200, slo_demotable=True).slo_fields() == \
        SLOFields(None, 200, None, True)
    assert chat.unsupported_field() is None
    assert ChatCompletionRequest(messages=msgs, function_call="auto").unsupported_field() is None
    assert ChatCompletionRequest(messages=msgs, functions=[{"name": "f"}]).unsupported_field()[0] == "functions"
    assert ChatCompletionRequest(messages=msgs, function_call={"name": "f"}).unsupported_field()[0] == "function_call"


def test_text_part_without_text_is_named_as_missing(live):
    """``{"type": "text"}`` with no ``text`` was refused as a non-text part ("only text content parts
    are supported (got type 'text')"); OpenAI names the missing field."""
    r = httpx.post(live.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and err["param"] == "messages", err
    assert err["message"].startswith("messages[0].content[1].text: a text content part needs its text"), err
    ok = httpx.post(live.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("switches", [{"add_generation_prompt": False},
                                      {"add_generation_prompt": False, "continue_final_message": True},
                                      {"add_generation_prompt": True}])
def test_chat_template_switches_are_honoured_as_vllm_does(live, switches):
    """vLLM's ``add_generation_prompt`` / ``continue_final_message`` reach the chat template:
    the prompt ids (of ``/v1/chat/completions`` and ``/tokenize``) are the tokenizer's own
    template output with the same switches (they were refused with 400 before)."""
    tok = live.app.state.async_engine.engine.tokenizer
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    want = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False, **switches))
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                            "return_token_ids": True, **switches})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == want
    t = httpx.post(live.url + "/tokenize", json={"messages": msgs, **switches})
    assert t.status_code == 200 and t.json()["tokens"] == want, t.text


def test_chat_template_switches_both_true_is_a_400(live):
    """As vLLM: a new assistant turn and continuing the last message exclude each other."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(live.url + path, json={"messages": msgs, "add_generation_prompt": True,
                                              "continue_final_message": True})
        assert r.status_code == 400, r.text
        assert "continue_final_message" in r.json()["error"]["message"]


def test_a_field_of_one_type_gets_its_own_message_not_the_unions(live):
    """``/tokenize``'s ``prompt`` is text only: token ids there were refused with the completions
    union's message ("must be a string, a list of token ids, ...", which the ids are). The union's
    message stays where the field is a union."""
    r = httpx.post(live.url + "/tokenize", json={"prompt": [1, 2, 3]})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("prompt: ") and "token ids" not in msg and "string" in msg, msg
    r = httpx.post(live.url + "/v1/completions", json={"prompt": {"a": 1}, "max_tokens": 1})
    assert r.status_code == 400 and "must be a string, a list of token ids" in r.json()["error"]["message"], r.text
