"""Cluster simulator scale and controller decision cost (SIMULATED; wall time measured).

1. Wall time to simulate N requests on a 16P16D cluster of Qwen2.5-14B shapes
   (A100-80GB analytic latency model) with the ``laser`` controller, Table 1 length
   means, 1:1:1 mix, Poisson arrivals at ``--rate`` req/s; extrapolated linearly to
   100,000 requests (the issue's target: < 60 s).
2. The controller's own decision time per request (wall time of ``route`` and the
   hand-off re-check, no message delays) vs the number of instances (half prefill, half
   decode), at a fixed load per instance. Paper Fig. 11b: prefill selection < 2 ms,
   decode dispatch ~10 ms including messaging, flat from 2 to 16 instances.

Usage: python benchmarks/sim_scale.py [--requests 2000] [--instances 2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from laser.request import SLO, Request, SamplingParams
from laser.sim.cluster import ClusterSim, ClusterSpec, paper_config

CLASSES = [("chat", 350.9, 187.9, 0.25, 0.1), ("code", 201.5, 105.2, 0.125, 0.05),
           ("summarization", 2084.5, 95.7, 2.0, 0.2)]


def workload(n: int, rate: float, seed: int = 0) -> list[Request]:
    """Poisson arrivals; lognormal lengths (sigma 0.5) with Table 1 means; 1:1:1 mix."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        name, p, o, ttft, tbt = CLASSES[i % 3]
        lp = max(1, round(rng.lognormvariate(0, 0.5) * p / 1.1331))  # E[lognormal(0, .5)] = 1.1331
        lo = max(1, round(rng.lognormvariate(0, 0.5) * o / 1.1331))
        out.append(Request([1] * lp, SamplingParams(max_tokens=lo, ignore_eos=True), SLO(ttft, tbt, name),
                           arrival_time=t, req_id=f"r{i}"))
    return out


def scale_run(n: int, rate: float, spec: str) -> dict:
    cfg = paper_config("qwen2.5-14b", "a100")
    sim = ClusterSim("laser", ClusterSpec.parse(spec), cfg)
    reqs = workload(n, rate)
    res = sim.run(reqs)
    met = sum(1 for r in res.requests if r.first_token_time - r.arrival_time <= r.slo.ttft)
    return {"n": n, "wall_s": res.wall_s, "events": res.events, "decision_ms": 1e3 * res.decision_wall_s / n,
            "sim_s": max(r.finish_time for r in res.requests), "ttft_met": met / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests of the 16P16D run")
    ap.add_argument("--rate", type=float, default=40.0, help="req/s of the 16P16D run")
    ap.add_argument("--instances", default="2,4,8,16,32", help="instance counts of the decision-time sweep")
    ap.add_argument("--per-instance-rate", type=float, default=2.0, help="req/s per instance in the sweep")
    ap.add_argument("--sweep-requests", type=int, default=300)
    a = ap.parse_args()
    print(f"SIMULATED cluster (Qwen2.5-14B shapes, A100-80GB analytic model); wall times measured on "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    r = scale_run(a.requests, a.rate, "16P16D")
    per = r["wall_s"] / r["n"]
    print(f"16P16D laser: {r['n']} requests ({r['sim_s']:.0f} simulated s, {r['events']} events) in "
          f"{r['wall_s']:.1f} s wall = {per * 1e3:.2f} ms/request -> 100k requests ~ {per * 1e5:.0f} s "
          f"(linear extrapolation); TTFT met {r['ttft_met']:.3f}")
    print(f"{'instances':>9} {'P/D':>7} {'decision ms/req':>16} {'wall s':>7}")
    for k in (int(x) for x in a.instances.split(",")):
        spec = f"{max(1, k // 2)}P{max(1, k - k // 2)}D"
        r = scale_run(a.sweep_requests, a.per_instance_rate * k, spec)
        print(f"{k:>9} {spec:>7} {r['decision_ms']:>16.3f} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t:.0f} s")
