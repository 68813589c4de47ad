"""Reduced-scale §9 goodput comparison (SIMULATED): Laser vs DistServe vs colocated
Sarathi-Serve (and Laser ablations) on the cluster simulator, paper-scale model shapes on
the A100-80GB analytic latency model (an estimate, not a measurement).

For each model, instance count (``--instances``, a list), request mix (``--mixes``), SLO
scale and controller: SLO attainment at each rate of ``--rates`` (Laser and DistServe split
P:D by ``--prefill-share``, default half; colocated all mixed), with ``--requests`` Poisson
requests of the Table 1 classes; goodput = the highest rate of the grid with attainment
>= 90 % (a grid: a lower bound within one grid step; ``--bisect K`` then halves the step
between the last passing and the first failing rate K times). A controller stops at the
first rate below ``--stop-below`` attainment. Prints per probe the attainment, mean TTFT and
the TTFT / P99-TBT miss rates, then per setting the goodputs and the ratios to Laser, and at
the end a markdown summary.

Controllers are registered names with optional ``@key=value`` options, e.g.
``laser@prefill_policy=sarathi`` (Fig. 8: iteration-level chunked prefill on Laser's
prefill instances), ``laser@decode_policy=vllm``, ``laser@decode_assignment=least_loaded``
(Fig. 9 ablations). The first controller is the reference of the ratios.

Usage: python benchmarks/paper_goodput_small.py [--model qwen2.5-14b] [--instances 8]
       [--mixes 1:1:1,1:2:4] [--slo-scales 1.0,0.8] [--rates 4,8,16] [--requests 150]
"""

from __future__ import annotations

import argparse
import statistics
import time

from laser.bench.plan import attainment, parse_mix, table1_requests
from laser.controller import get_controller
from laser.metrics import record_from_request
from laser.sim.cluster import ClusterSim, ClusterSpec, paper_config


def parse_controller(spec: str) -> tuple[str, dict]:
    """``"name@key=value@key=value"`` -> (name, options); values that parse as numbers become numbers."""
    name, *opts = spec.split("@")
    out = {}
    for o in opts:
        k, sep, v = o.partition("=")
        if not sep:
            raise ValueError(f"bad controller option {o!r} in {spec!r}: want key=value")
        try:
            out[k] = float(v)
        except ValueError:
            out[k] = v
    return name, out


def probe(ctl_spec: str, n: int, cfg, rate: float, args, mix, scale: float) -> dict:
    """One simulated run; attainment, mean TTFT (s), TTFT and P99-TBT miss fractions, wall time."""
    name, opts = parse_controller(ctl_spec)
    reqs = table1_requests(args.requests, rate, mix, seed=args.seed, slo_scale=scale, prefix="r")
    if name == "laser":
        opts = {"tbt_targets": tuple(sorted({r.slo.tbt for r in reqs})), **opts}
    t0 = time.perf_counter()
    p = min(n - 1, max(1, round(n * args.prefill_share)))
    res = ClusterSim(get_controller(name)(**opts), ClusterSpec(p, n - p), cfg).run(reqs)
    recs = [record_from_request(r) for r in res.requests]
    ttfts = [r.ttft for r in recs if r.ttft is not None]
    ttft_miss = sum(r.ttft is None or (r.ttft_slo is not None and r.ttft > r.ttft_slo) for r in recs)
    tbt_miss = sum(r.tbt_slo is not None and r.p99_tbt is not None and r.p99_tbt > r.tbt_slo for r in recs)
    return {"att": attainment(res.requests), "ttft": statistics.fmean(ttfts) if ttfts else float("nan"),
            "ttft_miss": ttft_miss / len(recs), "tbt_miss": tbt_miss / len(recs), "wall": time.perf_counter() - t0}


def goodput(ctl: str, n: int, cfg, rates: list[float], args, mix, scale: float, label: str) -> float:
    """Highest passing rate of the grid (then ``--bisect`` halvings toward the first failing one)."""
    def run(rate):
        p = probe(ctl, n, cfg, rate, args, mix, scale)
        print(f"  {label} {ctl:>34} {rate:6.3g} req/s: attainment {p['att']:6.1%}  mean TTFT {p['ttft'] * 1e3:7.1f} ms"
              f"  TTFT miss {p['ttft_miss']:5.1%}  TBT miss {p['tbt_miss']:5.1%}  ({p['wall']:.0f} s)", flush=True)
        return p["att"]

    passed, failed = 0.0, None
    for rate in rates:
        att = run(rate)
        if att >= 0.9:
            passed = rate
        elif failed is None:
            failed = rate
        if att < args.stop_below:
            break
    if failed is not None and failed < passed:  # a pass above a failure: bisect above the highest pass only
        failed = next((r for r in rates if r > passed), None)
    for _ in range(args.bisect if failed is not None else 0):
        mid = (passed + failed) / 2 if passed else failed / 2
        if run(mid) >= 0.9:
            passed = mid
        else:
            failed = mid
    top = passed == max(rates)
    print(f"  {label} {ctl:>34} goodput {passed:g} req/s{' (grid top: a lower bound)' if top else ''}", flush=True)
    return passed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-14b", help="qwen2.5-14b (TP1), qwen2.5-32b (TP2), llama-3-70b (TP4)")
    ap.add_argument("--instances", default="8", help="instance counts, comma-separated (GPUs = instances x TP)")
    ap.add_argument("--controllers", default="laser,distserve,colocated")
    ap.add_argument("--rates", default="4,8,12,16,20,24,32")
    ap.add_argument("--slo-scales", default="1.0,0.8")
    ap.add_argument("--mixes", "--mix", dest="mixes", default="1:1:1", help="chat:code:summarization, comma-separated")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-share", type=float, default=0.5,
                    help="prefill instances / instances of the disaggregated controllers (rounded, >= 1 of each)")
    ap.add_argument("--bisect", type=int, default=0, help="halvings between the last passing and first failing rate")
    ap.add_argument("--stop-below", type=float, default=0.5, help="stop a controller's grid below this attainment")
    a = ap.parse_args()
    cfg = paper_config(a.model, "a100")
    rates = [float(x) for x in a.rates.split(",")]
    ctls = a.controllers.split(",")
    for c in ctls:  # fail before simulating anything
        name, opts = parse_controller(c)
        get_controller(name)(**opts)
    print(f"SIMULATED: {a.model} shapes, A100-80GB analytic latency model, TP{cfg.tp}, {a.requests} requests per "
          f"probe (seed {a.seed}), Table 1 lengths (lognormal) and SLOs x scale; goodput = highest rate with >= 90 % "
          f"attainment on the grid {a.rates} (+{a.bisect} bisection steps)")
    rows = []
    for n in (int(x) for x in a.instances.split(",")):
        for mix_s in a.mixes.split(","):
            mix = parse_mix(mix_s)
            for scale in (float(x) for x in a.slo_scales.split(",")):
                label = f"{n * cfg.tp:>2} GPUs {mix_s} x{scale:g}"
                good = {c: goodput(c, n, cfg, rates, a, mix, scale, label) for c in ctls}
                ref = good[ctls[0]]
                ratios = {c: (ref / v if v else float("inf")) for c, v in good.items() if c != ctls[0]}
                print(f"{label}: goodput " + ", ".join(f"{k} {v:g}" for k, v in good.items()) + " | "
                      + ", ".join(f"{ctls[0]}/{k} {v:.2f}" for k, v in ratios.items()), flush=True)
                rows.append((n, mix_s, scale, good, ratios))
    print(f"\n| GPUs | mix | SLO scale | " + " | ".join(ctls) + " | " + " | ".join(f"{ctls[0]}/{c}" for c in ctls[1:]) + " |")
    print("|---" * (3 + 2 * len(ctls) - 1) + "|")
    for n, mix_s, scale, good, ratios in rows:
        print(f"| {n * cfg.tp} | {mix_s} | {scale:g} | " + " | ".join(f"{good[c]:g}" for c in ctls) + " | "
              + " | ".join(f"{v:.2f}" for v in ratios.values()) + " |")


if __name__ == "__main__":
    main()
