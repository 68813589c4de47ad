"""``laser bench --sim --cluster``: controllers over simulated clusters (SIMULATED).

:class:`ClusterTarget` serves a workload on :class:`~laser.sim.cluster.ClusterSim`: the
real controller and the real schedulers on paper-scale analytic latency models
(:func:`~laser.sim.cluster.paper_config`), virtual time. Workloads keep the shipped
datasets' per-request shapes with lengths rescaled per class to the paper's Table 1
means (:func:`rescale_to_table1`); outputs say so.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Sequence

from laser.bench.runner import RunOutput, Target, _slo_for, _summary_duration, tbt_token_budget
from laser.bench.workloads import WorkloadRequest
from laser.core.metrics import record_from_request
from laser.core.request import SLO, Request, SamplingParams

#: Paper Table 1: class -> (mean input tokens, mean output tokens).
TABLE1 = {"chat": (350.9, 187.9), "code": (201.5, 105.2), "summarization": (2084.5, 95.7)}


#: Table 1's classes with the paper's SLOs: (name, mean input, mean output, TTFT s, TBT s).
TABLE1_CLASSES = [("chat", 350.9, 187.9, 0.25, 0.1), ("code", 201.5, 105.2, 0.125, 0.05),
                  ("summarization", 2084.5, 95.7, 2.0, 0.2)]


def table1_requests(n: int, rate: float, seed: int = 0, scale: float = 1.0) -> list[Request]:
    """``n`` synthetic requests of paper Table 1 (the simulator's golden runs, ``sim_scale.py``,
    ``ttft_predictors.py``): Poisson arrivals at ``rate`` req/s, classes in turn (1:1:1), token-id-1
    prompts and outputs with lognormal(0, 0.5) lengths whose means are Table 1's times ``scale``
    (divided by E[lognormal(0, 0.5)] = 1.1331), the paper's SLOs; ``req_id`` ``r<i>``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        name, p, o, ttft, tbt = TABLE1_CLASSES[i % 3]
        lp = max(1, round(rng.lognormvariate(0, 0.5) * p * scale / 1.1331))
        lo = max(1, round(rng.lognormvariate(0, 0.5) * o * scale / 1.1331))
        out.append(Request([1] * lp, SamplingParams(max_tokens=lo, ignore_eos=True), SLO(ttft, tbt, name),
                           arrival_time=t, req_id=f"r{i}"))
    return out

def rescale_to_table1(requests: Sequence[WorkloadRequest], max_len: int | None = None) -> tuple[list[WorkloadRequest], dict]:
    """Multiply each class's prompt and output lengths so their means equal Table 1's
    (per-request shape kept; at least 1 token; prompt + output capped at ``max_len``).
    Returns the requests and ``{class: {"prompt_factor", "output_factor"}}``."""
    by: dict[str, list[WorkloadRequest]] = {}
    for r in requests:
        by.setdefault(r.slo_class, []).append(r)
    factors = {}
    for c, rs in by.items():
        if c not in TABLE1:
            continue
        mp = sum(r.prompt_len for r in rs) / len(rs)
        mo = sum(r.output_len for r in rs) / len(rs)
        factors[c] = {"prompt_factor": TABLE1[c][0] / mp, "output_factor": TABLE1[c][1] / mo}
    out = []
    for r in requests:
        f = factors.get(r.slo_class)
        if f is None:
            out.append(r)
            continue
        p = max(1, round(r.prompt_len * f["prompt_factor"]))
        o = max(1, round(r.output_len * f["output_factor"]))
        if max_len is not None and p + o > max_len:
            p = max(1, max_len - o)
        out.append(dataclasses.replace(r, prompt_len=p, output_len=o))
    return out, {c: {k: round(v, 4) for k, v in f.items()} for c, f in factors.items()}


class ClusterTarget(Target):
    """One controller on a simulated cluster (``spec``, ``config`` of
    :mod:`laser.sim.cluster`). Sarathi's chunk budget on mixed instances is sized to the
    tightest TBT target of each run's SLOs (Sarathi-Serve's rule, CONTROLLER.md D11)."""

    kind = "sim"
    simulated = True

    def __init__(self, controller: str, spec, config, label: str | None = None):
        from laser.controller import get_controller

        self.controller = controller
        self.cls = get_controller(controller)
        self.spec = spec
        self.config = config
        self.label = label or controller
        self.last = None  # the last ClusterSim (stats)

    def describe(self) -> dict:
        c = self.config
        lm = c.latency_model
        return {**super().describe(), "controller": self.controller, "instance_policy": self.cls.instance_policy,
                "cluster": str(self.spec.layout_for(self.cls.disaggregated)),
                "latency_model": type(lm).__name__, "model_shape": dataclasses.asdict(lm.shape) if hasattr(lm, "shape") else None,
                "hardware": getattr(getattr(lm, "hardware", None), "name", None), "tp": c.tp,
                "num_blocks": c.num_blocks, "msg_delay_s": c.msg_delay_s, "inter_node_bw": c.inter_node_bw,
                "intra_node_bw": c.intra_node_bw}

    def run(self, requests, slos, timeout_s=None, progress=False, stop_below=None) -> RunOutput:
        """(Virtual time: ``stop_below`` is ignored; ``timeout_s`` cuts the simulation.)"""
        from laser.sim.cluster import ClusterSim

        t0 = time.perf_counter()
        cfg = self.config
        tbts = [s.tbt for s in slos.classes.values() if s.tbt is not None]
        if self.cls.instance_policy == "sarathi" and not self.cls.disaggregated and tbts:
            cfg = dataclasses.replace(cfg, mixed_token_budget=tbt_token_budget(cfg.latency_model, min(tbts)))
        reqs = [Request([1] * wr.prompt_len, SamplingParams(max_tokens=wr.output_len, temperature=0.0, ignore_eos=True),
                        _slo_for(slos, wr.slo_class), arrival_time=wr.arrival_time, req_id=f"{self.label}-{i}")
                for i, wr in enumerate(requests)]
        ctl = self.cls(tbt_targets=tuple(sorted(set(tbts)))) if self.controller == "laser" else self.cls()
        sim = ClusterSim(ctl, self.spec, cfg)
        res = sim.run(reqs, until=math.inf if timeout_s is None else timeout_s)
        self.last = (sim, res)
        records = [record_from_request(r) for r in res.requests]
        return RunOutput(records, _summary_duration(records), time.perf_counter() - t0)


def build_cluster_targets(args) -> tuple[dict, object]:
    """(targets by controller label, cluster config) from ``--cluster``, ``--controller``,
    ``--sim-model``, ``--sim-hardware``, ``--best-effort-share``."""
    from laser.sim.cluster import ClusterSpec, paper_config

    spec = ClusterSpec.parse(args.cluster)
    hw = args.sim_hardware or "a100"
    cfg = paper_config(args.sim_model, hw, tp=args.sim_tp, msg_delay_s=args.msg_delay_ms / 1e3)
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, best_effort_share=args.best_effort_share))
    names = [x.strip() for x in (args.controller or "laser,distserve,colocated").split(",") if x.strip()]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"bad --controller list {args.controller!r}")
    return {n: ClusterTarget(n, spec, cfg) for n in names}, cfg


def sweep_cluster(args, targets, requests, slos, lo, hi, grid, steps, make_bench, tag, time_cap) -> dict:
    """Goodput per cluster size (GPUs): ``GPUs / tp`` instances, split in half P:D
    (prefill the smaller half) for disaggregated controllers, all mixed otherwise."""
    from laser.sim.cluster import ClusterSpec

    out = {}
    for g in (int(float(x)) for x in args.sweep_cluster.split(",") if x.strip()):
        n = g // next(iter(targets.values())).config.tp
        if n < 2:
            print(f"-- {g} GPUs: fewer than 2 instances, skipped{tag}")
            continue
        spec = ClusterSpec(num_mixed=n)
        print(f"-- cluster {g} GPUs ({n} instances){tag}")
        sized = {lb: ClusterTarget(t.controller, spec, t.config, lb) for lb, t in targets.items()}
        b = make_bench(requests, slos)
        b.targets = sized
        res = b.goodput(lo * n / ClusterSpec.parse(args.cluster).total, hi * n / ClusterSpec.parse(args.cluster).total,
                        grid, steps, full_grid=args.full_grid, max_doublings=args.max_doublings, time_cap_s=time_cap)
        out[str(g)] = {lb: r.goodput_rps for lb, r in res.items()}
    return out
