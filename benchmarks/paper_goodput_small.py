"""Reduced-scale §9 goodput comparison (SIMULATED): Laser vs DistServe vs colocated
Sarathi-Serve on the cluster simulator, Qwen2.5-14B shapes on the A100-80GB analytic model.

For each SLO scale and controller: SLO attainment at each rate of ``--rates`` on a cluster
of ``--instances`` GPUs (Laser and DistServe split in half P:D, colocated all mixed), with
``--requests`` Poisson requests of the Table 1 classes (``--mix``); goodput = the highest
rate of the grid with attainment >= 90 % (a grid, not a bisection: a lower bound within
one grid step). Prints the attainment table and the goodput ratios.

Usage: python benchmarks/paper_goodput_small.py [--instances 8] [--slo-scales 1.0,0.8]
"""

from __future__ import annotations

import argparse
import time

from laser.bench.plan import attainment, parse_mix, table1_requests
from laser.sim.cluster import ClusterSim, ClusterSpec, paper_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--controllers", default="laser,distserve,colocated")
    ap.add_argument("--rates", default="4,8,12,16,20,24,32")
    ap.add_argument("--slo-scales", default="1.0,0.8")
    ap.add_argument("--mix", default="1:1:1")
    ap.add_argument("--requests", type=int, default=150)
    a = ap.parse_args()
    cfg = paper_config("qwen2.5-14b", "a100")
    mix = parse_mix(a.mix)
    rates = [float(x) for x in a.rates.split(",")]
    n = a.instances
    print(f"SIMULATED: Qwen2.5-14B shapes, A100-80GB analytic latency model, {n} GPUs, mix {a.mix}, "
          f"{a.requests} requests per probe, Table 1 lengths (lognormal) and SLOs x scale")
    for scale in (float(x) for x in a.slo_scales.split(",")):
        good = {}
        for ctl in a.controllers.split(","):
            spec = ClusterSpec(n // 2, n - n // 2)
            row = []
            for rate in rates:
                reqs = table1_requests(a.requests, rate, mix, seed=0, slo_scale=scale, prefix=f"{ctl}-")
                tbts = tuple(sorted({r.slo.tbt for r in reqs}))
                from laser.controller import get_controller
                cls = get_controller(ctl)
                c = cls(tbt_targets=tbts) if ctl == "laser" else cls()
                t0 = time.perf_counter()
                att = attainment(ClusterSim(c, spec, cfg).run(reqs).requests)
                row.append(att)
                print(f"  scale {scale:g} {ctl:>10} {rate:5g} req/s: attainment {att:6.1%} ({time.perf_counter() - t0:.0f} s)", flush=True)
                if att < 0.5:
                    break
            passing = [r for r, x in zip(rates, row) if x >= 0.9]
            good[ctl] = max(passing) if passing else 0.0
        print(f"SLO scale {scale:g}: goodput (req/s, grid lower bound) " + ", ".join(f"{k} {v:g}" for k, v in good.items()))
        if good.get("laser"):
            for k, v in good.items():
                if k != "laser":
                    print(f"  laser/{k} = {good['laser'] / v:.2f}" if v else f"  laser/{k} = inf ({k} passes no rate)")


if __name__ == "__main__":
    main()
