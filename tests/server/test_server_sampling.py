"""Sampling controls and log-probabilities through the official ``openai`` client (issue 30).

Penalties, logit bias, min_tokens and min_p against a reference written from vLLM's formulas on
the same logits; logprobs (chat ``logprobs``/``top_logprobs``, completions ``logprobs`` and
``echo``) against a direct fp32 forward of the same weights with Hugging Face transformers;
prompt lists of any length, vLLM's tokenizer endpoints, per-chunk usage, the TPOT header and the
``vllm:`` metrics. A tiny random-weight Llama, chunked prefill of 16 tokens so prompt logprobs
are collected over several chunks.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch

from laser.frontend.async_engine import AsyncEngine
from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.engine import Engine
from laser.core.request import InvalidRequestError, Request, SamplingParams
from laser.model.sampler import Sampler
from laser.server.app import build_app
from laser.server.cli import LiveServer
from simutil import FakeClock, random_schema, replay_at_layer_boundaries

CHUNK = 16  # prefill chunk (tokens): prompts below are longer, so prompt logprobs span chunks
PROMPT = [(7 * i + 3) % 500 + 100 for i in range(40)]  # 40 token ids


@pytest.fixture(scope="module")
def live(tiny_llama):
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=256),
                    max_model_len=256, scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=CHUNK))
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of a direct forward (row p predicts token p + 1)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# -- reference logits processing: vLLM's formulas, one token at a time in float32 ------------------------


def reference_process(logits: np.ndarray, prompt: list[int], output: list[int], sp: SamplingParams,
                      eos: set[int]) -> np.ndarray:
    """vLLM's order: logit bias, min_tokens mask, repetition, frequency, presence penalties."""
    x = logits.astype(np.float32).copy()
    for t, b in sp.logit_bias:
        x[t] = np.float32(x[t] + np.float32(b))
    if len(output) < sp.min_tokens:
        for t in set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos):
            x[t] = -np.inf
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=len(x)) if output else np.zeros(len(x), int)
    seen = set(prompt) | set(output)
    rp = np.float32(sp.repetition_penalty)
    for v in range(len(x)):
        if sp.repetition_penalty != 1.0 and v in seen:
            x[v] = x[v] / rp if x[v] > 0 else x[v] * rp
        if counts[v]:
            x[v] = x[v] - np.float32(sp.frequency_penalty) * np.float32(counts[v])
            x[v] = x[v] - np.float32(sp.presence_penalty)
    return x


CONTROLS = [
    dict(presence_penalty=1.5),
    dict(presence_penalty=-0.7),
    dict(frequency_penalty=0.9),
    dict(frequency_penalty=-2.0),
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(logit_bias={5: 30.0, 17: -100.0, 40: 2.5}),
    dict(min_tokens=10, stop_token_ids=(9, 11)),
    dict(min_tokens=10, stop_token_ids=(11,), ignore_eos=True),
    dict(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3, logit_bias={3: 4.0}, min_tokens=9),
]


@pytest.mark.parametrize("controls", CONTROLS, ids=[str(i) for i in range(len(CONTROLS))])
def test_logits_processing_equals_the_reference(controls):
    """Each control changes the logits exactly (bit for bit) as vLLM's formulas applied one token
    at a time in float32; a request without controls in the same batch keeps its raw row."""
    V = 64
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, V, generator=g) * 4
    prompt = [1, 5, 5, 9, 30, 40, 41]
    output = [5, 3, 3, 3, 22, 40, 63, 0]
    sp = SamplingParams(max_tokens=32, temperature=0.0, **controls)
    req = Request(prompt, sp)
    req.output_token_ids = list(output)
    plain = Request(prompt, SamplingParams(max_tokens=32, temperature=0.0))
    plain.output_token_ids = list(output)
    sampler = Sampler(eos_ids={2, 9})
    got = sampler.process_logits(logits[0].clone(), req)
    ref = reference_process(logits[0].numpy(), prompt, output, sp, {2, 9})
    np.testing.assert_array_equal(got.numpy(), ref)
    assert not np.array_equal(ref, logits[0].numpy()), "the control must change something"
    toks = sampler.sample(logits.clone(), [req, plain])
    assert toks == [int(np.argmax(ref)), int(logits[1].argmax())]
    assert not plain.sampling_params.processes_logits


def test_min_p_keeps_exactly_the_tokens_above_the_threshold():
    """min_p drops tokens whose probability (after temperature) is below min_p x the top one's:
    with a uniform draw over the kept ones, every sample is a kept token and each kept token shows."""
    logits = torch.tensor([[4.0, 3.9, 3.0, 1.0, 0.0, -1.0]])
    probs = (logits[0] / 0.5).softmax(-1)
    kept = {i for i in range(6) if probs[i] >= 0.2 * probs.max()}
    assert 1 < len(kept) < 6
    sampler = Sampler()
    seen = set()
    for seed in range(200):
        req = Request([1], SamplingParams(temperature=0.5, min_p=0.2, seed=seed))
        seen.add(sampler.sample(logits.clone(), [req])[0])
        sampler.release(req.req_id)
    assert seen == kept


def test_sampling_params_reject_bad_controls():
    for kw, field in [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                      (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
                      (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logprobs=21), "logprobs")]:
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**kw)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={10**6: 1.0}).check_vocab(1000)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[5, 10**9]).check_vocab(1000)
    SamplingParams(stop_token_ids=[5, 999]).check_vocab(1000)  # in range: accepted


def greedy_reference(hf, prompt: list[int], n: int, sp: SamplingParams, eos: set[int]) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        row = hf_logits(hf, prompt + out)[-1].numpy()
        out.append(int(np.argmax(reference_process(row, prompt, out, sp, eos))))
    return out


@pytest.mark.parametrize("path", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_penalties_through_the_openai_client_equal_the_reference(live, client, hf, path, stream):
    """Greedy output with penalties and a logit bias equals a greedy loop over a direct forward with
    the reference processing, streamed or not. The bias alone makes token 300 repeat; the
    penalties then break the repetition (so the output differs from the bias alone's)."""
    controls = dict(frequency_penalty=1.2, presence_penalty=0.8, repetition_penalty=1.4, logit_bias={"300": 8.0})
    n = 24
    if path == "chat":
        msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
        prompt = httpx.post(live.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    else:
        prompt = PROMPT

    def run(extra):
        body = dict(extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
        if path == "chat":
            kw = dict(model="tiny", messages=msgs, max_tokens=n, temperature=0, **body)
            if stream:
                ids = [t for ch in client.chat.completions.create(stream=True, **kw)
                       for c in ch.choices for t in (c.model_extra or {}).get("token_ids") or []]
                return ids
            return client.chat.completions.create(**kw).choices[0].model_extra["token_ids"]
        kw = dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0, **body)
        if stream:
            return [t for ch in client.completions.create(stream=True, **kw)
                    for c in ch.choices for t in (c.model_extra or {}).get("token_ids") or []]
        return client.completions.create(**kw).choices[0].model_extra["token_ids"]

    got = run(controls)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.8,
                        repetition_penalty=1.4, logit_bias={300: 8.0})
    assert got == greedy_reference(hf, prompt, n, sp, set())
    biased = run({"logit_bias": {"300": 8.0}})
    assert biased.count(300) > n // 2 and got.count(300) < biased.count(300)


@pytest.mark.parametrize("path", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_masks_eos_until_reached(live, client, path, stream):
    """EOS biased to the top: without min_tokens the answer is one EOS token; with min_tokens=5 the
    first five tokens are anything else and the sixth is EOS (finish_reason stop)."""
    eos = live.app.state.async_engine.engine.tokenizer.eos_token_id

    def run(min_tokens):
        extra = {"logit_bias": {str(eos): 100}, "min_tokens": min_tokens, "return_token_ids": True}
        if path == "chat":
            kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=20, extra_body=extra)
            make = client.chat.completions.create
        else:
            kw = dict(model="tiny", prompt="hello", max_tokens=20, extra_body=extra)
            make = client.completions.create
        if stream:
            ids, reason = [], None
            for ch in make(stream=True, **kw):
                for c in ch.choices:
                    ids += (c.model_extra or {}).get("token_ids") or []
                    reason = c.finish_reason or reason
            return ids, reason
        c = make(**kw).choices[0]
        return c.model_extra["token_ids"], c.finish_reason

    assert run(0) == ([eos], "stop")
    ids, reason = run(5)
    assert len(ids) == 6 and ids[-1] == eos and eos not in ids[:5] and reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_through_the_openai_client(client, stream):
    """vLLM's ``include_stop_str_in_output``: the text (streamed or not) ends with the stop string;
    without it the text ends before it (the field used to be ignored as an unknown one)."""
    kw = dict(model="tiny", prompt="hello", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    cut = full.find(stop)

    def run(include):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        args = {**kw, "stop": [stop], "extra_body": extra}
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason
        c = client.completions.create(**args).choices[0]
        return c.text, c.finish_reason

    assert run(False) == (full[:cut], "stop")
    assert run(True) == (full[:cut + len(stop)], "stop")


# -- logprobs ---------------------------------------------------------------------------------------------


def check_top(entries_top: list[tuple[int, float]], ref_row: torch.Tensor, k: int):
    vals, idx = torch.topk(ref_row, k)
    assert [t for t, _ in entries_top] == idx.tolist()
    np.testing.assert_allclose([v for _, v in entries_top], vals.numpy(), atol=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_a_direct_forward(live, client, hf, stream):
    msgs = [{"role": "user", "content": "Name three colours."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    if stream:
        content, ids = [], []
        for ch in client.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                ids += (c.model_extra or {}).get("token_ids") or []
                if c.logprobs is not None:
                    content += c.logprobs.content
    else:
        c = client.chat.completions.create(**kw).choices[0]
        content, ids = c.logprobs.content, c.model_extra["token_ids"]
    prompt = httpx.post(live.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
    ref = hf_logits(hf, prompt + ids).log_softmax(-1)
    assert len(content) == len(ids) == 12
    tok = live.app.state.async_engine.engine.tokenizer
    for i, (e, t) in enumerate(zip(content, ids)):
        row = ref[len(prompt) - 1 + i]
        assert e.logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert e.token == tok.decode([t]) and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        vals, idx = torch.topk(row, 3)
        assert [x.token for x in e.top_logprobs] == [tok.decode([j]) for j in idx.tolist()]
        np.testing.assert_allclose([x.logprob for x in e.top_logprobs], vals.numpy(), atol=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_logprobs_equal_a_direct_forward(live, client, hf, stream):
    """lm-eval's loglikelihood request (``echo: true, logprobs: 1, max_tokens: 1``) on a batch of
    prompts given as token ids: the prompt's tokens (first one null) then the generated one."""
    prompts = [PROMPT, PROMPT[:23], PROMPT[5:]]
    kw = dict(model="tiny", prompt=prompts, max_tokens=1, temperature=0, echo=True, logprobs=1)
    if stream:
        lps = {i: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for i in range(3)}
        texts = {i: "" for i in range(3)}
        for ch in client.completions.create(stream=True, **kw):
            for c in ch.choices:
                texts[c.index] += c.text
                if c.logprobs is not None:
                    for f in lps[c.index]:
                        lps[c.index][f] += getattr(c.logprobs, f)
        choices = [(texts[i], lps[i]) for i in range(3)]
    else:
        r = client.completions.create(**kw)
        choices = [(c.text, c.logprobs.model_dump()) for c in sorted(r.choices, key=lambda c: c.index)]
    tok = live.app.state.async_engine.engine.tokenizer
    for p, (text, lp) in zip(prompts, choices):
        assert len(lp["tokens"]) == len(p) + 1
        ref = hf_logits(hf, p).log_softmax(-1)
        nxt = int(ref[-1].argmax())
        ids = p + [nxt]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:], [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))],
                                   atol=1e-4)
        assert lp["tokens"] == [tok.decode([t]) for t in ids]
        assert text == tok.decode(p) + tok.decode([nxt])
        assert lp["text_offset"][0] == 0
        assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
        for i in range(1, len(ids)):  # top-1 token, plus the token itself when it is not the top one
            top = lp["top_logprobs"][i]
            best = tok.decode([int(ref[i - 1].argmax())])
            assert best in top and top[best] == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
            assert tok.decode([ids[i]]) in top and len(top) <= 2


def test_completion_logprobs_without_echo_and_a_request_without_logprobs(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and None not in lp.token_logprobs
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text


# -- what outside clients also need -----------------------------------------------------------------------


def test_a_prompt_list_longer_than_16_is_one_request(client):
    """lm-eval --batch_size 32: 32 prompts in one request with n = 1 (vLLM takes any length)."""
    prompts = [PROMPT[i:i + 8] for i in range(32)]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=2, temperature=0)
    assert sorted(c.index for c in r.choices) == list(range(32))
    assert r.usage.prompt_tokens == 32 * 8
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model="tiny", prompt=prompts[:9], max_tokens=2, n=2)


def test_tokenize_detokenize_tokenizer_info(live):
    tok = live.app.state.async_engine.engine.tokenizer
    r = httpx.post(live.url + "/tokenize", json={"model": "tiny", "prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(live.url + "/tokenize", json={"messages": msgs}).json()
    assert chat["tokens"] == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
    d = httpx.post(live.url + "/detokenize", json={"model": "tiny", "tokens": body["tokens"]}).json()
    assert d == {"prompt": "Hello world"}
    info = httpx.get(live.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == 256
    assert info["chat_template"] == tok.chat_template and info["tokenizer_class"]
    for path, body, param in [("/detokenize", {"tokens": [10**9]}, "tokens"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")]:
        r = httpx.post(live.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_continuous_usage_stats(client, path):
    kw = dict(model="tiny", max_tokens=6, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if path == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
    else:
        chunks = list(client.completions.create(prompt=PROMPT[:10], **kw))
    assert all(ch.usage is not None for ch in chunks)
    done = [ch.usage.completion_tokens for ch in chunks]
    assert done == sorted(done) and done[-1] == 6 and chunks[-1].choices == []
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1
    plain = list(client.completions.create(prompt=PROMPT[:10], model="tiny", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert [ch.usage is not None for ch in plain] == [False] * (len(plain) - 1) + [True]


def test_tpot_header_is_the_tbt_target(live):
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "700"})
    slo = r.json()["slo"]
    assert slo["ttft_slo_ms"] == pytest.approx(5000) and slo["tbt_slo_ms"] == pytest.approx(700)
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   headers={"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "700", "x-slo-tbt-ms": "900"})
    assert r.json()["slo"]["tbt_slo_ms"] == pytest.approx(900)
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, headers={"x-slo-tpot-ms": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-slo-tpot-ms"


def test_vllm_metric_names_beside_ours(live, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert name in fams, name
    def total(fam, suffix):
        return sum(s.value for s in fams[fam].samples if s.name == fam + suffix)
    assert total("vllm:e2e_request_latency_seconds", "_count") == total("laser:e2e_request_latency_seconds", "_count")
    assert total("vllm:inter_token_latency_seconds", "_count") == total("laser:inter_token_latency_seconds", "_count")
    assert total("vllm:generation_tokens", "_total") == total("laser:generation_tokens", "_total")
    # vLLM's preemption counter (dashboards read it), every cause summed; 0 until one happens
    assert total("vllm:num_preemptions", "_total") == total("laser:preemptions", "_total")
    assert [s.labels for s in fams["vllm:num_preemptions"].samples] == [{"model_name": "tiny"}]


BAD = [
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_controls_are_400_naming_the_field(live, path, body, param):
    r = httpx.post(live.url + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


# -- penalties and logprobs survive layer pauses, preemption and the prefill -> decode hand-off ----------




@pytest.fixture(scope="module")
def engines(tiny_llama):
    return [Engine(str(tiny_llama), policy="vllm", dtype="float32") for _ in range(3)]


GRAMMAR = {"type": "object", "properties": {"ok": {"type": "boolean"}, "c": {"enum": ["red", "green"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["c", "n", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("disaggregated,structured", [(False, False), (True, False), (True, True)])
def test_controls_and_logprobs_survive_pauses_preemption_and_handoff(engines, disaggregated, structured):
    """Requests with penalties, a bias, min_tokens, logprobs and prompt logprobs (or a JSON schema)
    under Laser with a 16-token budget, a 1-3 token intermediate cache (pauses, evictions,
    preemption) and, on a prefill/decode pair, the hand-off: each gets exactly the tokens it gets
    alone, and the same token and prompt logprobs (fp32 rounding of other batch shapes aside)."""
    from laser.frontend.disagg import DisaggregatedPair
    from laser.latency import SimpleLatencyModel
    from laser.core.request import SLO

    summ, code, chat = (SLO(ttft=0.03, tbt=0.012, name="summarization"), SLO(ttft=0.002, tbt=0.0044, name="code"),
                        SLO(ttft=0.004, tbt=0.006, name="chat"))
    load = [([7] * 40, 8, summ, 0), ([9] * 30, 6, code, 3), ([11] * 5, 10, summ, 0), ([13] * 5, 10, chat, 0),
            ([15] * 5, 10, SLO(), 0), ([17] * 24, 5, chat, 9)]

    def params(n):
        if structured:
            return SamplingParams(max_tokens=n + 20, temperature=0, structured_output=("json", json.dumps(GRAMMAR)),
                                  logprobs=1, prompt_logprobs=0)
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logit_bias={300: 8.0}, min_tokens=2,
                              frequency_penalty=1.2, presence_penalty=0.8, repetition_penalty=1.4, logprobs=2,
                              prompt_logprobs=1)

    ref, a, b = engines
    solo = []
    for prompt, n, _, _ in load:
        ref.reconfigure(SchedulerConfig(policy="vllm", max_num_batched_tokens=4096), None, clock=FakeClock())
        r = ref.add_request(list(prompt), params(n))
        while ref.has_unfinished():
            ref.step()
        solo.append(r)
    lm = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=2e-5, per_context=1e-6)
    clock = FakeClock()
    if disaggregated:
        a.reconfigure(SchedulerConfig(policy="laser", role="prefill", max_num_batched_tokens=16), lm, 3, clock)
        b.reconfigure(SchedulerConfig(policy="laser", role="decode", max_num_batched_tokens=16), lm, 3, clock)
        target = DisaggregatedPair(a, b)
    else:
        a.reconfigure(SchedulerConfig(policy="laser", max_num_batched_tokens=16), lm, 1, clock)
        target = a
    outs = replay_at_layer_boundaries(target, (a, b), load, params, start=1)
    for i, (want, got) in enumerate(zip(solo, outs)):
        assert got.output_token_ids == want.output_token_ids, i
        if structured:
            import jsonschema

            assert want.finish_reason == "stop"
            jsonschema.validate(json.loads(ref.tokenizer.decode(want.output_token_ids[:-1])), GRAMMAR)
        else:
            assert 300 in want.output_token_ids
        assert len(got.output_logprobs) == len(want.output_logprobs) == len(want.output_token_ids)
        for g, w in zip(got.output_logprobs, want.output_logprobs):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4) and [t for t, _ in g.top] == [t for t, _ in w.top]
        assert got.prompt_logprobs[0] is None and None not in got.prompt_logprobs[1:]
        np.testing.assert_allclose([e.logprob for e in got.prompt_logprobs[1:]],
                                   [e.logprob for e in want.prompt_logprobs[1:]], atol=1e-4)
    stats = (a.icache.num_evictions + getattr(a.scheduler, "num_step_preemptions", 0),
             len(getattr(target, "adopted", ())))
    assert stats[0] > 0 and (stats[1] > 0 or not disaggregated), stats


# -- structured output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_always_validates(client, seed):
    """Random bounded schemas, chat (response_format json_schema) and completions (guided_json,
    streamed), greedy and sampled: the output always parses and validates."""
    import random

    import jsonschema

    schema = random_schema(random.Random(seed))
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    text, reason = "", None
    for ch in client.completions.create(model="tiny", prompt="JSON:", max_tokens=120, temperature=1.0, seed=seed,
                                        stream=True, extra_body={"guided_json": schema}):
        for c in ch.choices:
            text += c.text
            reason = c.finish_reason or reason
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_choice_regex_grammar_and_json_object(client):
    msgs = [{"role": "user", "content": "hi"}]
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=1.0, seed=seed,
                                           extra_body={"guided_choice": ["yes", "no", "maybe so"]})
        assert r.choices[0].message.content in ("yes", "no", "maybe so") and r.choices[0].finish_reason == "stop"
        r = client.completions.create(model="tiny", prompt="id:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]{3}"}})
        import re

        assert re.fullmatch("[a-c]{2}-[0-9]{3}", r.choices[0].text), r.choices[0].text
        r = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"guided_grammar": 'start: "a" ("b" | "c")*  "d"'})
        assert re.fullmatch("a[bc]*d", r.choices[0].text) or r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"


STRUCTURED_BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs"),  # no supported key: not served unconstrained
    ({"structured_outputs": {}}, "structured_outputs"),
]


@pytest.mark.parametrize("extra,param", STRUCTURED_BAD, ids=[p + str(i) for i, (_, p) in enumerate(STRUCTURED_BAD)])
def test_bad_structured_output_is_400_naming_the_field(live, extra, param):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_cluster_serves_the_controls(tiny_llama):
    """Through a cluster front end (one in-process instance): min_tokens and the bias work in the
    instance's sampler (logprobs and grammars on a cluster: tests/server/test_cluster_api.py)."""
    from laser.cluster.engine import ClusterEngine
    from laser.cluster.handles import LocalHandle
    from laser.controller import get_controller
    from laser.core.slo import SLOClasses
    from laser.instance.worker import InstanceWorker
    from laser.model.loader import load_config, load_tokenizer

    kw = dict(model=str(tiny_llama), policy="sarathi", dtype="float32",
              scheduler=SchedulerConfig(policy="sarathi", max_num_batched_tokens=CHUNK))
    tok = load_tokenizer(str(tiny_llama))
    cl = ClusterEngine([LocalHandle(InstanceWorker(0, "mixed", kw))], get_controller("colocated")(), tok,
                       load_config(str(tiny_llama)), "tiny", SLOClasses.load())
    srv = LiveServer(build_app(AsyncEngine(cl), served_model_names=["tiny"]))
    try:
        eos = tok.eos_token_id
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 20, "min_tokens": 5,
                                                          "logit_bias": {str(eos): 100}, "return_token_ids": True},
                       timeout=120).json()
        ids = r["choices"][0]["token_ids"]
        assert len(ids) == 6 and ids[-1] == eos and r["choices"][0]["finish_reason"] == "stop"
    finally:
        srv.stop()


def test_a_failed_over_seeded_request_says_so_and_keeps_its_sample(tiny_llama, live):
    """Issue 28 item 9 through the server: a seeded sampled request whose decode instance dies
    mid-stream (1P3D, in process; the instance holding it dies at its 4th token step) answers the
    single engine's tokens, and its ``slo`` object -- the JSON body's, and a stream's final chunk's
    -- says it failed over and kept its seed; ``/metrics`` counts the seeded re-prefills."""
    from laser.cluster.engine import ClusterEngine
    from laser.cluster.handles import LocalHandle
    from laser.controller import get_controller
    from laser.core.slo import SLOClasses
    from laser.instance.worker import InstanceWorker
    from laser.model.loader import load_config, load_tokenizer

    from simutil import DiesMidStream

    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 7, "ignore_eos": True,
            "return_token_ids": True, "slo_class": "chat"}
    ref = httpx.post(live.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    kw = dict(model=str(tiny_llama), policy="laser", dtype="float32", cache=CacheConfig(num_blocks=256),
              max_model_len=256, scheduler=SchedulerConfig(policy="laser", max_num_batched_tokens=CHUNK))
    handles = [LocalHandle(InstanceWorker(0, "prefill", kw))] + [DiesMidStream(InstanceWorker(i, "decode", kw))
                                                                 for i in (1, 2, 3)]
    cl = ClusterEngine(handles, get_controller("laser")(), load_tokenizer(str(tiny_llama)),
                       load_config(str(tiny_llama)), "tiny", SLOClasses.load())
    srv = LiveServer(build_app(AsyncEngine(cl), served_model_names=["tiny"]))
    try:
        DiesMidStream.deaths_left[0] = 1
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        assert r["choices"][0]["token_ids"] == ref
        assert r["slo"]["failovers"] == 1 and r["slo"]["seed_kept"] is True
        DiesMidStream.deaths_left[0] = 1
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == ref
        assert chunks[-1]["slo"]["failovers"] == 1 and chunks[-1]["slo"]["seed_kept"] is True
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'laser:recoveries_seed_kept_total{model_name="tiny"} 2.0' in metrics
    finally:
        srv.stop()
