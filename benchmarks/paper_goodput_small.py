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
import dataclasses
import functools
import statistics
import time

from laser.bench.plan import attainment, parse_mix, table1_requests
from laser.bench.runner import tbt_token_budget
from laser.controller import get_controller
from laser.core.metrics import record_from_request
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


def pd_split(n: int, share: float) -> tuple[int, int]:
    """(prefill, decode) instances of ``n`` for a prefill share in (0, 1): rounded to the
    nearest count, at least one of each. Raises ValueError for n < 2 or a share outside (0, 1)."""
    if n < 2:
        raise ValueError(f"a disaggregated cluster needs >= 2 instances, got {n}")
    if not 0.0 < share < 1.0:
        raise ValueError(f"prefill share must lie in (0, 1), got {share}")
    p = min(n - 1, max(1, round(n * share)))
    return p, n - p


def split_options(ctl_spec: str, default_share: float) -> tuple[str, dict, float]:
    """(controller name, controller options, prefill share) of a ``--controllers`` entry:
    the script's own ``prefill_share`` option is taken out of the controller's options."""
    name, opts = parse_controller(ctl_spec)
    share = float(opts.pop("prefill_share", default_share))
    return name, opts, share


def extended_rates(rates: list[float], extend: int) -> list[float]:
    """The rates probed above the grid top when a controller passes it: ``extend`` more
    steps of the grid's last step (its only rate if the grid has one)."""
    step = rates[-1] - rates[-2] if len(rates) > 1 else rates[-1]
    if step <= 0:
        raise ValueError(f"--rates must increase, got {rates}")
    return [rates[-1] + step * (i + 1) for i in range(extend)]


@functools.lru_cache(maxsize=None)
def _tbt_budget(lm, tbt: float) -> int:
    return tbt_token_budget(lm, tbt)


def mixed_budget(ctl_cls, lm, tbts, setting: str) -> int | None:
    """Token budget of a colocated Sarathi-Serve controller's mixed instances, None for any
    other controller. ``setting``: ``"tbt"`` = Sarathi-Serve's rule at the tightest of the
    (scaled) TBT targets ``tbts`` (s) -- the largest budget whose iteration with 8 decode
    tokens the latency model ``lm`` keeps within it (:func:`laser.bench.runner.tbt_token_budget`,
    as ``laser bench --sim`` and CONTROLLER.md D11); an integer string = that many tokens.
    Raises ValueError for anything else."""
    if ctl_cls.disaggregated or ctl_cls.instance_policy != "sarathi":
        return None
    if setting == "tbt":
        return _tbt_budget(lm, min(tbts))
    if not setting.isdigit() or int(setting) < 1:
        raise ValueError(f"--sarathi-budget wants 'tbt' or a positive token count, got {setting!r}")
    return int(setting)


def probe(ctl_spec: str, n: int, cfg, rate: float, args, mix, scale: float) -> dict:
    """One simulated run; attainment, mean TTFT (s), TTFT and P99-TBT miss fractions, wall
    time, and the mixed instances' token budget (None unless colocated Sarathi)."""
    name, opts, share = split_options(ctl_spec, args.prefill_share)
    reqs = table1_requests(args.requests, rate, mix, seed=args.seed, slo_scale=scale, prefix="r")
    tbts = tuple(sorted({r.slo.tbt for r in reqs if r.slo.tbt is not None}))
    if name == "laser":
        opts = {"tbt_targets": tbts, **opts}
    cls = get_controller(name)
    budget = mixed_budget(cls, cfg.latency_model, tbts, args.sarathi_budget)
    if budget is not None:
        cfg = dataclasses.replace(cfg, mixed_token_budget=budget)
    t0 = time.perf_counter()
    p, d = pd_split(n, share)
    res = ClusterSim(cls(**opts), ClusterSpec(p, d), cfg).run(reqs)
    recs = [record_from_request(r) for r in res.requests]
    ttfts = [r.ttft for r in recs if r.ttft is not None]
    ttft_miss = sum(r.ttft is None or (r.ttft_slo is not None and r.ttft > r.ttft_slo) for r in recs)
    tbt_miss = sum(r.tbt_slo is not None and r.p99_tbt is not None and r.p99_tbt > r.tbt_slo for r in recs)
    return {"att": attainment(res.requests), "ttft": statistics.fmean(ttfts) if ttfts else float("nan"),
            "ttft_miss": ttft_miss / len(recs), "tbt_miss": tbt_miss / len(recs), "wall": time.perf_counter() - t0,
            "budget": budget}


def search_knee(run, rates: list[float], extend: int = 0, bisect: int = 0,
                stop_below: float = 0.5) -> tuple[float, bool]:
    """Goodput search over ``run(rate) -> attainment`` (fraction): the highest rate of the
    increasing grid ``rates`` with attainment >= 0.9, the grid extended by up to ``extend``
    steps while its top passes, then ``bisect`` halvings between the last passing and the
    first failing rate. The grid stops at the first rate below ``stop_below``. Returns
    (goodput in req/s, True if no probe failed above it: a lower bound)."""
    passed, failed = 0.0, None
    for rate in rates:
        att = run(rate)
        if att >= 0.9:
            passed = rate
        elif failed is None:
            failed = rate
        if att < stop_below:
            break
    if passed == rates[-1]:  # the grid top passed: extend the grid until a probe fails
        failed = None
        for rate in extended_rates(rates, extend):
            if run(rate) >= 0.9:
                passed = rate
            else:
                failed = rate
                break
    elif failed is not None and failed < passed:  # a pass above a failure: bisect above the highest pass only
        failed = next((r for r in rates if r > passed), None)
    for _ in range(bisect if failed is not None else 0):
        mid = (passed + failed) / 2 if passed else failed / 2
        if run(mid) >= 0.9:
            passed = mid
        else:
            failed = mid
    return passed, failed is None and passed > 0


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


def goodput_cell(g: float, lower_bound: bool) -> str:
    """A goodput for the summary: ``">= g"`` when no probe failed above it."""
    return f">= {g:g}" if lower_bound else f"{g:g}"


def ratio_cell(ref: tuple[float, bool], other: tuple[float, bool]) -> str:
    """``ref / other`` of two (goodput, lower bound) results, marked ``>=`` / ``<=`` when one
    side is a lower bound and ``?`` when both are (or the other is 0 and ref a bound)."""
    (r, r_low), (o, o_low) = ref, other
    if o == 0:
        return "inf" if r else "-"
    mark = {(False, False): "", (True, False): ">= ", (False, True): "<= ", (True, True): "? "}[(r_low, o_low)]
    return f"{mark}{r / o:.2f}"


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
