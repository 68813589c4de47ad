"""Issue 28, item 2: a target reaches the scheduler with the same effect by every route
(``/v1/completions``, ``/v1/chat/completions``) and every way of naming it (a class, body
fields, headers), against a live server on the tiny random Llama."""

from __future__ import annotations

import httpx
import pytest

from laser.frontend.async_engine import AsyncEngine
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer
from laser.core.slo import SLOClasses


@pytest.fixture(scope="module")
def live(tiny_llama):
    slos = SLOClasses({"code": {"ttft": 0.5, "tbt": 0.2}, "batch": {"tier": "cold"}})
    eng = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=256),
                 max_model_len=256, slo_classes=slos)
    ae = AsyncEngine(eng)
    seen: dict[str, object] = {}
    ae.listeners.append(lambda stream, out: seen.setdefault(out.req_id, out.slo))
    srv = LiveServer(build_app(ae, served_model_names=["tiny"]))
    yield srv, seen
    srv.stop()


WAYS = {
    "class": ({"slo_class": "code"}, {}),
    "class header": ({}, {"x-slo-class": "code"}),
    "body targets": ({"ttft_slo_ms": 500, "tbt_slo_ms": 200}, {}),
    "header targets": ({}, {"x-slo-ttft-ms": "500", "x-slo-tbt-ms": "200"}),
}


def test_same_targets_reach_the_scheduler_alike_by_every_route_and_way(live):
    srv, seen = live
    got = {}
    for route, body in (("/v1/completions", {"prompt": "Hello there"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]})):
        for way, (fields, headers) in WAYS.items():
            seen.clear()
            r = httpx.post(srv.url + route, json={**body, **fields, "max_tokens": 2, "temperature": 0},
                           headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            (slo,) = set(seen.values())
            got[(route, way)] = (slo.ttft, slo.tbt, slo.tier)
    assert set(got.values()) == {(0.5, 0.2, "hot")}, got


def test_metrics_say_why_a_request_missed(tiny_llama):
    """``laser:slo_missed_cause_total`` names what the server knows of a miss: here admission
    predicted a first token (~0.4 s by the slow latency model) far over the 0.01 ms target."""
    from laser.latency import SimpleLatencyModel

    eng = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=256),
                 max_model_len=256, latency_model=SimpleLatencyModel(num_layers=4, per_layer=0.1))
    with LiveServer(build_app(AsyncEngine(eng), served_model_names=["tiny"])) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ttft_slo_ms": 0.01},
                       timeout=60)
        assert r.status_code == 200 and r.json()["slo"]["slo_met"] is False
        text = httpx.get(srv.url + "/metrics").text
    assert 'laser:slo_missed_cause_total{cause="predicted_infeasible",model_name="tiny",slo_class="custom"} 1.0' in text
