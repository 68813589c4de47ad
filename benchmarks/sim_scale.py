"""Cluster simulator scale and controller decision cost (SIMULATED; wall time measured).

1. Wall time to simulate N requests on a 16P16D cluster of Qwen2.5-14B shapes
   (A100-80GB analytic latency model) with the ``laser`` controller, Table 1 length
   means, 1:1:1 mix, Poisson arrivals at ``--rate`` req/s; extrapolated linearly to
   100,000 requests (the issue's target: < 60 s).
2. The controller's own decision time per request (wall time of ``route`` and the
   hand-off re-check, no message delays) vs the number of instances (half prefill, half
   decode), at a fixed load per instance. Paper Fig. 11b: prefill selection < 2 ms,
   decode dispatch ~10 ms including messaging, flat from 2 to 16 instances.

3. ``--baseline-rev REV``: the same 16P16D run on the code of git revision ``REV`` (exported
   with ``git archive``) and on this tree, alternately in fresh processes (``--pairs`` times):
   wall and CPU time (``time.process_time``) per request of each and their ratio, and whether
   every request's times are bit-identical (a SHA-256 digest of each run's per-request
   first-token, token and finish times). CPU time is the steadier figure on a shared machine.

   The sweep also times the two halves apart: prefill selection (§7.1) and Alg. 2's decode
   assignment (§7.2.1), each in ms per request.

Usage: python benchmarks/sim_scale.py [--requests 2000] [--instances 2,4,8,16,32]
       python benchmarks/sim_scale.py --baseline-rev main --requests 1000 --pairs 3 --instances ""
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from laser.bench.cluster import table1_requests
from laser.sim.cluster import ClusterSim, ClusterSpec, paper_config


def _time_parts(ctl, names: tuple[str, ...]) -> dict[str, float]:
    """Wrap the controller's methods ``names`` with wall-time accumulators (seconds, per name)."""
    acc = dict.fromkeys(names, 0.0)
    for name in names:
        def timed(*a, _f=getattr(ctl, name), _n=name, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                acc[_n] += time.perf_counter() - t
        setattr(ctl, name, timed)
    return acc


def scale_run(n: int, rate: float, spec: str, parts: bool = False) -> dict:
    """``parts``: also time the prefill selection (§7.1) and Alg. 2's decode assignment apart
    (ms per request; the decode part includes re-assignments at the hand-off)."""
    cfg = paper_config("qwen2.5-14b", "a100")
    sim = ClusterSim("laser", ClusterSpec.parse(spec), cfg)
    acc = _time_parts(sim.controller, ("select_prefill", "assign_decode")) if parts else {}
    reqs = table1_requests(n, rate)
    cpu = time.process_time()
    res = sim.run(reqs)
    cpu = time.process_time() - cpu
    met = sum(1 for r in res.requests if r.first_token_time - r.arrival_time <= r.slo.ttft)
    h = hashlib.sha256()
    for r in res.requests:
        h.update(repr((r.req_id, r.first_token_time, tuple(r.token_times), r.finish_time, r.finish_reason,
                       r.demoted)).encode())
    return {"n": n, "wall_s": res.wall_s, "cpu_s": cpu, "events": res.events,
            "decision_ms": 1e3 * res.decision_wall_s / n, "sim_s": max(r.finish_time for r in res.requests),
            "ttft_met": met / n, "digest": h.hexdigest()[:16],
            **{f"{k}_ms": 1e3 * v / n for k, v in acc.items()}}


def _child_run(tree: Path, n: int, rate: float) -> dict:
    """:func:`scale_run` of 16P16D in a fresh process importing ``laser`` from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, "--child", str(n), str(rate)], env=env, cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))


def compare(rev: str, n: int, rate: float, pairs: int) -> None:
    """Baseline (git ``rev``) vs this tree, alternately, ``pairs`` times (see the module doc)."""
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(here), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        print(f"16P16D laser, {n} requests at {rate:g} req/s: baseline {rev} vs this tree, {pairs} pair(s)")
        print(f"{'pair':>4} {'base wall ms/req':>17} {'new wall ms/req':>16} {'base CPU ms/req':>16} "
              f"{'new CPU ms/req':>15} {'CPU ratio':>9}  identical")
        tot = {"bw": 0.0, "nw": 0.0, "bc": 0.0, "nc": 0.0}
        same = True
        for k in range(1, pairs + 1):
            b, a = _child_run(Path(tmp), n, rate), _child_run(here, n, rate)
            same &= b["digest"] == a["digest"]
            for key, v in (("bw", b["wall_s"]), ("nw", a["wall_s"]), ("bc", b["cpu_s"]), ("nc", a["cpu_s"])):
                tot[key] += v
            print(f"{k:>4} {1e3 * b['wall_s'] / n:>17.2f} {1e3 * a['wall_s'] / n:>16.2f} {1e3 * b['cpu_s'] / n:>16.2f} "
                  f"{1e3 * a['cpu_s'] / n:>15.2f} {b['cpu_s'] / a['cpu_s']:>8.2f}x  {b['digest'] == a['digest']}")
        m = 1e3 / (n * pairs)
        print(f"mean {tot['bw'] * m:>17.2f} {tot['nw'] * m:>16.2f} {tot['bc'] * m:>16.2f} {tot['nc'] * m:>15.2f} "
              f"{tot['bc'] / tot['nc']:>8.2f}x  {same}")
        print(f"wall ratio {tot['bw'] / tot['nw']:.2f}x; this tree extrapolated to 100k requests: "
              f"{tot['nw'] * m * 100:.0f} s wall, {tot['nc'] * m * 100:.0f} s CPU (linear)")
        if not same:
            print("RESULTS DIFFER: the change is not decision-preserving")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="requests of the 16P16D run")
    ap.add_argument("--rate", type=float, default=40.0, help="req/s of the 16P16D run")
    ap.add_argument("--instances", default="2,4,8,16,32", help="instance counts of the decision-time sweep")
    ap.add_argument("--per-instance-rate", type=float, default=2.0, help="req/s per instance in the sweep")
    ap.add_argument("--sweep-requests", type=int, default=300)
    ap.add_argument("--baseline-rev", help="also compare with this git revision (e.g. main), side by side")
    ap.add_argument("--pairs", type=int, default=3, help="alternating baseline/new runs with --baseline-rev")
    ap.add_argument("--child", nargs=2, metavar=("N", "RATE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(scale_run(int(a.child[0]), float(a.child[1]), "16P16D")))
        return
    if a.baseline_rev:
        compare(a.baseline_rev, a.requests, a.rate, a.pairs)
        return
    print(f"SIMULATED cluster (Qwen2.5-14B shapes, A100-80GB analytic model); wall times measured on "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    r = scale_run(a.requests, a.rate, "16P16D")
    per, cpu = r["wall_s"] / r["n"], r["cpu_s"] / r["n"]
    print(f"16P16D laser: {r['n']} requests ({r['sim_s']:.0f} simulated s, {r['events']} events) in "
          f"{r['wall_s']:.1f} s wall = {per * 1e3:.2f} ms/request -> 100k requests ~ {per * 1e5:.0f} s "
          f"(linear extrapolation); CPU {r['cpu_s']:.1f} s = {cpu * 1e3:.2f} ms/request -> 100k ~ {cpu * 1e5:.0f} s; "
          f"TTFT met {r['ttft_met']:.3f}")
    print(f"{'instances':>9} {'P/D':>7} {'decision ms/req':>16} {'prefill sel. ms':>16} {'Alg. 2 ms':>10} "
          f"{'wall s':>7}")
    for k in (int(x) for x in a.instances.split(",") if x):
        spec = f"{max(1, k // 2)}P{max(1, k - k // 2)}D"
        r = scale_run(a.sweep_requests, a.per_instance_rate * k, spec, parts=True)
        print(f"{k:>9} {spec:>7} {r['decision_ms']:>16.3f} {r['select_prefill_ms']:>16.3f} "
              f"{r['assign_decode_ms']:>10.3f} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t:.0f} s")
