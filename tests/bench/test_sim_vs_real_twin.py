"""benchmarks/sim_vs_real.py's machine twin: a real run is also compared with its simulation on the
machine as the run measured it (laser.latency.machine_speed). Here the "real" engine is itself a
simulation on a machine 0.8x / 1.2x its profile (decode / prefill) planned by the online
calibration, so its twin must match it request for request, while the plain simulation (the
profile as is) does not."""

import importlib.util
import types
from pathlib import Path

import pytest

from laser.bench.runner import Benchmark
from laser.bench.sim_target import SimTarget
from laser.bench.workloads import WorkloadRequest
from laser.core.slo import SLOClasses
from laser.instance.model_instance import planning_model
from laser.latency import SimpleLatencyModel
from laser.latency.machine_speed import KindScaledLatencyModel

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5)


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class SimulatedEngine(SimTarget):
    """A stand-in for the in-process engine: a simulation whose machine differs from its profile,
    with the engine's ``core.step_log`` (filled from the simulated instance's own log)."""

    def __init__(self):
        super().__init__("laser", LM, N, label="inprocess", machine_model=KindScaledLatencyModel(LM, 0.8, 1.2),
                         planner=planning_model)
        stats = types.SimpleNamespace(steps=0, schedule_s=0.0)
        self.engine = types.SimpleNamespace(core=types.SimpleNamespace(step_log=None, step_stats=stats),
                                            model_config=types.SimpleNamespace(num_layers=N))

    def _sim(self, role, icache):
        self._inst = super()._sim(role, icache)
        self._inst.step_log = []
        return self._inst

    def run(self, *a, **kw):
        out = super().run(*a, **kw)
        if self.engine.core.step_log is not None:
            self.engine.core.step_log.extend(self._inst.step_log)
        return out


def _workload():
    """20 chat/code requests of 8-68 prompt tokens, 8 output tokens each, and their SLO classes."""
    reqs = [WorkloadRequest(("chat", "code")[i % 2], "x", 8 + 30 * (i % 3), 8, 0.0) for i in range(20)]
    return reqs, SLOClasses({"chat": {"ttft": 0.2, "tbt": 0.02}, "code": {"ttft": 0.1, "tbt": 0.02}})


def test_the_twin_matches_a_run_on_a_machine_that_drifted_from_its_profile():
    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    runs = {"sim": SimTarget("laser", LM, N, label="sim"), "inprocess": SimulatedEngine(),
            "sim@m": SimTarget("laser", LM, N, label="sim@m", planner=planning_model)}
    both = Benchmark(runs, reqs, slos, seed=7)
    lines, rec = svr.compare_at(both, runs, {"inprocess": "sim"}, 50.0, 1.0, None, ["chat", "code"], LM)
    speed = rec["machine_speed"]
    assert speed["decode_factor"] == pytest.approx(0.8) and speed["other_factor"] == pytest.approx(1.2)
    twin, plain = rec["inproc@m"]["requests"], rec["inprocess"]["requests"]
    assert all(r["a"]["ttft"] == pytest.approx(r["b"]["ttft"]) and r["a"]["tpot"] == pytest.approx(r["b"]["tpot"])
               for r in twin)
    assert any(r["a"]["ttft"] != pytest.approx(r["b"]["ttft"]) for r in plain)
    assert runs["inprocess"].engine.core.step_log is None  # switched off after the run
    assert any("inproc@m" in ln for ln in lines) and any("decode x0.800" in ln for ln in lines)


class SimulatedServer(SimulatedEngine):
    """A stand-in for ``laser serve``: a simulation on a machine that ran at 0.7x / 1.3x its
    profile (another speed than the in-process run's), its steps read back as through
    ``GET /engine/steps`` (:meth:`laser.bench.serve_proc.Server.engine_steps`)."""

    def __init__(self):
        super().__init__()
        self.label = "serve"
        self.machine_model = KindScaledLatencyModel(LM, 0.7, 1.3)
        self.engine.core.step_log = []  # the server keeps its log on
        self.server = self

    def engine_steps(self, since=None):
        log = self.engine.core.step_log
        thread = {"steps": len(log), "step_s": 0.0, "step_cpu_s": 0.0, "between_s": 0.0}
        return {"total": len(log), "steps": [] if since is None else log[since:],
                "step_stats": {"steps": len(log), "schedule_s": 0.0}, "engine_thread": thread}

    def metric(self, names, **labels):
        return None


def test_the_served_twin_runs_at_the_served_engines_own_speed():
    # in process at 0.8x / 1.2x, served at 0.7x / 1.3x: each twin must be its own run's machine
    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    runs = {"sim": SimTarget("laser", LM, N, label="sim"), "inprocess": SimulatedEngine(),
            "sim@m": SimTarget("laser", LM, N, label="sim@m", planner=planning_model), "serve": SimulatedServer(),
            "sim-served": SimTarget("laser", LM, N, label="sim-served", served=True),
            "sim-served@m": SimTarget("laser", LM, N, label="sim-served@m", served=True, planner=planning_model)}
    both = Benchmark(runs, reqs, slos, seed=7)
    lines, rec = svr.compare_at(both, runs, {"inprocess": "sim", "serve": "sim-served"}, 50.0, 1.0, None,
                                ["chat", "code"], LM)
    served = rec["machine_speed_served"]
    assert served["decode_factor"] == pytest.approx(0.7) and served["other_factor"] == pytest.approx(1.3)
    assert rec["machine_speed"]["decode_factor"] == pytest.approx(0.8)
    twin = rec["serve@m"]["requests"]
    assert all(r["a"]["ttft"] == pytest.approx(r["b"]["ttft"]) and r["a"]["tpot"] == pytest.approx(r["b"]["tpot"])
               for r in twin)
    assert any("serve@m: serve beside its twin" in ln and "decode x0.700" in ln for ln in lines)


def test_the_loaded_front_end_is_the_clients_ttft_over_the_engines():
    """Per class (count n, server sums: TTFT from HTTP arrival, HTTP arrival -> the engine has it)
    and the client's mean TTFT: the front end under load is the client's TTFT minus the engine's
    own, weighted by count; classes without first tokens, or whose counts disagree, are left out."""
    svr = _load("sim_vs_real")

    class _Cls:
        def __init__(self, ttft_mean):
            self.ttft_mean = ttft_mean

    probe = types.SimpleNamespace(summary=types.SimpleNamespace(per_class={
        "chat": _Cls(0.110), "code": _Cls(0.220), "summarization": _Cls(None), "other": _Cls(0.5)}))
    before = {"chat": (1.0, 10, 0.05, 10, 0.0, 0)}
    after = {"chat": (1.0 + 3 * 0.100, 13, 0.05 + 3 * 0.004, 13, 0.0, 0),  # engine 0.096 s: +0.014 s a request
             "code": (0.200, 1, 0.002, 1, 0.0, 0),  # engine 0.198 s: +0.022 s
             "summarization": (0.0, 0, 0.0, 0, 0.0, 0),  # no first token
             "other": (0.4, 1, 0.0, 0, 0.0, 0)}  # no front-end sample: left out
    assert svr.loaded_frontend(before, after, probe) == pytest.approx((3 * 0.014 + 0.022) / 4)
    assert svr.loaded_frontend({}, {"summarization": (0.0, 0, 0.0, 0, 0.0, 0)}, probe) is None


def test_the_served_ttft_line_names_the_wait_for_the_handler():
    svr = _load("sim_vs_real")
    probe = types.SimpleNamespace(summary=types.SimpleNamespace(per_class={"chat": types.SimpleNamespace(ttft_mean=0.110)}))
    after = {"chat": (0.300, 3, 0.030, 3, 0.003, 3, 0.012, 3)}  # sums and counts: TTFT, to the engine, back, handler
    line = svr.server_ttft_line({}, after, probe)
    assert "chat 100 / 110 (4.0 to the handler, 10.0 to the engine, 1.0 back)" in line
    old = {"chat": (0.300, 3, 0.030, 3, 0.003, 3, 0.0, 0)}  # a server without the handler's histogram
    assert "chat 100 / 110 (10.0 to the engine, 1.0 back)" in svr.server_ttft_line({}, old, probe)


def test_the_simulator_on_the_machine_a_first_run_measured_matches_the_engine_on_it(capsys):
    """``--sim-machine measured``: a first run measures the machine (0.8x / 1.2x its profile, no
    scatter); the simulator put on that machine (planned as the engine plans) then matches a later
    run of the engine request for request, where the profile as is does not."""
    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    real = SimulatedEngine()
    a = types.SimpleNamespace(seed=7, probe_timeout=None, speed_fraction=0.8, knee=None)
    speed, fe = svr.start_speed(a, real, LM, reqs, slos, 40.0, "0.8x the knee on the profile as is")
    assert fe is None  # (in process: no front end)
    assert speed.decode_factor == pytest.approx(0.8) and speed.other_factor == pytest.approx(1.2)
    assert speed.decode_jitter[0] == pytest.approx(1.0) and speed.decode_jitter[-1] == pytest.approx(1.0)
    assert real.engine.core.step_log is None  # switched off after the run
    out = capsys.readouterr().out
    assert "the machine now: a first in-process run at 40.000 req/s" in out and "decode x0.800" in out
    sim, plain = SimTarget("laser", LM, N, label="sim"), SimTarget("laser", LM, N, label="plain")
    svr.on_machine(sim, speed, LM, 7, planning_model)
    assert sim.planner is planning_model and sim.machine_model.seed == 7
    runs = {"sim": sim, "plain": plain, "inprocess": real}
    both = Benchmark(runs, reqs, slos, seed=7)
    lines, rec = svr.compare_at(both, runs, {"inprocess": "sim"}, 50.0, 1.0, None, ["chat", "code"], LM, draws=3)
    rows = rec["inprocess"]["requests"]
    assert len(rec["sim_draws"]["sim"]) == 3 and sim.machine_model.seed == 7  # (seed restored)
    assert any(ln.startswith("  sim over 3 draws of its machine's scatter") and "inprocess +0.0 pts" in ln
               for ln in lines)
    assert rows and all(r["a"]["ttft"] == pytest.approx(r["b"]["ttft"]) and r["a"]["tpot"] == pytest.approx(r["b"]["tpot"])
                        for r in rows)
    _, rec = svr.compare_at(both, runs, {"inprocess": "plain"}, 50.0, 1.0, None, ["chat", "code"], LM)
    assert any(r["a"]["ttft"] != pytest.approx(r["b"]["ttft"]) for r in rec["inprocess"]["requests"])


def test_the_served_first_run_measures_the_served_engines_own_machine(capsys):
    """The served simulation's machine is measured on ``laser serve`` itself (its step log), not
    taken from the in-process run: here the server runs at 0.7x / 1.3x, the in-process engine at
    0.8x / 1.2x."""
    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    a = types.SimpleNamespace(seed=7, probe_timeout=None, speed_fraction=0.8, knee=12.5)
    served, _ = svr.start_speed(a, SimulatedServer(), LM, reqs, slos, 10.0, "0.8x the knee given")
    assert served.decode_factor == pytest.approx(0.7) and served.other_factor == pytest.approx(1.3)
    again, _ = svr.start_speed(a, SimulatedEngine(), LM, reqs, slos, 10.0, "0.8x the knee on the machine as measured",
                               True)
    assert again.decode_factor == pytest.approx(0.8)
    out = capsys.readouterr().out
    assert "a first served run at 10.000 req/s (0.8x the knee given" in out
    assert "a second in-process run at 10.000 req/s (0.8x the knee on the machine as measured" in out


def test_the_simulated_scatter_is_drawn_again_per_seed_and_the_seed_restored():
    from laser.latency.machine_speed import JitteredLatencyModel

    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    machine = JitteredLatencyModel(KindScaledLatencyModel(LM, 1.0, 1.0), (0.4, 2.5), seed=11)
    both = Benchmark({"sim": SimTarget("laser", LM, N, label="sim", machine_model=machine, planner=planning_model),
                      "plain": SimTarget("laser", LM, N, label="plain")}, reqs, slos, seed=7)
    draws = svr.scatter_draws(both, "sim", 400.0, 4)
    assert len(draws) == 4 and machine.seed == 11
    assert len({tuple(sorted(d.items())) for d in draws}) > 1  # other seeds, other machines
    assert svr.scatter_draws(both, "sim", 400.0, 4) == draws  # and the same ones again
    assert svr.scatter_draws(both, "plain", 400.0, 4) is None and svr.scatter_draws(both, "sim", 400.0, 1) is None


class MeteredServer(SimulatedServer):
    """A served stand-in whose /metrics say the engine had each first token 6 ms before the client
    did (the front end under load)."""

    def __init__(self):
        super().__init__()
        self.sums = {}

    def run(self, requests, slos, **kw):
        out = super().run(requests, slos, **kw)
        for r in out.records:
            if r.ttft is not None:
                s = self.sums.setdefault(r.slo_class, [0.0, 0])
                s[0] += r.ttft - 0.006
                s[1] += 1
        return out

    def metric(self, names, **labels):
        s = self.sums.get(labels.get("slo_class"), [0.0, 0])
        name = names[0]
        if name == "laser:time_to_first_token_seconds_sum":
            return s[0]
        if name.endswith("_count") and ("time_to_first" in name or "request_frontend" in name):
            return s[1]
        return 0.0


def test_the_served_first_run_also_measures_its_front_end_under_load(capsys):
    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    a = types.SimpleNamespace(seed=7, probe_timeout=None, speed_fraction=0.8, knee=12.5)
    speed, fe = svr.start_speed(a, MeteredServer(), LM, reqs, slos, 10.0, "1x the knee given")
    assert speed.decode_factor == pytest.approx(0.7) and fe == pytest.approx(0.006)
    assert "its front end under that load 6.0 ms a TTFT" in capsys.readouterr().out


def test_the_draws_line_gives_mean_range_and_the_real_runs_points():
    svr = _load("sim_vs_real")
    real = types.SimpleNamespace(attainment=0.95, class_attainment=lambda: {"chat": 0.95})
    line = svr.draws_line("sim", [{"chat": 0.8, "all": 0.8}, {"chat": 1.0, "all": 0.9}], "inprocess", real)
    assert line == ("  sim over 2 draws of its machine's scatter, mean (min-max): chat 0.900 (0.800-1.000, "
                    "inprocess +5.0 pts); all 0.850 (0.800-0.900, inprocess +10.0 pts)")


@pytest.mark.parametrize("case", ["profile", "past", "past-no-steps", "below", "no-steps", "given"])
def test_the_knee_is_searched_on_the_machine_the_first_runs_measured(monkeypatch, case):
    """``knee_on_machine``: which runs and searches happen, and on which machine the simulator ends."""
    svr = _load("sim_vs_real")
    first, second = object(), object()
    calls = []

    def knee(a, sim, requests, slos, where=""):
        calls.append(("knee", where, sim.machine))
        return {None: 5.0, first: 3.5 if case != "below" else 6.5, second: 4.2}[sim.machine]

    def speed(a, real, profile, requests, slos, rate, basis, again=False, fallback="the profile as is"):
        calls.append(("run", round(rate, 6), basis, again, fallback))
        if case == "no-steps" or (again and case == "past-no-steps"):
            return None, None
        return (second if again else first), None

    def on(target, sp, profile, seed, planner, frontend_s=None):
        target.machine = sp

    monkeypatch.setattr(svr, "simulated_knee", knee)
    monkeypatch.setattr(svr, "start_speed", speed)
    monkeypatch.setattr(svr, "on_machine", on)
    a = types.SimpleNamespace(sim_machine="profile" if case == "profile" else "measured", speed_fraction=0.8,
                              knee=3.0 if case == "given" else None, seed=7)
    sim = types.SimpleNamespace(machine=None)
    k, start = svr.knee_on_machine(a, sim, "real", "profile", [], None, "planner")
    if case == "profile":
        assert (k, start, calls) == (5.0, None, [("knee", "", None)])
    runs = [c for c in calls if c[0] == "run"]
    if case == "past":  # the first run at 0.8 x 5.0 = 4.0 req/s, past the 3.5 it then finds: again at 2.8
        assert k == 4.2 and start is second and sim.machine is second
        assert runs == [("run", 4.0, "0.8x the knee on the profile as is", False, "the profile as is"),
                        ("run", 2.8, "0.8x the knee on the machine as measured", True, "the first run's machine")]
        assert [c[1] for c in calls if c[0] == "knee"] == ["on the profile as is", "on the machine as measured",
                                                            "on the machine as measured"]
    if case == "past-no-steps":  # the second run measured nothing: the first run's machine and knee stay
        assert k == 3.5 and start is first and sim.machine is first and len(runs) == 2
    if case == "below":  # the first run was below the knee it found: no second run
        assert k == 6.5 and start is first and len(runs) == 1
    if case == "no-steps":  # no machine measured: the profile as is and its knee, not searched again
        assert k == 5.0 and start is None and sim.machine is None and len(runs) == 1
        assert [c for c in calls if c[0] == "knee"] == [("knee", "on the profile as is", None)]
    if case == "given":
        assert k == 3.0 and start is first and not [c for c in calls if c[0] == "knee"]
        assert runs == [("run", 2.4, "0.8x the knee given", False, "the profile as is")]


def test_a_served_simulation_put_on_a_measured_machine_takes_its_loaded_front_end():
    svr = _load("sim_vs_real")
    reqs, slos = _workload()
    a = types.SimpleNamespace(sim_machine="measured", seed=7, probe_timeout=None, speed_fraction=0.8, knee=10.0)
    sim = SimTarget("laser", LM, N, label="sim-served", served=True)
    k, speed = svr.knee_on_machine(a, sim, MeteredServer(), LM, reqs, slos, planning_model)
    assert k == 10.0 and speed.decode_factor == pytest.approx(0.7)
    assert sim.frontend_s() == pytest.approx(0.006) and sim.planner is planning_model
    plain = SimTarget("laser", LM, N, label="sim")
    svr.on_machine(plain, speed, LM, 7, planning_model, 0.006)
    assert plain.frontend_s() == 0.0  # (in process: no front end)
