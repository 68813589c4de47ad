"""OpenAI-compatible server against a live uvicorn (loopback, free port) on a tiny random Llama.

The official ``openai`` client talks to it: completions and chat, streamed and not; SLO
fields; concurrent streams get exactly their own tokens; a client that disconnects frees
every block; ``/metrics`` parses with the Prometheus text parser; bad input is a 400.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from laser.frontend.async_engine import AsyncEngine
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.scheduler import POLICIES
from laser.server.app import build_app
from laser.server.cli import LiveServer

POLICY = "sarathi"
MAX_MODEL_LEN = 256


def make_server(model_dir, policy: str = POLICY, **ae_kwargs) -> LiveServer:
    engine = Engine(str(model_dir), policy=policy, dtype="float32", cache=CacheConfig(num_blocks=256),
                    max_model_len=MAX_MODEL_LEN)
    ae = AsyncEngine(engine, **ae_kwargs)
    return LiveServer(build_app(ae, served_model_names=["tiny"]))


@pytest.fixture(scope="module")
def live(tiny_llama):
    srv = make_server(tiny_llama)
    yield srv
    srv.stop()


def slow_steps(engine: Engine, delay_s: float) -> Engine:
    """``engine`` with every step at least ``delay_s`` longer: a request of n tokens then takes
    at least n x ``delay_s`` on ANY machine (a test that needs a request still in flight must
    not depend on the CPU being slow)."""
    step = engine.step

    def slow_step():
        time.sleep(delay_s)
        return step()

    engine.step = slow_step
    return engine


@pytest.fixture(scope="module")
def slow_live(tiny_llama):
    """A server whose engine steps take >= 20 ms each: 200 tokens take >= 4 s."""
    engine = Engine(str(tiny_llama), policy=POLICY, dtype="float32", cache=CacheConfig(num_blocks=256),
                    max_model_len=MAX_MODEL_LEN)
    srv = LiveServer(build_app(AsyncEngine(slow_steps(engine, 0.02)), served_model_names=["tiny"]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_idle_and_clean(live, timeout: float = 20.0) -> None:
    """Wait until the engine holds no request, then verify every allocator is empty."""
    ae = live.app.state.async_engine
    deadline = time.monotonic() + timeout
    while True:
        busy = live.call(ae.run_in_engine(lambda e: e.has_unfinished()))
        if not busy:
            break
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    live.call(ae.check_integrity(expect_empty=True))
    assert live.call(ae.run_in_engine(lambda e: e.kv_cache.block_manager.usage())) == 0.0
    assert ae.num_queued == 0 and ae.num_in_flight == 0


# -- OpenAI client: completions and chat, stream and not -------------------------------------------------


def test_models_health(live, client):
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    classes = httpx.get(live.url + "/v1/slo_classes").json()
    assert {"chat", "code", "summarization", "best_effort"} <= set(classes["classes"])
    assert classes["classes"]["chat"] == {"ttft_ms": 250.0, "tbt_ms": 100.0}


def test_completion(live, client):
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    c = r.choices[0]
    assert c.finish_reason == "length" and c.text
    tok = live.app.state.async_engine.inputs.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode("The capital of France is"))
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.model_extra["slo"]["slo_class"] == "best_effort"
    # token-id prompt gives the same greedy text
    ids = tok.encode("The capital of France is")
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == c.text


def test_chat(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hi!"}],
                                       max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    # max_completion_tokens (newer clients) is honoured too
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                       max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_completion_stream_matches_blocking(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) >= 6  # token by token, not one blob


def test_chat_stream_matches_blocking(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=10,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_seed_and_stop(client):
    kw = dict(model="tiny", prompt="Numbers:", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"top_k": 50, "ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b  # seeded: reproducible
    # a stop string taken from the middle of the greedy output cuts it there, streamed or not
    g = client.completions.create(model="tiny", prompt="Numbers:", max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = g[len(g) // 2: len(g) // 2 + 3]
    cut = g[: g.index(stop)]
    kw = dict(model="tiny", prompt="Numbers:", max_tokens=16, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == cut


def test_multibyte_stream_is_exact(client):
    """Random tokens of a byte-level BPE often split UTF-8 characters: the stream must still add up."""
    prompt = "日本語のテキスト 🙂 émigré — ünïcödé"
    for seed in range(3):
        kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=1.5, seed=seed,
                  extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0].text
        pieces = [ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices]
        assert "".join(pieces) == full
        assert not any("\ufffd" in p for p in pieces[:-1])


class _ScriptedSampler:
    """Emits a fixed token sequence (by output position) whatever the logits say."""

    def __init__(self, inner, script):
        self.inner, self.script = inner, script

    def sample(self, logits, reqs):
        return [self.script[len(r.output_token_ids) % len(self.script)] for r in reqs]

    def release(self, req_id):
        self.inner.release(req_id)


def test_split_utf8_characters_stream_exactly(live, client):
    """Tokens that each carry part of a UTF-8 character: no U+FFFD reaches the client, and the
    streamed pieces add up to the exact text."""
    ae = live.app.state.async_engine
    text = "日本語 🙂 é — ünï"
    script = ae.inputs.tokenizer.encode(text)
    tok = ae.inputs.tokenizer
    assert sum("\ufffd" in tok.decode([i]) for i in script) >= 4  # really split characters
    inner = live.call(ae.run_in_engine(lambda e: e.runner.sampler))
    live.call(ae.run_in_engine(lambda e: setattr(e.runner, "sampler", _ScriptedSampler(inner, script))))
    try:
        kw = dict(model="tiny", prompt="Say it", max_tokens=len(script), extra_body={"ignore_eos": True})
        assert client.completions.create(**kw).choices[0].text == text
        pieces = [ch.choices[0].text for ch in client.completions.create(stream=True, **kw) if ch.choices]
        assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=len(script), stream=True, extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].delta.content or "" for ch in chat) == text
    finally:
        live.call(ae.run_in_engine(lambda e: setattr(e.runner, "sampler", inner)))


def test_n_batched_prompts_and_echo(client):
    r = client.completions.create(model="tiny", prompt=["Hello", "Goodbye"], n=2, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by = {c.index: c.text for c in r.choices}
    assert by[0] == by[1] and by[2] == by[3]  # greedy: n copies agree
    assert r.usage.completion_tokens == 16
    e = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert e.choices[0].text == "Hello" + by[0]
    chunks = list(client.completions.create(model="tiny", prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts[0] == by[0] and texts[1] == by[2]


# -- SLOs ------------------------------------------------------------------------------------------------


def test_slo_from_body_and_headers(live, client):
    kw = dict(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
    raw = client.completions.with_raw_response.create(extra_body={"slo_class": "chat"}, **kw)
    assert raw.headers["x-slo-class"] == "chat"
    slo = raw.parse().model_extra["slo"]
    assert slo["slo_class"] == "chat" and slo["ttft_slo_ms"] == 250.0 and slo["tbt_slo_ms"] == 100.0
    assert slo["ttft_ms"] > 0 and isinstance(slo["slo_met"], bool)
    raw = client.completions.with_raw_response.create(extra_headers={"x-slo-class": "code"}, **kw)
    assert raw.headers["x-slo-class"] == "code"
    # explicit targets override the class; body wins over headers
    raw = client.completions.with_raw_response.create(
        extra_headers={"x-slo-ttft-ms": "900", "x-slo-tbt-ms": "90", "x-slo-class": "code"},
        extra_body={"slo_class": "summarization", "tbt_slo_ms": 150}, **kw)
    slo = raw.parse().model_extra["slo"]
    assert slo["slo_class"] == "summarization"
    assert slo["ttft_slo_ms"] == pytest.approx(900.0) and slo["tbt_slo_ms"] == pytest.approx(150.0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
        extra_body={"ttft_slo_ms": 5000, "tbt_slo_ms": 1000})
    assert raw.headers["x-slo-class"] == "custom"


# -- bad input: 400 with an OpenAI-style body, never a 500; everyone else keeps being served ---------------


BAD = [
    # (path, raw body or JSON, headers, substring of the message, param)
    ("/v1/completions", b"{not json", {"content-type": "application/json"}, "malformed JSON", None),
    ("/v1/completions", b"[1, 2]", {"content-type": "application/json"}, "JSON object", None),
    ("/v1/completions", b"", {"content-type": "application/json"}, "empty", None),
    ("/v1/completions", {"prompt": 5}, {}, "prompt: must be", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, {}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, {}, "greater than or equal to 1", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, {}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, {}, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, {}, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, {}, "seed", "seed"),
    ("/v1/completions", {"prompt": "x", "n": 100}, {}, "n", "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 20}, {}, "at most 16", "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, {}, "non-empty", "stop"),
    ("/v1/completions", {"prompt": ""}, {}, "empty", "prompt"),
    ("/v1/completions", {"prompt": []}, {}, "empty", "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, {}, "out of range", "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, {}, "out of range", "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [10**9]}, {},
     "out of range", "stop_token_ids"),
    ("/v1/completions", {"prompt": "hello " * 400}, {}, "context", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, {}, "context", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "slo_class": "platinum"}, {}, "unknown slo_class", "slo_class"),
    ("/v1/completions", {"prompt": "x", "slo_class": ""}, {}, "slo_class", "slo_class"),
    ("/v1/completions", {"prompt": "x"}, {"x-slo-class": "platinum"}, "unknown slo_class", "slo_class"),
    ("/v1/completions", {"prompt": "x", "ttft_slo_ms": -5}, {}, "ttft_slo_ms", "ttft_slo_ms"),
    ("/v1/completions", {"prompt": "x"}, {"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms", "x-slo-ttft-ms"),
    ("/v1/completions", {"prompt": "x"}, {"x-slo-tbt-ms": "-1"}, "x-slo-tbt-ms", "x-slo-tbt-ms"),
    ("/v1/completions", {"prompt": "x", "logprobs": 25}, {}, "less than or equal to 20", "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, {}, "less than or equal to 2", "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, {}, "not supported", "suffix"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, {}, "stream is true",
     "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": False,
                              "stream_options": {"include_usage": True}}, {}, "stream is true", "stream_options"),
    ("/v1/chat/completions", {"messages": []}, {}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, {}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, {}, "role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {},
     "only text", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     {}, "tools[0].function: field required", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     {}, "needs tools", "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "required"},
     {}, "needs tools", "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     {}, "needs tools", "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     {}, "not supported", "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "function_call": {"name": "f"}},
     {}, "not supported", "function_call"),
    ("/v1/completions", {"prompt": [True, False]}, {}, "prompt: must be", "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, {}, "prompt: must be", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, {}, "context", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, {},
     "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 0,
                              "dynamic_depth": True}, {}, "start it with --dynamic-depth", "dynamic_depth"),
]


@pytest.mark.parametrize("path,body,headers,needle,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_400(live, path, body, headers, needle, param):
    if isinstance(body, bytes):
        r = httpx.post(live.url + path, content=body, headers=headers)
    else:
        r = httpx.post(live.url + path, json=body, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"], err
    assert err["param"] == param, err


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                 "model": "nope"})])
def test_unknown_model_in_a_body_is_an_openai_404(live, client, path, body):
    """As OpenAI and vLLM answer it: 404 ``model_not_found`` (the ``openai`` client raises
    NotFoundError), and the server goes on serving the model it has."""
    r = httpx.post(live.url + path, json=body)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "does not exist" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None


def test_bad_input_does_not_disturb_others(live, client):
    """Garbage requests interleaved with a stream: the stream is unaffected, nothing leaks."""
    kw = dict(model="tiny", prompt="Steady", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    ref = client.completions.create(**kw).choices[0].text
    pieces = []

    def stream():
        for ch in client.completions.create(stream=True, **kw):
            pieces.append(ch.choices[0].text if ch.choices else "")

    t = threading.Thread(target=stream)
    t.start()
    with httpx.Client(base_url=live.url) as h:
        while t.is_alive():
            for path, body, headers, _, _ in BAD[:12]:
                r = h.post(path, content=body, headers=headers) if isinstance(body, bytes) else \
                    h.post(path, json=body, headers=headers)
                assert r.status_code == 400
    t.join()
    assert "".join(pieces) == ref
    engine_idle_and_clean(live)


def test_body_over_the_limit_is_413_also_without_content_length(live):
    """The 16 MiB limit holds for a chunked body (no Content-Length) too: it used to be read
    whole (any size, in memory), parsed and tokenized. And a body that JSON cannot even decode
    (invalid UTF-8, nesting too deep) is the documented 400 ``malformed JSON body``."""
    from laser.server.app import DEFAULT_MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * DEFAULT_MAX_BODY_BYTES + b'"}'

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    with httpx.Client(base_url=live.url, timeout=60) as h:
        for content in (big, chunks()):
            r = h.post("/v1/completions", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text[:300]
            assert r.json()["error"]["code"] == "request_too_large"
        for raw in (b'{"prompt": "\xff\xfe", "max_tokens": 1}', b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"):
            r = h.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["code"] == "invalid_value" and err["message"].startswith("malformed JSON body: "), err
        # the server is fine afterwards
        r = h.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    engine_idle_and_clean(live)


def test_unknown_route_and_method(live):
    r = httpx.get(live.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(live.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


# -- concurrency, disconnects --------------------------------------------------------------------------------


def test_concurrent_streams_get_their_own_tokens(live, client):
    prompts = [f"Story number {i}: the {w}" for i, w in enumerate(["cat", "dog", "ship", "tree", "moon", "king"])]
    kw = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    refs = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert len(set(refs)) > 1
    aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(p):
        text, ids = "", set()
        async for ch in await aclient.completions.create(prompt=p, stream=True, **kw):
            ids.add(ch.id)
            text += ch.choices[0].text
        return text, ids

    async def all_():
        res = await asyncio.gather(*(one(p) for p in prompts))
        await aclient.close()
        return res

    res = asyncio.run(all_())
    assert [t for t, _ in res] == refs
    ids = [i for _, i in res]
    assert all(len(i) == 1 for i in ids) and len(set().union(*ids)) == len(prompts)
    engine_idle_and_clean(live)


def _aborted(live) -> float:
    """The server's count of aborted best_effort requests (0 before the first)."""
    import re

    m = re.search(r'^laser:request_aborted_total\{model_name="tiny",slo_class="best_effort"\} (\S+)$',
                  httpx.get(live.url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_stream_frees_every_block(slow_live):
    live = slow_live
    body = {"model": "tiny", "prompt": "A long story:", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    before = _aborted(live)
    # the 200 tokens take >= 4 s (slow_live): the request is in flight when the client leaves
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", live.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(line)
                    if len(events) == 3:
                        break
    engine_idle_and_clean(live, timeout=120)
    # aborted, not run to completion
    assert _aborted(live) == before + 1


def test_disconnect_blocking_request_frees_every_block(slow_live):
    live = slow_live
    body = {"model": "tiny", "prompt": "A long story:", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    ae = live.app.state.async_engine
    # the 200 tokens take >= 4 s (slow_live): the 0.1 s read timeout always fires first
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    deadline = time.monotonic() + 120  # a hang guard
    while ae.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ae.num_in_flight == 0
    engine_idle_and_clean(live, timeout=120)


def test_usage_reports_cached_prompt_tokens(live, client):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's shape), stream or not: a prompt sent again
    reads its full blocks (2 of 16 tokens here) from the prefix cache; /metrics counts the tokens
    looked up and hit under vLLM's names."""
    from prometheus_client.parser import text_string_to_metric_families

    def counters():
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
        return [next(s.value for s in fams[n].samples if s.name.endswith("_total"))
                for n in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")]

    ids = [300 + 7 * i for i in range(40)]
    kw = dict(model="tiny", prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    q0, h0 = counters()
    first = client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert live.app.state.async_engine.cached_prompt_tokens(ids) == 32  # what admission prices as done
    again = client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    engine_idle_and_clean(live)
    q1, h1 = counters()  # (the report is published after each step: the last one is in)
    assert q1 - q0 == 3 * 40 and h1 - h0 == 64


# -- metrics ----------------------------------------------------------------------------------------------


def test_metrics_parse(live, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt="m", max_tokens=3, temperature=0,
                              extra_body={"slo_class": "summarization", "ignore_eos": True})
    r = httpx.get(live.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("laser:time_to_first_token_seconds", "laser:inter_token_latency_seconds",
                 "laser:e2e_request_latency_seconds", "laser:num_requests_running", "laser:num_requests_waiting",
                 "laser:kv_cache_usage_perc", "laser:slo_attained", "laser:slo_missed", "laser:generation_tokens",
                 "laser:prompt_tokens", "laser:request_success", "laser:predicted_slack_seconds",
                 "laser:request_rejected"):
        assert name in fams, name
    ttft = [s for s in fams["laser:time_to_first_token_seconds"].samples
            if s.name.endswith("_count") and s.labels["slo_class"] == "summarization"]
    assert ttft and ttft[0].value >= 1
    slo = [s for f in ("laser:slo_attained", "laser:slo_missed") for s in fams[f].samples
           if s.labels.get("slo_class") == "summarization" and s.name.endswith("_total")]
    assert sum(s.value for s in slo) >= 1
    gen = [s for s in fams["laser:generation_tokens"].samples
           if s.labels.get("slo_class") == "summarization" and s.name.endswith("_total")]
    assert gen[0].value >= 3
    waiting = {s.labels["slo_class"] for s in fams["laser:num_requests_waiting"].samples}
    assert {"chat", "code", "summarization", "best_effort"} <= waiting
    rejected = [s for s in fams["laser:request_rejected"].samples if s.labels.get("reason") == "invalid"]
    assert rejected and rejected[0].value >= 1


# -- every registered policy serves ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_policy_serves(tiny_llama, policy):
    srv = make_server(tiny_llama, policy=policy)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                      temperature=0, extra_body={"slo_class": "chat", "ignore_eos": True})
        assert r.usage.completion_tokens == 4
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
            extra_body={"slo_class": "code", "ignore_eos": True}))
        assert text == r.choices[0].message.content
        engine_idle_and_clean(srv)
    finally:
        srv.stop()


def test_sse_wire_format(live):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


def test_a_cluster_reports_cached_prompt_tokens_and_prefix_counters_per_instance(tiny_llama):
    """Issue 29 item 4 on a cluster (1P1D, in process): the prefill instance's prefix cache hit
    reaches the response's ``usage.prompt_tokens_details.cached_tokens`` (carried by the instance's
    token event) and ``/metrics`` has ``vllm:prefix_cache_queries`` / ``_hits`` per instance."""
    from prometheus_client.parser import text_string_to_metric_families

    from laser.cluster.engine import ClusterEngine
    from laser.cluster.handles import LocalHandle
    from laser.controller import get_controller
    from laser.core.slo import SLOClasses
    from laser.instance.worker import InstanceWorker
    from laser.model.loader import load_config, load_tokenizer

    kw = dict(model=str(tiny_llama), policy="laser", dtype="float32")
    cl = ClusterEngine([LocalHandle(InstanceWorker(0, "prefill", kw)), LocalHandle(InstanceWorker(1, "decode", kw))],
                       get_controller("laser")(), load_tokenizer(str(tiny_llama)), load_config(str(tiny_llama)),
                       "tiny", SLOClasses.load())
    srv = LiveServer(build_app(AsyncEngine(cl), served_model_names=["tiny"]))
    try:
        ids = [300 + 7 * i for i in range(40)]
        body = {"model": "tiny", "prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        first = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        again = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks of 16
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        per = {n: {s.labels["instance"]: s.value for s in fams[n].samples if s.name.endswith("_total")}
               for n in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
        assert per["vllm:prefix_cache_queries"]["0"] == 80 and per["vllm:prefix_cache_hits"]["0"] == 32
        assert per["vllm:prefix_cache_hits"]["1"] == 0  # the decode instance adopts KV, it looks nothing up
    finally:
        srv.stop()
