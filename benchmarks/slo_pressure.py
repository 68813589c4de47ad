"""Tight SLOs under pressure on the real engine: the timed scenarios of the issue "Keep tight SLOs
under pressure", replayed in real time on an in-process engine (arrivals released at layer
boundaries, as the server delivers them; ``laser.frontend.online.run_online``).

Scenarios (SLO classes at ``--slo-scale 4``: chat 1.0 s / 0.4 s, code 0.5 s / 0.2 s,
summarization 8 s / 0.8 s TTFT / TBT):

  cap      --max-num-seqs 4: four best_effort streams (64-token prompts, 128 tokens) at t=0;
           one code request (32 tokens, 16 tokens) at t=1 s.
  kv       KV pool of ~4,000 tokens: eight best_effort requests of 600 tokens (128 tokens);
           four 32-token chat requests (16 tokens) at t=0.3 s.
  long     four code streams (64 tokens, 128 tokens); a 2,000-token summarization request at t=2 s.
  burst    eight summarization prompts (1,500 tokens, 16 tokens) interleaved with eight chats
           (200 tokens, 16 tokens), 40 ms apart: all within 0.32 s (issue 28, item 1).
  shorts   a 2,000-token summarization request at t=0; six 32-token chats (16 tokens) 100 ms
           apart from t=0.3 s, while its prefill runs (issue 28, item 1: first tokens near their
           idle cost).

Each request passes the server's admission control when it is released (``--on-infeasible``, as
``laser serve``: :meth:`laser.frontend.admission.QueueAwareAdmission.decide` over the scheduler's
report published after each step plus the requests admitted since): ``queue`` (the server's
default) serves every request, ``reject`` refuses one whose predicted TTFT misses its target (a 429
with the prediction; a 400 when it misses even alone), ``demote`` serves it as the strictest looser
class it is predicted to meet, else best effort.

Prints, per scenario and policy, the TTFT and P99 TBT of the tight requests against their
targets with the admission decision and predicted TTFT, per class how many met their TTFT target
(of those admitted as asked) and the mean TTFT, preemptions by cause, and whether every request
produced all its tokens.

    .venv/bin/python benchmarks/slo_pressure.py [--policies laser,sarathi] [--threads 1] [--on-infeasible reject]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np
import torch

from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.admission import QueueAwareAdmission, SLOInfeasibleError
from laser.frontend.async_engine import ON_INFEASIBLE
from laser.frontend.engine import Engine
from laser.frontend.online import TimedRequest, run_online
from laser.core.request import SamplingParams
from laser.core.slo import SLOClasses


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=g).tolist()


def sp(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


SCENARIOS = {
    "cap": dict(config=dict(max_num_seqs=4), kv_tokens=None,
                stream=[(0.0, 64, "best_effort", 128)] * 4 + [(1.0, 32, "code", 16)], tight="code"),
    "kv": dict(config={}, kv_tokens=4096,
               stream=[(0.0, 600, "best_effort", 128)] * 8 + [(0.3, 32, "chat", 16)] * 4, tight="chat"),
    "long": dict(config={}, kv_tokens=None,
                 stream=[(0.0, 64, "code", 128)] * 4 + [(2.0, 2000, "summarization", 8)], tight="code,summarization"),
    "burst": dict(config={}, kv_tokens=None,
                  stream=[x for k in range(8) for x in ((0.04 * k, 1500, "summarization", 16),
                                                        (0.04 * k + 0.02, 200, "chat", 16))],
                  tight="chat,summarization"),
    "shorts": dict(config={}, kv_tokens=None,
                   stream=[(0.0, 2000, "summarization", 8)] + [(0.3 + 0.1 * k, 32, "chat", 16) for k in range(6)],
                   tight="chat,summarization"),
}


class Admitting:
    """An in-process engine behind the server's admission control (``laser serve --on-infeasible``):
    :func:`run_online` releases each request through :meth:`add_request`, which decides it as the
    server would (:meth:`QueueAwareAdmission.decide` over the report published after the engine's
    last step plus the requests admitted since); ``decisions``: req_id -> (``admitted`` /
    ``demoted`` / ``rejected``, predicted TTFT in seconds or None). A rejected request is not added
    (:func:`run_online` returns None for it)."""

    def __init__(self, engine: Engine, on_infeasible: str, slos: SLOClasses):
        self.engine, self.on_infeasible, self.slos = engine, on_infeasible, slos
        self.qa = QueueAwareAdmission(engine.latency_model)
        self.qa.publish(engine.scheduler.report(engine.clock()))
        self.num_adds = 0
        self.decisions: dict[str, tuple[str, float | None]] = {}

    @property
    def arrival_hook(self):
        return self.engine.arrival_hook

    @arrival_hook.setter
    def arrival_hook(self, fn) -> None:
        self.engine.arrival_hook = fn

    def add_request(self, prompt, sampling_params, slo, req_id, arrival_time):
        slo = self.slos.get(slo) if isinstance(slo, str) else slo
        now = self.engine.clock()
        try:
            adm, _ = self.qa.decide(len(prompt), slo, arrival_time, now, self.qa.view(now), self.on_infeasible,
                                    self.slos)
        except SLOInfeasibleError as e:
            self.decisions[req_id] = ("rejected", e.predicted_ttft)
            return None
        self.num_adds += 1
        self.qa.admitted(self.num_adds, adm.entry)
        self.decisions[req_id] = ("demoted" if adm.demoted else "admitted", adm.predicted_ttft)
        return self.engine.add_request(prompt, sampling_params, adm.slo, req_id=req_id, arrival_time=arrival_time)

    def step(self):
        t0 = self.engine.clock()
        outs = self.engine.step()
        now = self.engine.clock()
        self.qa.publish(self.engine.scheduler.report(now), self.num_adds, now - t0)
        return outs

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, req_id: str) -> bool:
        return self.engine.abort(req_id)


def p99(times: list[float]) -> float | None:
    gaps = np.diff(times)
    return float(np.percentile(gaps, 99)) if len(gaps) else None


def run(name: str, policy: str, args, slos: SLOClasses, profile: str | None) -> dict:
    sc = dict(SCENARIOS[name])
    if name == "long" and args.long_prompt != 2000:
        sc["stream"] = sc["stream"][:-1] + [(2.0, args.long_prompt, "summarization", 8)]
    if name in ("burst", "shorts") and args.prompt_scale != 1.0:
        sc["stream"] = [(t, max(16, round(n * args.prompt_scale)), cls, m) for t, n, cls, m in sc["stream"]]
    cache = CacheConfig(num_blocks=sc["kv_tokens"] // 16, block_size=16) if sc["kv_tokens"] else CacheConfig()
    eng = Engine(None, policy=policy, dtype=args.dtype, cache=cache, slo_classes=slos,
                 scheduler=SchedulerConfig(policy=policy, **sc["config"]), latency_profile=profile,
                 jitter_margin=args.jitter_margin)
    stream = [TimedRequest(t, ids(n, k), sp(m), cls, req_id=f"{name}-{cls}-{k}")
              for k, (t, n, cls, m) in enumerate(sc["stream"])]
    front = Admitting(eng, args.on_infeasible, slos)
    served = run_online(front, stream, timeout_s=args.timeout)
    tight = sc["tight"].split(",")
    rows = []
    for it, r in zip(stream, served):
        asked = slos.get(it.slo)
        if asked.name not in tight:
            continue
        decision, pred = front.decisions[it.req_id]
        ttft = r.token_times[0] - r.arrival_time if r is not None and r.token_times else None
        rows.append({"id": it.req_id, "class": asked.name, "admission": decision, "predicted_ttft_s": pred,
                     "given_up": bool(r is not None and r.given_up), "ttft_s": ttft, "ttft_target_s": asked.ttft,
                     "p99_tbt_s": p99(r.token_times) if r is not None else None, "tbt_target_s": asked.tbt})
    reqs = [r for r in served if r is not None]
    complete = all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    by_class = {}
    for c in tight:
        mine = [row for row in rows if row["class"] == c]
        ts = [row["ttft_s"] for row in mine if row["ttft_s"] is not None]
        target = next((row["ttft_target_s"] for row in mine), None)
        by_class[c] = {"n": len(mine), "ttft_met": sum(row["ttft_s"] is not None and row["ttft_s"] <= target
                                                      and row["admission"] == "admitted" for row in mine),
                       "rejected": sum(row["admission"] == "rejected" for row in mine),
                       "demoted": sum(row["admission"] == "demoted" for row in mine),
                       "mean_ttft_s": float(np.mean(ts)) if ts else None}
    pre = {f"{c}/{k}": v for (c, k), v in eng.scheduler.preemptions.items()}
    return {"scenario": name, "policy": policy, "tight": rows, "by_class": by_class, "all_complete": complete,
            "preemptions": pre,
            "max_preemptions_per_request": max(r.num_preemptions for r in reqs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="laser,sarathi")
    ap.add_argument("--scenarios", default="cap,kv,long")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--slo-scale", type=float, default=4.0)
    ap.add_argument("--latency-profile", default="auto", help="'auto' (cached profile of this setup) or a path")
    ap.add_argument("--long-prompt", type=int, default=2000,
                    help="prompt tokens of the long scenario's summarization request (the issue's 2,000 need "
                         "~2.2 s alone on its CPU; pick the length that takes as long alone on a slower one)")
    ap.add_argument("--prompt-scale", type=float, default=1.0,
                    help="prompt lengths of the burst and shorts scenarios times this (at least 16 tokens): the "
                         "issue's lengths assume ~2,000 prefill tok/s for a 200-token prompt; on a slower CPU pick "
                         "the factor that keeps their times alone")
    ap.add_argument("--jitter-margin", action=argparse.BooleanOptionalAction, default=None,
                    help="Laser's margins divided by the measured timing spread (as `laser serve`: on by default)")
    ap.add_argument("--on-infeasible", default="queue", choices=list(ON_INFEASIBLE),
                    help="admission of a request whose predicted TTFT misses its target, as `laser serve`")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    slos = SLOClasses.load(scale=args.slo_scale)
    print(f"CPU: {platform.processor() or platform.machine()}, {args.threads} thread(s), dtype {args.dtype}, "
          f"SLO scale {args.slo_scale}, on-infeasible {args.on_infeasible}")
    out = []
    for name in args.scenarios.split(","):
        for policy in args.policies.split(","):
            res = run(name, policy, args, slos, args.latency_profile)
            out.append(res)
            for row in res["tight"]:
                ttft = "-" if row["ttft_s"] is None else f"{row['ttft_s']:.3f}"
                tbt = "-" if row["p99_tbt_s"] is None else f"{row['p99_tbt_s']:.3f}"
                pred = "-" if row["predicted_ttft_s"] is None else f"{row['predicted_ttft_s']:.2f}"
                print(f"{name:5s} {policy:8s} {row['id']:24s} TTFT {ttft} s (target {row['ttft_target_s']}) "
                      f"P99 TBT {tbt} s (target {row['tbt_target_s']}) {row['admission']} (predicted {pred} s)"
                      f"{' given up' if row['given_up'] else ''}")
            for c, v in res["by_class"].items():
                mean = "-" if v["mean_ttft_s"] is None else f"{v['mean_ttft_s']:.3f}"
                print(f"{name:5s} {policy:8s} {c}: TTFT met {v['ttft_met']}/{v['n']}, rejected {v['rejected']}, "
                      f"demoted {v['demoted']}, mean TTFT {mean} s")
            print(f"{name:5s} {policy:8s} complete={res['all_complete']} preemptions={res['preemptions']} "
                  f"max per request={res['max_preemptions_per_request']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
