"""A served request's arrival is the app's first sight of it, not the handler's (issue 26 item 4,
srv23): the scheduler plans its TTFT deadline from ``arrival_time``, so time the event loop spends
reading, parsing and validating the body before the handler runs is slack the request has lost."""

from __future__ import annotations

import time

import httpx
import pytest

from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer

LATE = 1000.0  # seconds the fake clock jumps while the body is read (no wall-clock threshold)


@pytest.fixture(scope="module")
def slow_body(tiny_llama):
    """A served engine whose clock jumps ``LATE`` s forward while a request's body is read,
    i.e. after the app first saw the request and before its handler ran."""
    offset = [0.0]
    engine = Engine(str(tiny_llama), policy="laser", dtype="float32", cache=CacheConfig(num_blocks=128),
                    max_model_len=256, clock=lambda: time.monotonic() + offset[0])
    app = build_app(AsyncEngine(engine), served_model_names=["tiny"])

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def late_receive():
            msg = await receive()
            if msg["type"] == "http.request" and scope["method"] == "POST":
                offset[0] += LATE
            return msg

        await app(scope, late_receive, send)

    srv = LiveServer(wrapped)
    yield srv
    srv.stop()


@pytest.mark.parametrize("route,field", [("/v1/completions", {"prompt": "Hello there"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_the_deadline_runs_from_the_http_arrival_not_the_handler(slow_body, route, field):
    r = httpx.post(slow_body.url + route, json={"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                "ignore_eos": True, "slo_class": "chat", **field}, timeout=60)
    assert r.status_code == 200, r.text
    slo = r.json()["slo"]
    # the request's arrival_time (the scheduler's TTFT deadline is arrival_time + target) predates
    # the body's read: its TTFT holds the clock's jump, the engine's own TTFT does not
    assert slo["ttft_ms"] >= LATE * 1e3 > slo["engine_ttft_ms"]
    assert slo["slo_met"] is False  # judged from the HTTP arrival, so the lost slack counts


def test_metrics_split_the_wait_for_the_handler_out_of_the_front_end(slow_body):
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.post(slow_body.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                                                            "slo_class": "code"}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.get(slow_body.url + "/metrics", timeout=60).text
    got = {(s.name, s.labels.get("slo_class")): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    wait = got[("laser:request_handler_wait_seconds_sum", "code")]
    assert got[("laser:request_handler_wait_seconds_count", "code")] == 1 and wait >= LATE
    assert got[("laser:request_frontend_seconds_sum", "code")] >= wait  # the handler's wait is part of it
