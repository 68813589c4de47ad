"""Log-probabilities and grammars through a prefill/decode cluster (issue 30 items 1 and 3 on a
cluster), through the server, against a single engine on the same weights in fp32.

An in-process 1P1D cluster (the ``laser`` controller; prefill chunks of 16 tokens, so prompt
logprobs span chunks and the hand-off happens after the first token), and a 1P3D one whose
decode instance holding a request dies mid-stream (the request is re-prefilled from prompt + tokens so far and
handed to the other decode instance). The instances' token events carry each sampled token's
logprob and top logprobs and, from the prefill instance, the prompt's; a request's grammar
matcher is rebuilt on each instance from the request's tokens (hand-off, re-prefill).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import numpy as np
import pytest

from laser.cluster.engine import ClusterEngine
from laser.cluster.handles import LocalHandle
from laser.controller import get_controller
from laser.core.config import CacheConfig, SchedulerConfig
from laser.core.slo import SLOClasses
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.instance.worker import InstanceWorker
from laser.model.loader import load_config, load_tokenizer
from laser.server.app import build_app
from laser.server.cli import LiveServer
from simutil import DiesMidStream, random_schema

CHUNK = 16
PROMPT = [(7 * i + 3) % 500 + 100 for i in range(40)]  # 40 token ids: 3 prefill chunks
TOL = 1e-5  # fp32: the same rows in other batch shapes


def _kw(model_dir) -> dict:
    return dict(model=str(model_dir), policy="laser", dtype="float32", cache=CacheConfig(num_blocks=256),
                max_model_len=1024, scheduler=SchedulerConfig(policy="laser", max_num_batched_tokens=CHUNK))


def _cluster_server(model_dir, decode: int, handle=LocalHandle) -> LiveServer:
    kw = _kw(model_dir)
    handles = [LocalHandle(InstanceWorker(0, "prefill", kw))] + [handle(InstanceWorker(i, "decode", kw))
                                                                 for i in range(1, decode + 1)]
    cl = ClusterEngine(handles, get_controller("laser")(), load_tokenizer(str(model_dir)), load_config(str(model_dir)),
                       "tiny", SLOClasses.load())
    return LiveServer(build_app(AsyncEngine(cl), served_model_names=["tiny"]))


@pytest.fixture(scope="module")
def single(tiny_llama):
    kw = _kw(tiny_llama)
    srv = LiveServer(build_app(AsyncEngine(Engine(kw.pop("model"), **kw)), served_model_names=["tiny"]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    srv = _cluster_server(tiny_llama, decode=1)
    yield srv
    srv.stop()


@pytest.fixture
def failing(tiny_llama):
    """1P3D: room for two deaths (a dead in-process instance stays dead)."""
    srv = _cluster_server(tiny_llama, decode=3, handle=DiesMidStream)
    yield srv
    srv.stop()


def post(srv, path: str, body: dict, die: bool = False) -> dict:
    """The answer to ``body`` (a stream's chunks merged into one choice list: text, token ids,
    completions or chat logprobs, finish reason, per choice index); ``die``: the next decode
    instance holding a stream dies mid-stream (``failing`` only)."""
    DiesMidStream.deaths_left[0] = 1 if die else 0
    url = srv.url + path
    if not body.get("stream"):
        r = httpx.post(url, json=body, timeout=180)
        assert r.status_code == 200, r.text
        out = r.json()
        assert not die or out["slo"]["failovers"] == 1
        out["choices"].sort(key=lambda c: c["index"])
        return out
    choices: dict[int, dict] = {}
    last = None
    with httpx.stream("POST", url, json=body, timeout=180) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            last = json.loads(line[6:])
            for c in last["choices"]:
                m = choices.setdefault(c["index"], {"index": c["index"], "text": "", "token_ids": [],
                                                    "finish_reason": None, "logprobs": None})
                m["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                m["token_ids"] += c.get("token_ids") or []
                m["finish_reason"] = c.get("finish_reason") or m["finish_reason"]
                lp = c.get("logprobs")
                if lp is None:
                    continue
                if "content" in lp:  # chat
                    m["logprobs"] = {"content": (m["logprobs"] or {"content": []})["content"] + lp["content"]}
                else:
                    acc = m["logprobs"] or {k: [] for k in ("tokens", "token_logprobs", "top_logprobs")}
                    m["logprobs"] = {k: acc[k] + lp[k] for k in acc}
    assert not die or last["slo"]["failovers"] == 1
    return {"choices": [choices[i] for i in sorted(choices)]}


def assert_same_chat_logprobs(got: dict, want: dict) -> None:
    g, w = got["logprobs"]["content"], want["logprobs"]["content"]
    assert [e["token"] for e in g] == [e["token"] for e in w] and len(g) > 0
    np.testing.assert_allclose([e["logprob"] for e in g], [e["logprob"] for e in w], atol=TOL)
    for a, b in zip(g, w):
        assert [x["token"] for x in a["top_logprobs"]] == [x["token"] for x in b["top_logprobs"]]
        np.testing.assert_allclose([x["logprob"] for x in a["top_logprobs"]],
                                   [x["logprob"] for x in b["top_logprobs"]], atol=TOL)


def assert_same_completion_logprobs(got: dict, want: dict, echo_len: int = 0) -> None:
    g, w = got["logprobs"], want["logprobs"]
    assert g["tokens"] == w["tokens"] and len(g["tokens"]) > echo_len
    if echo_len:
        assert g["token_logprobs"][0] is None and g["top_logprobs"][0] is None
    assert None not in g["token_logprobs"][1 if echo_len else 0:]
    np.testing.assert_allclose(np.array(g["token_logprobs"], dtype=float), np.array(w["token_logprobs"], dtype=float),
                               atol=TOL)
    for a, b in zip(g["top_logprobs"], w["top_logprobs"]):
        assert (a is None) == (b is None)
        if a is not None:
            assert sorted(a) == sorted(b)
            np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], atol=TOL)


# -- log-probabilities -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_on_a_cluster_equal_the_single_engine(single, cluster, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 10,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}
    want = post(single, "/v1/chat/completions", body)["choices"][0]
    got = post(cluster, "/v1/chat/completions", body)["choices"][0]
    assert len(got["logprobs"]["content"]) == 10
    assert_same_chat_logprobs(got, want)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_logprobs_on_a_cluster_equal_the_single_engine(single, cluster, stream):
    """lm-eval's loglikelihood request (echo, logprobs) on a prompt list, and logprobs without echo."""
    prompts = [PROMPT, PROMPT[:23], PROMPT[5:]]
    for extra in ({"echo": True, "logprobs": 2, "max_tokens": 1}, {"logprobs": 2, "max_tokens": 6}):
        body = {"model": "tiny", "prompt": prompts, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
        want = post(single, "/v1/completions", body)["choices"]
        got = post(cluster, "/v1/completions", body)["choices"]
        assert len(got) == 3
        for p, g, w in zip(prompts, got, want):
            echo_len = len(p) if extra.get("echo") else 0
            assert len(g["logprobs"]["tokens"]) == echo_len + extra["max_tokens"]
            assert_same_completion_logprobs(g, w, echo_len)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_after_a_fail_over_equal_the_single_engine(single, failing, stream):
    """The decode instance holding the request dies at its 4th token: the request is re-prefilled
    (prompt + the tokens so far) and handed to another decode instance; its token logprobs (the
    re-prefill's sampled token's included) and echoed prompt logprobs are the single engine's."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 3, "stream": stream}
    want = post(single, "/v1/completions", body)["choices"][0]
    got = post(failing, "/v1/completions", body, die=True)["choices"][0]
    assert got["text"] == want["text"]
    assert_same_completion_logprobs(got, want, echo_len=len(PROMPT))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "stream": stream}
    assert_same_chat_logprobs(post(failing, "/v1/chat/completions", chat, die=True)["choices"][0],
                              post(single, "/v1/chat/completions", chat)["choices"][0])


def test_a_request_without_logprobs_is_unchanged_on_a_cluster(single, cluster):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    got = post(cluster, "/v1/completions", body)["choices"][0]
    assert got["logprobs"] is None
    assert got["token_ids"] == post(single, "/v1/completions", body)["choices"][0]["token_ids"]


# -- grammars ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_a_cluster_validates_and_equals_the_single_engine(single, cluster, stream):
    """response_format json_schema (chat) and guided_json (completions): the grammar's matcher is
    built on the prefill instance, rebuilt from the tokens on the decode instance after the
    hand-off; greedy output equals the single engine's and validates."""
    import random

    for seed in range(3):
        schema = random_schema(random.Random(seed))
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Give me JSON."}],
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": schema}}}),
            ("/v1/completions", {"prompt": "JSON:", "guided_json": schema})]:
            body = {"model": "tiny", "max_tokens": 120, "temperature": 0, "stream": stream, **body}
            got = post(cluster, path, body)["choices"][0]
            want = post(single, path, body)["choices"][0]
            text = got["text"] if "text" in got else got["message"]["content"]
            assert got["finish_reason"] == "stop", text
            jsonschema.validate(json.loads(text), schema)
            assert text == (want["text"] if "text" in want else want["message"]["content"])


def test_choice_and_regex_on_a_cluster(cluster):
    import re

    for seed in range(3):
        r = post(cluster, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 20, "temperature": 1.0, "seed": seed,
                                                   "guided_choice": ["yes", "no", "maybe so"]})
        assert r["choices"][0]["message"]["content"] in ("yes", "no", "maybe so")
        r = post(cluster, "/v1/completions", {"model": "tiny", "prompt": "id:", "max_tokens": 20, "temperature": 1.0,
                                              "seed": seed, "structured_outputs": {"regex": "[a-c]{2}-[0-9]{3}"}})
        assert re.fullmatch("[a-c]{2}-[0-9]{3}", r["choices"][0]["text"]), r["choices"][0]["text"]


def test_a_grammar_survives_a_fail_over(single, failing):
    """A json_schema request whose decode instance dies mid-stream is re-prefilled elsewhere; the
    new instance's matcher replays the tokens so far: the output validates and equals the single
    engine's."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                                        "maxItems": 4},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "tags", "n"], "additionalProperties": False}
    for stream in (False, True):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 80, "temperature": 0, "stream": stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        got = post(failing, "/v1/completions", body, die=True)["choices"][0]
        want = post(single, "/v1/completions", body)["choices"][0]
        assert got["finish_reason"] == "stop" and got["text"] == want["text"]
        jsonschema.validate(json.loads(got["text"]), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_on_a_cluster(single, cluster, stream):
    """tool_choice required / a named function on a cluster: the tool-call grammar (spelled by the
    front end, enforced by the instances' samplers) yields calls that validate, equal to the
    single engine's (greedy)."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        body = {"model": "tiny", "messages": msgs, "tools": [WEATHER, CLOCK], "tool_choice": choice,
                "max_tokens": 200, "temperature": 0}
        r = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=180)
        assert r.status_code == 200, r.text
        if stream:
            calls, reason = {}, None
            for line in r.text.splitlines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:])["choices"]:
                    for d in c["delta"].get("tool_calls") or []:
                        calls.setdefault(d["index"], ["", ""])
                        calls[d["index"]][0] += d["function"].get("name") or ""
                        calls[d["index"]][1] += d["function"].get("arguments") or ""
                    reason = c.get("finish_reason") or reason
            calls = [tuple(calls[i]) for i in sorted(calls)]
        else:
            ch = r.json()["choices"][0]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"]["tool_calls"] or []]
            reason = ch["finish_reason"]
        assert reason == "tool_calls" and calls, r.text
        schemas = {"get_weather": WEATHER["function"]["parameters"], "now": CLOCK["function"]["parameters"]}
        for name, args in calls:
            jsonschema.validate(json.loads(args), schemas[name])
        if isinstance(choice, dict):
            assert {n for n, _ in calls} == {"get_weather"}
        want = httpx.post(single.url + "/v1/chat/completions", json=body, timeout=180).json()["choices"][0]
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in want["message"]["tool_calls"]]
