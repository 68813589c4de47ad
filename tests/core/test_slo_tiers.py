"""SLO tiers, completion windows, batch work estimates and the cold EDF queue key (torch-free parts)."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from laser.batch.estimate import WindowError, job_seconds, parse_window, request_seconds, start_by
from laser.batch.jobs import InputFileError, check_jsonl, parse_lines
from laser.core.config import SchedulerConfig
from laser.latency import SimpleLatencyModel
from laser.core.request import InvalidRequestError, Request
from laser.scheduler.base import Scheduler
from laser.core.slo import SLOClasses


def test_shipped_tiers():
    t = SLOClasses.load()
    assert {n: t.classes[n].tier for n in t.names()} == {
        "chat": "hot", "code": "hot", "summarization": "warm", "batch": "cold", "best_effort": "best_effort"}
    assert not t.get("chat").demotable
    dem = t.resolve("chat", demotable=True)
    assert dem.demotable and dem.name == "chat" and dem.ttft == t.get("chat").ttft
    assert t.demotion_target(dem).name == "summarization"
    assert t.demotion_target(t.get("chat")) is None  # not demotable
    with pytest.raises(InvalidRequestError, match="only hot"):
        t.resolve("summarization", demotable=True)


def test_class_config_errors():
    with pytest.raises(ValueError, match="tier"):
        SLOClasses({"x": {"ttft": 1.0, "tier": "lukewarm"}})
    with pytest.raises(ValueError, match="demote_to"):
        SLOClasses({"x": {"ttft": 1.0, "tier": "hot", "demote_to": "y"}, "y": {"ttft": 2.0, "tier": "hot"}})
    t = SLOClasses({"x": {"ttft": 1.0, "tier": "hot", "demotable": True}, "w": {"ttft": 5.0, "tier": "warm"}})
    assert t.demotion_target(t.get("x")).name == "w"


@pytest.mark.parametrize("text,seconds", [("24h", 86400), ("30m", 1800), ("4h", 14400), ("90s", 90), ("1.5h", 5400),
                                          ("2d", 172800)])
def test_parse_window(text, seconds):
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["0s", "0h", "soon", "24", "", "-1h", "31d", None, 24])
def test_parse_window_rejects(text):
    with pytest.raises(WindowError, match="completion_window"):
        parse_window(text)


def test_job_estimate_and_start_by():
    lm = SimpleLatencyModel(num_layers=4, per_layer=0.1, per_token=0.0)
    # prefill 0.4 s; decode iteration 0.4 s shared by 8 rows: 0.05 s per token per request
    assert request_seconds(lm, 10, 5, 8) == pytest.approx(0.4 + 4 * 0.05)
    assert job_seconds(lm, [(10, 5)] * 3, 8) == pytest.approx(3 * 0.6)
    assert start_by(100.0, 10.0) == pytest.approx(89.0)


def test_cold_queue_key_gains_urgency():
    """EDF: a cold request whose start-by time is far sorts behind hot and best-effort work and
    ahead of them once its job's slack is gone."""
    sched = types.SimpleNamespace(config=SchedulerConfig())
    key = lambda r: Scheduler.queue_key(sched, r)  # noqa: E731
    t = SLOClasses.load()
    now = 1000.0
    hot = Request([1, 2], slo=t.get("chat"), arrival_time=now)
    warm = Request([1, 2], slo=t.get("summarization"), arrival_time=now)
    be = Request([1, 2], slo=t.get("best_effort"), arrival_time=now)
    relaxed = Request([1, 2], slo=dataclasses.replace(t.get("batch"), deadline=now + 3600), arrival_time=now)
    urgent = Request([1, 2], slo=dataclasses.replace(t.get("batch"), deadline=now - 1), arrival_time=now)
    order = sorted([relaxed, be, warm, hot, urgent], key=key)
    assert order == [urgent, hot, warm, be, relaxed]
    assert Scheduler.queue_key(types.SimpleNamespace(config=SchedulerConfig(queue_order="fcfs")), urgent) == (now, 0.0)


def test_input_lines():
    ok = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})
    rows = parse_lines(f"{ok}\n\n[1]\n{ok}\n".encode(), "/v1/completions")
    assert [(r["line"], r["state"]) for r in rows] == [(1, "pending"), (3, "failed"), (4, "failed")]
    assert "duplicate" in rows[2]["record"]["error"]["message"]
    assert check_jsonl(f"{ok}\nnot json\n".encode()) == 2
    with pytest.raises(InputFileError):
        check_jsonl(b"\n\n")
