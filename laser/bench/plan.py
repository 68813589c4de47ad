"""``laser plan``: capacity planner over the cluster simulator (SIMULATED).

Question: at ``--rate`` req/s of a ``--mix`` of the paper's three request classes, how
many instances, split how between prefill and decode, keep SLO attainment >= 90 %?

Method: each candidate cluster serves the same synthetic workload (Poisson arrivals,
lognormal lengths with the paper's Table 1 means, :func:`table1_requests`) on
:class:`~laser.sim.cluster.ClusterSim` -- the real controller and schedulers on a latency
model: the analytic model of a paper-scale model (``--sim-model``, ``--sim-hardware``) or a
fitted profile of our own instances (``--latency-profile``). For a total of T instances
the P:D splits are searched around the split that balances predicted prefill and decode
work (:func:`balanced_split`), hill-climbing while attainment improves; T doubles from a
work-based lower bound until a split passes, then bisects down to the smallest passing T.
Every probe is printed (the curve searched); the answer is the smallest T and, at that T,
the passing split with the highest attainment (ties: fewer prefill instances).
Colocated controllers have no split: only T is searched.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from laser.bench.cluster import TABLE1
from laser.core.metrics import record_from_request
from laser.core.request import SLO, Request, SamplingParams
# parse_mix: the planner's --mix (and its callers')
from laser.bench.args import add_sim_model_arg, parse_mix, sim_hardware_name
from laser.cli import fraction

#: Paper Table 1 SLOs per class: (TTFT s, TBT s).
TABLE1_SLO = {"chat": (0.25, 0.1), "code": (0.125, 0.05), "summarization": (2.0, 0.2)}
CLASS_ORDER = ("chat", "code", "summarization")  # --mix a:b:c = ShareGPT:HumanEval:LongBench
_LOGNORMAL_MEAN = math.exp(0.5 ** 2 / 2)  # E[lognormal(0, 0.5)]


def table1_requests(n: int, rate: float, mix=(1.0, 1.0, 1.0), seed: int = 0, slo_scale: float = 1.0,
                    prefix: str = "r") -> list[Request]:
    """``n`` requests, Poisson arrivals at ``rate`` req/s; classes drawn by ``mix`` weights
    (chat, code, summarization); prompt and output lengths lognormal (sigma 0.5) with the
    paper's Table 1 means; SLOs Table 1's times ``slo_scale`` (TTFT and TBT, CONTROLLER.md D12)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        cls = rng.choices(CLASS_ORDER, weights=mix)[0]
        p, o = TABLE1[cls]
        ttft, tbt = TABLE1_SLO[cls]
        lp = max(1, round(rng.lognormvariate(0, 0.5) * p / _LOGNORMAL_MEAN))
        lo = max(1, round(rng.lognormvariate(0, 0.5) * o / _LOGNORMAL_MEAN))
        out.append(Request([1] * lp, SamplingParams(max_tokens=lo, ignore_eos=True),
                           SLO(ttft * slo_scale, tbt * slo_scale, cls), arrival_time=t, req_id=f"{prefix}{i}"))
    return out


def attainment(requests: list[Request]) -> float:
    """Fraction of requests meeting every SLO (TTFT, P99 TBT; :meth:`RequestRecord.slo_met`)."""
    return sum(record_from_request(r).slo_met for r in requests) / max(1, len(requests))


def balanced_split(lm, total: int, mix, tbt_scale: float = 1.0) -> int:
    """Prefill instances out of ``total`` that balance predicted work: the prefill side's
    seconds per request (one isolated prefill of the mean prompt) against the decode side's
    (mean output tokens x the iteration time of a batch at the class's TBT target, divided
    by that batch), from the latency model. At least 1 of each."""
    w = [x / sum(mix) for x in mix]
    pre = dec = 0.0
    for wi, cls in zip(w, CLASS_ORDER):
        p, o = TABLE1[cls]
        pre += wi * lm.predict_prefill(round(p))
        tbt = TABLE1_SLO[cls][1] * tbt_scale
        b = 1
        while b < 1024 and lm.predict_decode_iteration([round(p + o / 2)] * (2 * b)) <= 0.9 * tbt:
            b *= 2
        dec += wi * o * lm.predict_decode_iteration([round(p + o / 2)] * b) / b
    return min(total - 1, max(1, round(total * pre / (pre + dec))))


@dataclass
class Probe:
    total: int
    prefill: int  # 0 for a colocated cluster
    attainment: float
    wall_s: float

    @property
    def spec(self) -> str:
        return f"{self.total}M" if self.prefill == 0 else f"{self.prefill}P{self.total - self.prefill}D"


@dataclass
class Plan:
    rate: float
    target: float
    probes: list[Probe] = field(default_factory=list)
    best: Probe | None = None


class CapacityPlanner:
    """Searches cluster sizes and splits (see the module docstring).

    Args:
        controller: registered controller name. config: :class:`~laser.sim.cluster.ClusterConfig`.
        requests: number of simulated requests per probe. seed, slo_scale: workload knobs.
    """

    def __init__(self, controller: str, config, requests: int = 300, seed: int = 0, slo_scale: float = 1.0,
                 target: float = 0.9, max_instances: int = 64, log=print):
        from laser.controller import get_controller

        self.controller, self.cls, self.config = controller, get_controller(controller), config
        self.n, self.seed, self.slo_scale, self.target = requests, seed, slo_scale, target
        self.max_instances, self.log = max_instances, log

    def probe(self, rate: float, mix, total: int, prefill: int) -> Probe:
        from laser.sim.cluster import ClusterSim, ClusterSpec

        spec = ClusterSpec(num_mixed=total) if prefill == 0 else ClusterSpec(prefill, total - prefill)
        reqs = table1_requests(self.n, rate, mix, self.seed, self.slo_scale)
        tbts = tuple(sorted({r.slo.tbt for r in reqs}))
        ctl = self.cls(tbt_targets=tbts) if self.controller == "laser" else self.cls()
        t0 = time.perf_counter()
        res = ClusterSim(ctl, spec, self.config).run(reqs)
        p = Probe(total, prefill, attainment(res.requests), time.perf_counter() - t0)
        self.log(f"  {p.spec:>8}: attainment {p.attainment:6.1%}  ({p.wall_s:.1f} s wall)")
        return p

    def best_split(self, rate: float, mix, total: int, plan: Plan) -> Probe:
        """Hill-climb P from the balanced split while attainment improves."""
        if not self.cls.disaggregated:
            p = self.probe(rate, mix, total, 0)
            plan.probes.append(p)
            return p
        if total < 2:
            return Probe(total, 1, 0.0, 0.0)
        seen: dict[int, Probe] = {}

        def at(k: int) -> Probe:
            if k not in seen:
                seen[k] = self.probe(rate, mix, total, k)
                plan.probes.append(seen[k])
            return seen[k]

        k = balanced_split(self.config.latency_model, total, mix, self.slo_scale)
        best = at(k)
        for step in (1, -1):
            j = k + step
            while 1 <= j <= total - 1 and best.attainment < 1.0:
                p = at(j)
                if p.attainment <= best.attainment:
                    break
                best = p
                j += step
        passing = [p for p in seen.values() if p.attainment >= self.target]
        return min(passing, key=lambda p: (-p.attainment, p.prefill)) if passing else best

    def plan(self, rate: float, mix) -> Plan:
        """The smallest passing cluster at ``rate`` (``best`` None when none up to ``max_instances``,
        also when the controller's smallest cluster -- 2 instances for a disaggregated one -- or
        the instances the prefill work alone keeps busy are more than ``max_instances``: no
        larger cluster is probed)."""
        plan = Plan(rate, self.target)
        lm = self.config.latency_model
        w = [x / sum(mix) for x in mix]
        busy = rate * sum(wi * lm.predict_prefill(round(TABLE1[c][0])) for wi, c in zip(w, CLASS_ORDER))
        lo = max(1 if not self.cls.disaggregated else 2, math.ceil(busy))  # prefill alone needs this many
        if lo > self.max_instances:
            self.log(f"-- no cluster searched: {self.controller} needs at least {lo} instances at {rate:g} req/s "
                     f"(prefill work, one prefill and one decode instance for a disaggregated controller), "
                     f"more than the {self.max_instances} allowed")
            return plan
        results: dict[int, Probe] = {}

        def ok(t: int) -> bool:
            self.log(f"-- {t} instances")
            results[t] = self.best_split(rate, mix, t, plan)
            return results[t].attainment >= self.target

        t, fail = lo, lo - 1
        while not ok(t):
            fail = t
            if t >= self.max_instances:
                return plan
            t = min(self.max_instances, 2 * t)
        hi = t
        while hi - fail > 1:
            mid = (hi + fail) // 2
            if ok(mid):
                hi = mid
            else:
                fail = mid
        plan.best = results[hi]
        return plan


def register(sub) -> None:
    from laser.cli import positive_float, positive_int

    p = sub.add_parser("plan", help="capacity planner: smallest P:D split keeping --attainment-target "
                                    "(default 90%%) SLO attainment (SIMULATED)")
    p.add_argument("--rate", type=float, required=True, help="arrival rate (req/s)")
    p.add_argument("--mix", default="1:1:1",
                   help="chat:code:summarization weights (ShareGPT:HumanEval:LongBench; default %(default)s)")
    p.add_argument("--controller", default="laser",
                   help="controller (laser, distserve, colocated, colocated-laser, round_robin; default %(default)s)")
    add_sim_model_arg(p)
    p.add_argument("--sim-hardware", type=sim_hardware_name, default="a100", help="hardware table entry (a100, h100, ...; default %(default)s)")
    p.add_argument("--latency-profile", default=None,
                   help="plan for our own instances from a fitted latency profile (JSON) instead of --sim-model "
                        "(default: none)")
    p.add_argument("--num-blocks", type=positive_int, default=4096,
                   help="KV blocks per layer per instance (with --latency-profile; default %(default)s)")
    p.add_argument("--kv-bytes-per-token-layer", type=positive_int, default=4096,
                   help="KV transfer size, bytes per token per layer (with --latency-profile; default %(default)s)")
    p.add_argument("--slo-scale", type=positive_float, default=1.0,
                   help="multiply Table 1's TTFT and TBT targets (default %(default)s)")
    p.add_argument("--requests", type=positive_int, default=300, help="simulated requests per probe (default %(default)s)")
    p.add_argument("--attainment-target", type=fraction, default=0.9,
                   help="SLO attainment the plan must reach (default %(default)s, as the paper)")
    p.add_argument("--max-instances", type=positive_int, default=64,
                   help="largest cluster searched, instances (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default %(default)s)")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from laser.sim.cluster import ClusterConfig, paper_config

    mix = parse_mix(args.mix)
    if not (args.rate > 0 and math.isfinite(args.rate)):
        raise ValueError("--rate must be a positive number of req/s")
    if args.latency_profile:
        from laser.latency import FittedLatencyModel

        lm = FittedLatencyModel.load(args.latency_profile)
        cfg = ClusterConfig(latency_model=lm, kv_bytes_per_token_layer=args.kv_bytes_per_token_layer,
                            num_blocks=args.num_blocks)
        what = f"fitted profile {args.latency_profile} ({lm.num_layers} layers, {args.num_blocks} KV blocks/layer)"
    else:
        cfg = paper_config(args.sim_model, args.sim_hardware)
        what = f"{args.sim_model} on {args.sim_hardware} (analytic latency model: an estimate), TP {cfg.tp}"
    print(f"SIMULATED capacity plan: {args.rate:g} req/s, mix {args.mix} (chat:code:summarization), "
          f"controller {args.controller}, {what}; Table 1 lengths (lognormal, sigma 0.5) and SLOs x{args.slo_scale:g}; "
          f"{args.requests} requests per probe; target attainment {args.attainment_target:.0%}")
    planner = CapacityPlanner(args.controller, cfg, args.requests, args.seed, args.slo_scale,
                              args.attainment_target, args.max_instances)
    plan = planner.plan(args.rate, mix)
    print("searched (instances, split, attainment):")
    for p in sorted(plan.probes, key=lambda p: (p.total, p.prefill)):
        print(f"  {p.total:>3} {p.spec:>8} {p.attainment:7.1%}{'  <- plan' if p is plan.best else ''}")
    if plan.best is None:
        print(f"no cluster of up to {args.max_instances} instances reaches {args.attainment_target:.0%}")
        return 1
    b = plan.best
    print(f"plan: {b.spec} ({b.total} instances x TP {cfg.tp} = {b.total * cfg.tp} GPUs), "
          f"attainment {b.attainment:.1%} at {args.rate:g} req/s")
    return 0
