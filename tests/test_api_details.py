"""API details (issue 11, item 7): per-choice seeds, exact top-p at the argmax, refused tool
fields (in test_server.py's BAD list) and a context length the KV pool cannot hold."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from laser.async_engine import AsyncEngine
from laser.config import CacheConfig, ConfigError, resolve_max_model_len
from laser.engine import Engine
from laser.request import SLO, Request, SamplingParams
from laser.sampler import Sampler
from laser.server.app import build_app
from laser.server.cli import LiveServer
from laser.server.protocol import SEED_MAX, SEED_MIN, choice_seed


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


def test_max_model_len_beyond_the_kv_pool_is_refused(caplog):
    assert resolve_max_model_len(1024, 2048, 1024) == 1024
    with pytest.raises(ConfigError, match=r"max_model_len 2048 .* room for 1024 tokens"):
        resolve_max_model_len(2048, 4096, 1024)
    with pytest.raises(ConfigError, match="maximum context"):
        resolve_max_model_len(4096, 2048, 8192)
    with caplog.at_level(logging.WARNING, logger="laser.engine"):
        assert resolve_max_model_len(None, 2048, 1024) == 1024
    assert "1024" in caplog.text and "2048" in caplog.text
    assert resolve_max_model_len(None, 2048, 4096) == 2048


def test_engine_refuses_max_model_len_beyond_pool(tiny_llama):
    with pytest.raises(ConfigError, match="room for 1024 tokens"):
        Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
               max_model_len=2048)
