"""The served engine's steps, seen from outside (issue 26 item 4, sim vs real served): ``laser serve
--step-log N`` keeps the engine's last N complete steps for ``GET /engine/steps`` (so a benchmark
fits the speed the *served* engine ran at), and ``/metrics`` splits the engine thread's time
(steps, the thread's CPU in them, between steps)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from laser.core.config import CacheConfig
from laser.core.plan import StepPlan, Work
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.instance.core import StepLog
from laser.latency.machine_speed import fit_machine_speed
from laser.server.app import build_app
from laser.server.cli import LiveServer


def test_a_plan_survives_json():
    plan = StepPlan(4, [Work("a", 0, 7, 0, 2), Work("b", 9, 1, 0, 4, sample=True, masked=True, depth=3, exit_from=2)],
                    speculative=({"b": 2}, 1))
    back = StepPlan.from_json(plan.to_json())
    assert back == plan and back.speculative == plan.speculative
    assert StepPlan.from_json(StepPlan(4).to_json()) == StepPlan(4)


def test_the_step_log_numbers_its_steps_and_keeps_the_last():
    ticks = iter(range(100, 200))
    log = StepLog(3, clock=lambda: float(next(ticks)))
    for i in range(5):
        log.append((f"plan{i}", 0.01 * i))
    assert log.total == 5
    assert [n for n, *_ in log.since(0)] == [2, 3, 4]  # the two oldest are gone
    assert log.since(4) == [(4, "plan4", 0.04, 104.0, None)] and log.since(5) == []  # stamped when appended
    log.append(("plan5", 0.05, 7))  # a step cut short at layer 7
    assert log.since(5) == [(5, "plan5", 0.05, 105.0, 7)]
    with pytest.raises(ValueError):
        StepLog(0)


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = Engine(str(tiny_llama), policy="laser", dtype="float32", cache=CacheConfig(num_blocks=128),
                    max_model_len=256)
    engine.core.step_log = StepLog(10_000)
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))
    yield srv, engine
    srv.stop()


def _complete(srv, n: int) -> None:
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello there, how are", "max_tokens": n,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text


def test_the_served_engines_steps_come_back_as_its_plans(served):
    srv, engine = served
    before = httpx.get(srv.url + "/engine/steps", params={"since": 1 << 62}).json()
    assert before["steps"] == []
    _complete(srv, 6)
    d = httpx.get(srv.url + "/engine/steps", params={"since": before["total"]}).json()
    steps = [(StepPlan.from_json(p), s) for _, s, p, _, _, _ in d["steps"]]
    assert d["total"] - before["total"] == len(steps) == 6  # a prefill step, then 5 decode steps
    assert [row[0] for row in d["steps"]] == list(range(before["total"], d["total"]))
    kept = engine.core.step_log.since(before["total"])
    assert [p for p, _ in steps] == [p for _, p, *_ in kept] and [s for _, s in steps] == [s for _, _, s, *_ in kept]
    assert [row[5] for row in d["steps"]] == [None] * 6  # every step ran its plan to the end
    # each step beside its price (the scheduler's, made when it planned) and when it ended
    assert [row[4] for row in d["steps"]] == [p.predicted[1] for _, p, *_ in kept]
    assert all(row[4] > 0.0 for row in d["steps"])
    ends = [row[3] for row in d["steps"]]
    assert ends == [e for _, _, _, e, _ in kept] and ends == sorted(ends)
    assert sum(w.num_tokens for p, _ in steps for w in p.works) == 5 + 5  # the prompt's 5 tokens, 5 decodes
    assert fit_machine_speed(engine.latency_model, steps, engine.model_config.num_layers) is not None
    st, t = d["step_stats"], d["engine_thread"]
    assert st["steps"] - before["step_stats"]["steps"] == 6 and t["steps"] - before["engine_thread"]["steps"] == 6
    assert 0.0 < t["step_cpu_s"] and 0.0 < t["step_s"] and t["between_s"] >= 0.0


def test_metrics_split_the_engine_threads_time(served):
    srv, _ = served
    _complete(srv, 3)
    text = httpx.get(srv.url + "/metrics").text
    v = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "engine_" in s.name}
    assert v["laser:engine_steps_total"] >= 3
    assert v["laser:engine_step_seconds_total"] > 0.0 and v["laser:engine_step_cpu_seconds_total"] > 0.0
    assert v["laser:engine_step_wait_seconds_total"] == pytest.approx(
        max(0.0, v["laser:engine_step_seconds_total"] - v["laser:engine_step_cpu_seconds_total"]))
    assert v["laser:engine_between_steps_seconds_total"] >= 0.0


def test_without_a_step_log_the_endpoint_says_so(tiny_llama):
    engine = Engine(str(tiny_llama), policy="laser", dtype="float32", cache=CacheConfig(num_blocks=64),
                    max_model_len=128)
    with LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"])) as srv:
        r = httpx.get(srv.url + "/engine/steps")
    assert r.status_code == 404 and "--step-log" in r.text


class _CutScheduler:
    """Just enough of a scheduler for :meth:`InstanceCore.execute`: no requests, no calibration."""

    step_observer = None
    latency_model = None  # (prices no step: no decode streak is counted)
    role = "mixed"

    def requests_of(self, plan):
        return {}

    def update(self, *args):
        return []

    def stop_at(self, layer):
        return False


class _StopsAt:
    """An executor whose steps stop at a given layer (a preemption at a layer boundary)."""

    def __init__(self):
        self.stop = 4

    def execute(self, plan, reqs, stop_at=None):
        from laser.core.plan import StepResult

        return StepResult(stopped_layer=self.stop)


def test_a_served_step_log_keeps_the_steps_cut_short_and_a_plain_list_does_not():
    # a stall inside a step that a new arrival cut short was invisible: only whole steps were logged
    from laser.instance.core import InstanceCore

    ticks = iter(float(t) for t in range(100))
    ex = _StopsAt()
    core = InstanceCore(_CutScheduler(), ex, clock=lambda: next(ticks))
    plan = StepPlan(4, [Work("a", 0, 7, 0, 4)])
    for log in (StepLog(8, clock=lambda: 50.0), []):
        core.step_log = log
        ex.stop = 2
        core.execute(plan)  # cut after layer 2
        ex.stop = 4
        core.execute(plan)  # ran to the end
        if isinstance(log, StepLog):
            assert [(n, p, s, cut) for n, p, s, _, cut in log.since(0)] == [(0, plan, 1.0, 2), (1, plan, 1.0, None)]
        else:
            assert log == [(plan, 1.0)]  # the fit of the machine's speed sees whole steps only


def test_metrics_count_the_processs_garbage_collections(served):
    import gc

    srv, _ = served

    def full():
        text = httpx.get(srv.url + "/metrics").text
        return {(s.name, s.labels["generation"]): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name.startswith("laser:gc_")}

    before = full()
    gc.collect(2)
    after = full()
    assert after[("laser:gc_collections_total", "2")] >= before[("laser:gc_collections_total", "2")] + 1
    assert after[("laser:gc_pause_seconds_total", "2")] > before[("laser:gc_pause_seconds_total", "2")]
    assert {g for _, g in after} == {"0", "1", "2"}
