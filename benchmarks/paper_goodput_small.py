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
(Fig. 9 ablations). One option belongs to the script, not the controller:
``@prefill_share=x`` overrides ``--prefill-share`` for that entry, so one run can sweep a
baseline's P:D split (CONTROLLER.md D11), e.g. ``distserve@prefill_share=0.25`` (2P6D of 8).
The first controller is the reference of the ratios.

Colocated Sarathi-Serve's token budget (``--sarathi-budget``): by default Sarathi-Serve's
rule at the tightest scaled TBT target (the paper: "chunk size limited to meet the 50 ms
TBT"; CONTROLLER.md D11), as ``laser bench --sim`` does; ``--sarathi-budget 2048`` gives the
scheduler's default budget, which the runs recorded before this option used.

``--extend K``: when a controller passes the highest grid rate, keep probing one grid step
(the last step of ``--rates``) higher, at most K times, until it fails -- so the knee is
found (and then bisected) instead of reporting the grid top as a lower bound.

Usage: python benchmarks/paper_goodput_small.py [--model qwen2.5-14b] [--instances 8]
       [--mixes 1:1:1,1:2:4] [--slo-scales 1.0,0.8] [--rates 4,8,16] [--requests 150]
"""

from __future__ import annotations

import argparse

from laser.bench.paper_goodput import goodput_cell, probe, ratio_cell, search_knee, split_options
from laser.bench.plan import parse_mix
from laser.sim.cluster import paper_config


def goodput(ctl: str, n: int, cfg, rates: list[float], args, mix, scale: float, label: str) -> tuple[float, bool]:
    """:func:`search_knee` over simulated probes of ``ctl``; prints every probe."""
    def run(rate):
        p = probe(ctl, n, cfg, rate, args, mix, scale)
        print(f"  {label} {ctl:>34} {rate:6.3g} req/s: attainment {p['att']:6.1%}  mean TTFT {p['ttft'] * 1e3:7.1f} ms"
              f"  TTFT miss {p['ttft_miss']:5.1%}  TBT miss {p['tbt_miss']:5.1%}"
              + (f"  chunk budget {p['budget']}" if p["budget"] else "") + f"  ({p['wall']:.0f} s)", flush=True)
        return p["att"]

    passed, top = search_knee(run, rates, args.extend, args.bisect, args.stop_below)
    print(f"  {label} {ctl:>34} goodput {passed:g} req/s{' (grid top: a lower bound)' if top else ''}", flush=True)
    return passed, top


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
    ap.add_argument("--sarathi-budget", default="tbt",
                    help="colocated Sarathi's token budget: 'tbt' (sized to the tightest scaled TBT) or a token count")
    ap.add_argument("--extend", type=int, default=0, help="grid steps probed above the top rate while it passes")
    ap.add_argument("--bisect", type=int, default=0, help="halvings between the last passing and first failing rate")
    ap.add_argument("--stop-below", type=float, default=0.5, help="stop a controller's grid below this attainment")
    a = ap.parse_args()
    cfg = paper_config(a.model, "a100")
    rates = [float(x) for x in a.rates.split(",")]
    ctls = a.controllers.split(",")
    for c in ctls:  # fail before simulating anything
        name, opts, share = split_options(c, a.prefill_share)
        get_controller(name)(**opts)
        pd_split(2, share)
        mixed_budget(get_controller(name), cfg.latency_model, (0.05,), a.sarathi_budget)
    print(f"SIMULATED: {a.model} shapes, A100-80GB analytic latency model, TP{cfg.tp}, {a.requests} requests per "
          f"probe (seed {a.seed}), Table 1 lengths (lognormal) and SLOs x scale; goodput = highest rate with >= 90 % "
          f"attainment on the grid {a.rates} (+{a.extend} extension, +{a.bisect} bisection steps); colocated Sarathi "
          f"token budget: {a.sarathi_budget}")
    rows = []
    for n in (int(x) for x in a.instances.split(",")):
        for mix_s in a.mixes.split(","):
            mix = parse_mix(mix_s)
            for scale in (float(x) for x in a.slo_scales.split(",")):
                label = f"{n * cfg.tp:>2} GPUs {mix_s} x{scale:g}"
                res = {c: goodput(c, n, cfg, rates, a, mix, scale, label) for c in ctls}
                good = {c: g for c, (g, _) in res.items()}
                shown = {c: goodput_cell(g, top) for c, (g, top) in res.items()}
                ratios = {c: ratio_cell(res[ctls[0]], res[c]) for c in ctls[1:]}
                print(f"{label}: goodput " + ", ".join(f"{k} {v}" for k, v in shown.items()) + " | "
                      + ", ".join(f"{ctls[0]}/{k} {v}" for k, v in ratios.items()), flush=True)
                rows.append((n, mix_s, scale, shown, ratios))
    print(f"\n| GPUs | mix | SLO scale | " + " | ".join(ctls) + " | " + " | ".join(f"{ctls[0]}/{c}" for c in ctls[1:]) + " |")
    print("|---" * (3 + 2 * len(ctls) - 1) + "|")
    for n, mix_s, scale, shown, ratios in rows:
        print(f"| {n * cfg.tp} | {mix_s} | {scale:g} | " + " | ".join(shown[c] for c in ctls) + " | "
              + " | ".join(ratios.values()) + " |")

if __name__ == "__main__":
    main()
