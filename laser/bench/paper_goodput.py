"""The reduced-scale §9 goodput comparison's parts (``benchmarks/paper_goodput_small.py``, issue
12, SIMULATED): controller specs with per-entry options (``@prefill_share``), the P:D split, the
colocated Sarathi-Serve budget, one simulated probe, the knee search (grid, extension,
bisection) and the summary cells."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

from laser.bench.plan import attainment, table1_requests
from laser.bench.runner import tbt_token_budget
from laser.controller import get_controller
from laser.core.metrics import record_from_request
from laser.sim.cluster import ClusterSim, ClusterSpec


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
