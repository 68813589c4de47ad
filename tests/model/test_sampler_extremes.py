"""Extreme but accepted sampling controls never make a distribution NaN: one request's
``repetition_penalty: 1e-38`` used to overflow float32 (+inf logits, NaN softmax), and the step's
``torch.multinomial`` raised, failing every request in flight with a 500."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from laser.core.config import CacheConfig
from laser.core.request import Request, SamplingParams
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.model.sampler import Sampler
from laser.server.app import build_app
from laser.server.cli import LiveServer

PROMPT = [1, 5, 5, 9, 30, 40, 41]


@pytest.mark.parametrize("rp", [1e-38, 1e-300, 1e39, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_extreme_repetition_penalty_keeps_a_valid_distribution(rp, temperature):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)) * 4
    logits[0, 5] = 0.0  # a seen token at exactly 0: 0 * inf would be NaN
    logits[0, 9] = float("-inf")  # a seen token masked (a grammar's -inf): -inf * 0 would be NaN
    req = Request(PROMPT, SamplingParams(max_tokens=4, temperature=temperature, repetition_penalty=rp, seed=1))
    plain = Request(PROMPT, SamplingParams(max_tokens=4, temperature=temperature, seed=2))
    sampler = Sampler()
    row = sampler.process_logits(logits[0].clone(), req)
    assert not row.isnan().any() and row[9] == float("-inf")
    if temperature:
        assert torch.isfinite(sampler.filter_logits(row, req.sampling_params).softmax(-1)).all()
    toks = sampler.sample(logits.clone(), [req, plain])
    assert toks[0] != 9
    if rp < 1:  # seen positive logits are divided up to the top: the draw is among them
        assert toks[0] in {t for t in PROMPT if logits[0, t] > 0}
    ref = Sampler().sample(logits[1:].clone(), [Request(PROMPT, SamplingParams(max_tokens=4, temperature=temperature,
                                                                               seed=2))])
    assert toks[1] == ref[0]  # the other request in the step is untouched


def test_a_request_with_an_extreme_penalty_fails_nobody(tiny_llama):
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=128),
                    max_model_len=256)
    with LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"])) as srv:

        async def both():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                victim = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24,
                                                         "ignore_eos": True})
                extreme = c.post("/v1/completions", json={"prompt": "a b a b", "max_tokens": 8, "ignore_eos": True,
                                                          "repetition_penalty": 1e-38})
                return await asyncio.gather(victim, extreme)

        for r in asyncio.run(both()):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] in (8, 24)


def test_greedy_takes_the_first_maximum_as_argmax():
    """Greedy rows go through ``max(dim).indices`` (faster than argmax on wide rows): the same token
    as ``argmax``, ties (several equal maxima, an all -inf row but one) resolved to the first index."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 49152, generator=g)
    logits[1, [7, 300, 40000]] = 50.0  # a three-way tie: the first one wins
    logits[2] = 1.0  # a flat row: index 0
    logits[3] = float("-inf")
    logits[3, 12345] = 0.0
    logits[4, [49151, 2]] = 9.0
    reqs = [Request(PROMPT, SamplingParams(max_tokens=4, temperature=0.0)) for _ in range(6)]
    out = Sampler().sample(logits.clone(), reqs)
    assert out == logits.argmax(dim=-1).tolist()
    assert out[1:5] == [7, 0, 12345, 2]
