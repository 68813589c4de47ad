"""How well does a queue-time model predict TTFT? (issue 27 item 4; SIMULATED, virtual time.)

At every arrival the queue-time models predict the newcomer's TTFT from the instance's state then;
the simulator then runs on and gives the truth (its first token time minus its arrival). Two
settings, each on Table-1-like Poisson workloads (lognormal lengths; chat, code, summarization,
1:1:1) on the A100 analytic model of Qwen2.5-14B:

* ``inproc``: one mixed instance (what in-process admission predicts), policies laser / sarathi /
  vllm; the prediction is made when the arrival is released to the scheduler, with the rest of the
  running step priced as the previous step's duration (as the engine thread's snapshot does).
* ``cluster``: the Laser controller's 2P2D cluster (its prefill instances run laser, or sarathi as in
  Fig. 8's ablation); the prediction is made for the prefill instance the controller routed the
  request to, from that instance's report (its step end is known).

Plus bursts: the admission test's (40 chat requests of 1,000 tokens 0.1 ms apart, TTFT 1 s, on
a small 8-layer model, in process) and 40 / 200 of them 0.1 / 1 ms apart on the cluster.

Models (:mod:`laser.scheduler.ttft`): ``chunked`` (each prefill ahead in chunks of the token
budget, stretched by decode's share of the machine) and ``merged`` (the queue drains as one
merged batch growing in queue order; a later entry never delays an earlier one). Prints, per
setting, policy and model: the mean and median absolute error and the mean signed error
(+ = predicted late), in milliseconds; the share within 20 % of the truth; as an admission
decision against the request's TTFT target, the share decided right and the false admits.

    python benchmarks/ttft_predictors.py [--requests 300] [--rates 2,4,8]
"""

from __future__ import annotations

import argparse
import statistics

from laser.bench.cluster import table1_requests
from laser.core.config import SchedulerConfig
from laser.core.request import SLO, Request, SamplingParams
from laser.scheduler import ttft
from laser.sim.cluster import ClusterSim, ClusterSpec, paper_config
from laser.sim.instance import SimInstance


class RecordingInstance(SimInstance):
    """A mixed instance that predicts each arrival's TTFT with every model just before the
    scheduler gets it."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.predictions: dict[str, dict[str, float]] = {}
        self.step_start, self.last_step_s = 0.0, 0.0

    def step(self):
        self.step_start = self.clock.t
        out = super().step()
        self.last_step_s = self.clock.t - self.step_start
        return out

    def _release(self) -> None:
        t = self.clock.t
        while self._arrivals and self._arrivals[0].arrival_time <= t:
            req = self._arrivals[0]
            rep = self.scheduler.report(t)
            start = max(t, self.step_start + self.last_step_s) if rep.busy else t
            entry = rep.entry(req.num_prompt_tokens, req.arrival_time, req.slo)
            self.predictions[req.req_id] = {
                m: ttft.predict_ttft(rep, entry, self.lm, start, req.arrival_time, model=m) for m in ttft.MODELS}
            self.add_request(self._arrivals.pop(0))
        super()._release()


def run_inproc(policy: str, reqs: list[Request], lm, num_blocks: int) -> list[tuple[float, dict[str, float]]]:
    sim = RecordingInstance(policy, lm.num_layers, lm, SchedulerConfig(), num_blocks=num_blocks)
    for r in reqs:
        sim.submit(r)
    sim.run()
    return [(r.first_token_time - r.arrival_time, sim.predictions[r.req_id], r.slo.ttft) for r in sim.finished
            if r.first_token_time is not None]


def burst(n: int = 40, gap_s: float = 1e-4) -> list[Request]:
    """The admission test's burst (tests/frontend/test_admission.py): ``n`` chat requests of 1,000
    tokens, 16 output tokens, ``gap_s`` apart (TTFT 1 s, TBT 0.4 s)."""
    slo = SLO(1.0, 0.4, "chat")
    return [Request([7] * 1000, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), slo, i * gap_s,
                    req_id=f"b{i}") for i in range(n)]


def run_cluster(reqs: list[Request], cfg, prefill_policy: str = "laser") -> list[tuple[float, dict[str, float]]]:
    from laser.controller.laser import LaserController

    sim = ClusterSim(LaserController(prefill_policy=prefill_policy), ClusterSpec.parse("2P2D"), cfg)
    ctl = sim.controller
    preds: dict[str, dict[str, float]] = {}
    route = ctl.route

    def recording_route(info, now):
        r = route(info, now)
        p = ctl.instances[r.prefill]
        rep = p.report()
        entry = rep.scheduler.entry(info.prompt_len, info.arrival_time,
                                    SLO(None, info.tbt) if r.demoted else SLO(info.ttft, info.tbt), r.demoted)
        start = max(now, rep.busy_until)
        preds[info.req_id] = {m: ttft.predict_ttft(rep.scheduler, entry, p.latency_model, start, info.arrival_time,
                                                   model=m) for m in ttft.MODELS}
        return r

    ctl.route = recording_route
    res = sim.run(reqs)
    return [(r.first_token_time - r.arrival_time, preds[r.req_id], r.slo.ttft) for r in res.requests
            if r.first_token_time is not None]


def summarize(rows: list[tuple[float, dict[str, float], float]]) -> dict[str, dict[str, float]]:
    """Per model: mean / median absolute error (ms), mean signed error (ms), share within 20 %,
    and as an admission decision against each request's TTFT target: the share decided right
    (predicted within target == met it) and the false admits (predicted within, missed)."""
    out = {}
    for m in ttft.MODELS:
        err = [p[m] - t for t, p, _ in rows]
        out[m] = {"mae_ms": 1e3 * statistics.fmean(abs(e) for e in err),
                  "median_ae_ms": 1e3 * statistics.median(abs(e) for e in err),
                  "bias_ms": 1e3 * statistics.fmean(err),
                  "within20": statistics.fmean(abs(p[m] - t) <= 0.2 * t for t, p, _ in rows),
                  "right": statistics.fmean((p[m] <= d) == (t <= d) for t, p, d in rows),
                  "false_admit": statistics.fmean(p[m] <= d < t for t, p, d in rows)}
    return out


def _print(setting: str, policy: str, rate: str, rows) -> None:
    for m, st in summarize(rows).items():
        print(f"{setting:>16} {policy:>8} {rate:>6} {m:>8} {len(rows):4d} {st['mae_ms']:8.1f} "
              f"{st['median_ae_ms']:9.1f} {st['bias_ms']:8.1f} {st['within20']:6.1%} {st['right']:6.1%} "
              f"{st['false_admit']:7.1%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rates", default="2,4,8", help="in-process arrival rates, req/s (the cluster: 4x)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="laser,sarathi,vllm", help="in-process policies")
    ap.add_argument("--cluster-policies", default="laser,sarathi",
                    help="the prefill instances' policy of the Laser controller's cluster (Fig. 8: sarathi)")
    args = ap.parse_args()
    from laser.latency import SimpleLatencyModel

    cfg = paper_config("qwen2.5-14b", "a100")
    small = SimpleLatencyModel(num_layers=8, per_layer=2e-3, per_token=1.2e-5, per_context=1e-8)
    print(f"{'setting':>16} {'policy':>8} {'rate':>6} {'model':>8} {'n':>4} {'MAE ms':>8} {'medAE ms':>9} "
          f"{'bias ms':>8} {'<=20%':>6} {'right':>6} {'f.admit':>7}")
    for p in args.policies.split(","):
        _print("inproc-burst", p, "-", run_inproc(p, burst(), small, 20000))
    for p in args.cluster_policies.split(","):
        for n, gap in ((40, 1e-4), (200, 1e-3)):
            _print(f"cluster-burst{n}", p, "-", run_cluster(burst(n, gap), cfg, p))
    for rate in (float(x) for x in args.rates.split(",")):
        for p in args.policies.split(","):
            _print("inproc", p, f"{rate:g}", run_inproc(p, table1_requests(args.requests, rate, args.seed), cfg.latency_model,
                                                       cfg.num_blocks))
        for p in args.cluster_policies.split(","):
            _print("cluster", p, f"{4 * rate:g}", run_cluster(table1_requests(args.requests, 4 * rate, args.seed), cfg, p))


if __name__ == "__main__":
    main()
