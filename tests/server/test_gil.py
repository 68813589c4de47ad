"""``laser serve``'s GIL switch interval (laser.server.gil) and the first token's hop from the
engine thread to the event loop on /metrics (issue 26 item 4: served TTFT over its twin)."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from laser.core.request import SLO
from laser.frontend.outputs import RequestOutput
from laser.server.gil import set_switch_interval, switch_interval_s
from laser.server.metrics import ServerMetrics


@pytest.fixture
def keep_interval():
    old = sys.getswitchinterval()
    yield
    sys.setswitchinterval(old)


def test_the_interval_is_the_interpreters_unless_set(monkeypatch):
    monkeypatch.delenv("LASER_SWITCH_INTERVAL_MS", raising=False)
    assert switch_interval_s() is None
    monkeypatch.setenv("LASER_SWITCH_INTERVAL_MS", "")
    assert switch_interval_s() is None
    monkeypatch.setenv("LASER_SWITCH_INTERVAL_MS", "0.5")
    assert switch_interval_s() == pytest.approx(5e-4)
    for bad in ("0", "-1", "nan", "inf", "fast"):
        monkeypatch.setenv("LASER_SWITCH_INTERVAL_MS", bad)
        with pytest.raises(ValueError, match="LASER_SWITCH_INTERVAL_MS"):
            switch_interval_s()


def test_setting_it_returns_the_old_one(monkeypatch, keep_interval):
    sys.setswitchinterval(0.005)
    monkeypatch.setenv("LASER_SWITCH_INTERVAL_MS", "0.25")
    assert set_switch_interval() == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(2.5e-4)


def test_laser_serve_sets_the_interval_it_is_given_before_serving(monkeypatch, keep_interval):
    from laser.server.cli import run_server

    seen = []

    class Server:
        def run(self):
            seen.append(sys.getswitchinterval())

    monkeypatch.setenv("LASER_GC_FREEZE", "0")
    sys.setswitchinterval(0.004)
    monkeypatch.delenv("LASER_SWITCH_INTERVAL_MS", raising=False)
    run_server(Server())  # unset: the interpreter's interval stays
    monkeypatch.setenv("LASER_SWITCH_INTERVAL_MS", "0.5")
    run_server(Server())
    assert seen == [pytest.approx(4e-3), pytest.approx(5e-4)]


class _Engine:
    def __init__(self, now: float):
        self.now = now

    def clock(self) -> float:
        return self.now


class _AsyncEngine:
    def __init__(self, now: float):
        self.engine = _Engine(now)

    def counters(self) -> dict:
        return {}


def _first_token(times: tuple[float, ...]) -> RequestOutput:
    n = len(times)
    return RequestOutput("r", None, [1, 2], "", [5] * n, "", [5], False, None, SLO(ttft=1.0, tbt=0.1, name="chat"),
                         arrival_time=1.0, token_times=times)


def _delivery(m: ServerMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if s.name.startswith("laser:first_token_delivery_seconds_"):
                out[s.name.rsplit("_", 1)[1]] = s.value
    return out


def test_metrics_time_the_first_tokens_hop_to_the_event_loop():
    m = ServerMetrics("tiny", _AsyncEngine(now=1.2532))
    m.on_output(None, _first_token((1.25,)))  # the step ended at 1.25; the event loop has it at 1.2532
    m.on_output(None, _first_token((1.25, 1.3)))  # a later token: not a first token's hop
    d = _delivery(m)
    assert d["count"] == 1 and d["sum"] == pytest.approx(0.0032)
