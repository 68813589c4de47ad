"""The HTTP front end's share of a served TTFT (issue 26 item 4: sim vs real through ``laser serve``).

The latency model carries a measured ``frontend_ttft_s`` (kept in the profile file); the simulator
adds it to every token of a served setup (``SimTarget(served=True)``) and never in process; the
server's admission adds it to its TTFT predictions; the server reports the engine's own TTFT so the
term can be measured (:func:`laser.bench.frontend_cost.measure_frontend_ttft`). Exact numbers from
simple latency models and a fake fitted profile; a tiny random Llama behind a real server; no
timing thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from laser.bench.runner import Benchmark, SimTarget
from laser.bench.workloads import WorkloadRequest
from laser.core.config import SchedulerConfig
from laser.core.request import SLO
from laser.core.slo import SLOClasses
from laser.frontend.admission import QueueAwareAdmission
from laser.latency import AttentionSample, EmbedSample, HeadSample, SimpleLatencyModel, StatelessSample, fit
from laser.latency.calibrated import CalibratedLatencyModel, ScaledLatencyModel

N = 4
FE = 0.0375  # seconds: a front-end term with an exact binary-friendly value


def _lm(frontend: float = 0.0) -> SimpleLatencyModel:
    lm = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5)
    lm.frontend_ttft_s = frontend
    return lm


def _probe(served: bool, frontend: float):
    reqs = [WorkloadRequest("chat", "x", 40, 6, 0.0) for _ in range(8)]
    slos = SLOClasses({"chat": {"ttft": 0.5, "tbt": 0.2}})
    tgt = SimTarget("vllm", _lm(frontend), N, SchedulerConfig(policy="vllm"), served=served)
    return Benchmark({"t": tgt}, reqs, slos, seed=3).probe("t", 20.0, early_stop=False)


def test_served_simulation_adds_the_frontend_term_in_process_does_not():
    base = _probe(served=False, frontend=0.0)
    inproc = _probe(served=False, frontend=FE)  # a measured term, but in process: not added
    served = _probe(served=True, frontend=FE)
    for a, b, c in zip(base.records, inproc.records, served.records):
        assert b.token_times == a.token_times
        assert c.ttft == pytest.approx(a.ttft + FE, abs=1e-12)
        assert np.diff(c.token_times) == pytest.approx(np.diff(a.token_times), abs=1e-12)  # TBT unchanged
    assert served.summary.overall.ttft_mean == pytest.approx(base.summary.overall.ttft_mean + FE)
    none = _probe(served=True, frontend=0.0)  # served, nothing measured: the same as in process
    assert [r.token_times for r in none.records] == [r.token_times for r in base.records]


def test_profile_file_keeps_the_measured_frontend_term(tmp_path):
    rng = np.random.default_rng(0)
    s = [StatelessSample(n, 2e-4 + 3e-6 * n) for n in range(1, 120)]
    s += [EmbedSample(n, 1e-5 + 1e-8 * n) for n in (1, 8, 64)]
    s += [HeadSample(r, 5e-4 + 2e-5 * r) for r in range(1, 33)]
    for b in (1, 2, 4, 8, 16):
        c = tuple(int(x) for x in rng.integers(2, 1000, b))
        s.append(AttentionSample((1,) * b, c, 1e-5 + 2e-7 * sum(c)))
    s += [AttentionSample((q,), (q,), 1e-5 + 4e-6 * q) for q in (16, 64, 256)]
    m = fit(s, num_layers=N)
    assert m.frontend_ttft_s == 0.0  # not measured by the profiler
    m.frontend_ttft_s = FE
    back = type(m).load(m.save(tmp_path / "p.json"))
    assert back.frontend_ttft_s == FE
    assert back.refit().frontend_ttft_s == FE
    doc = m.to_dict()
    del doc["model"]["frontend_ttft_s"]  # a profile from before the term: 0.0
    assert type(m).from_dict(doc).frontend_ttft_s == 0.0
    # the online calibration scales engine compute, not the front end
    assert ScaledLatencyModel(back, factor=2.0).frontend_ttft_s == FE
    assert CalibratedLatencyModel(back).frontend_ttft_s == FE


def test_admission_predicts_the_served_ttft_with_the_frontend_term():
    chat = SLO(ttft=1.0, tbt=0.4, name="chat")
    preds = []
    for fe in (0.0, FE):
        qa = QueueAwareAdmission(_lm(fe))
        e = qa.entry(500, 0.0, chat)
        preds.append(qa.predict(e, 0.0, 0.0))
    assert preds[1] == pytest.approx(preds[0] + FE, abs=1e-12)


def test_server_reports_the_engine_ttft_and_the_frontend_is_measured(tiny_llama):
    import httpx

    from laser.bench.frontend_cost import frontend_sample, measure_frontend_ttft
    from laser.frontend.async_engine import AsyncEngine
    from laser.frontend.engine import Engine
    from laser.server.app import build_app
    from laser.server.cli import LiveServer

    engine = Engine(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=256)
    live = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))
    url = live.url
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 3,
                                                      "temperature": 0.0, "ignore_eos": True}, timeout=60)
        slo = r.json()["slo"]
        assert 0.0 < slo["engine_ttft_ms"] <= slo["ttft_ms"]  # from the engine's add, not the HTTP arrival
        with httpx.Client(timeout=60) as c:
            x = frontend_sample(c, url, "tiny")
        assert x is not None
        fe = measure_frontend_ttft(url, "tiny", n=3)
        assert fe is not None and fe >= 0.0
    finally:
        live.stop()


def test_sim_target_describes_its_frontend():
    assert SimTarget("vllm", _lm(FE), N, served=True).describe()["frontend_ttft_s"] == FE
    assert SimTarget("vllm", _lm(FE), N).describe()["frontend_ttft_s"] == 0.0


def test_a_served_twin_takes_the_front_end_its_run_measured_under_load():
    base = _probe(served=False, frontend=0.0)
    reqs = [WorkloadRequest("chat", "x", 40, 6, 0.0) for _ in range(8)]
    slos = SLOClasses({"chat": {"ttft": 0.5, "tbt": 0.2}})
    loaded = 3 * FE
    for served, override, added in ((True, loaded, loaded), (True, None, FE), (False, loaded, 0.0)):
        tgt = SimTarget("vllm", _lm(FE), N, SchedulerConfig(policy="vllm"), served=served,
                        frontend_override_s=override)
        assert tgt.frontend_s() == added and tgt.describe()["frontend_ttft_s"] == added
        got = Benchmark({"t": tgt}, reqs, slos, seed=3).probe("t", 20.0, early_stop=False)
        for a, c in zip(base.records, got.records):
            assert c.ttft == pytest.approx(a.ttft + added, abs=1e-12)
