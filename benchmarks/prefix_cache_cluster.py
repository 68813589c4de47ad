"""Cache-aware vs prefix-blind routing on the simulated paper-scale cluster (SIMULATED: the
analytic A100 latency model, an estimate; issue 29).

Workload: multi-turn chat conversations. Each conversation has a ~``--system``-token system
prompt of its own and ``--turns`` turns; turn k's prompt is the whole conversation so far (every
earlier user message and reply) plus a new user message (Table 1 chat lengths: prompt ~350
tokens per message, reply ~190). Turns of a conversation arrive ``--think`` seconds (exponential)
after the previous one; conversations start as a Poisson process. Token ids are random per
conversation, so only a conversation's own earlier turns share blocks.

Both runs have a prefix cache on every instance (the engine's block manager); the cache-aware
controller sees each prompt's block hashes and prefers the prefill instance holding the longest
prefix where no deadline breaks, the blind one routes by slack alone (a conversation's next turn
lands on a random-ish instance and recomputes its history). Goodput: the highest rate (conversations
started per second, over the grid ``--rates``) with >= 90 % of requests meeting TTFT and P99 TBT
(Table 1 chat targets x ``--slo-scale``). Prints attainment and hit rate per rate.

``--controller`` picks the routing policy: ``laser`` (slack-based, cache-aware where no deadline
breaks), or a least-loaded baseline (``distserve``; ``colocated`` / ``colocated-laser`` on mixed
instances) whose load counts the request's uncached work only when it is cache-aware
(laser/controller/baselines.py).

Usage: python benchmarks/prefix_cache_cluster.py [--model qwen2.5-14b] [--instances 8]
       [--rates 0.5,1,2,4] [--conversations 120] [--turns 4] [--controller laser]
"""

from __future__ import annotations

import argparse
import random

from laser.bench.plan import TABLE1_SLO, attainment
from laser.core.request import SLO, Request, SamplingParams
from laser.sim.cluster import ClusterSim, ClusterSpec, paper_config


def conversations(n: int, rate: float, turns: int, system: int, think_s: float, slo_scale: float,
                  seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    ttft, tbt = (x * slo_scale for x in TABLE1_SLO["chat"])
    out, t = [], 0.0
    for c in range(n):
        t += rng.expovariate(rate)
        history = [rng.randrange(3, 150000) for _ in range(system)]
        at = t
        for k in range(turns):
            history += [rng.randrange(3, 150000) for _ in range(max(1, int(rng.lognormvariate(5.6, 0.5))))]
            reply = max(1, int(rng.lognormvariate(5.0, 0.5)))
            out.append(Request(list(history), SamplingParams(max_tokens=reply, ignore_eos=True),
                               SLO(ttft, tbt, "chat"), arrival_time=at, req_id=f"c{c}t{k}"))
            history += [rng.randrange(3, 150000) for _ in range(reply)]
            at += reply * tbt + rng.expovariate(1.0 / think_s)
    out.sort(key=lambda r: r.arrival_time)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=None, help="prefill instances (default: half)")
    ap.add_argument("--rates", default="0.5,1,2,4,8", help="conversations started per second")
    ap.add_argument("--conversations", type=int, default=120)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--think", type=float, default=5.0, help="mean seconds between a reply and the next turn")
    ap.add_argument("--slo-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--controller", default="laser", help="laser, distserve, colocated, colocated-laser")
    args = ap.parse_args()
    from laser.controller import get_controller

    p = args.prefill or args.instances // 2
    mixed = not get_controller(args.controller).disaggregated
    spec = ClusterSpec(0, 0, args.instances) if mixed else ClusterSpec(p, args.instances - p, 0)
    good: dict[str, float] = {}
    failed: set[str] = set()
    print(f"SIMULATED {args.model} on A100 (analytic), controller {args.controller}, "
          f"{f'{args.instances}M' if mixed else f'{p}P{args.instances - p}D'}, {args.conversations} conversations "
          f"x {args.turns} turns, system prompt {args.system} tokens, SLO x{args.slo_scale}")
    for rate in (float(x) for x in args.rates.split(",")):
        reqs_for = lambda: conversations(args.conversations, rate, args.turns, args.system, args.think,  # noqa: E731
                                         args.slo_scale, args.seed)
        line = [f"rate {rate:g} conv/s:"]
        for label, aware in (("aware", True), ("blind", False)):
            cfg = paper_config(args.model, enable_prefix_caching=True, cache_aware_routing=aware)
            sim = ClusterSim(args.controller, spec, cfg)
            res = sim.run(reqs_for())
            att = attainment(res.requests)
            q = sum(i.scheduler.prefix_cache_queries for i in sim.instances)
            h = sum(i.scheduler.prefix_cache_hits for i in sim.instances)
            line.append(f"{label} attainment {att:6.1%} hit rate {h / max(1, q):6.1%}")
            if att >= 0.9 and label not in failed:
                good[label] = rate
            elif att < 0.9:
                failed.add(label)
        print("  " + " | ".join(line), flush=True)
    print(f"goodput (conversations/s, highest grid rate passing with every lower one passing): "
          f"aware {good.get('aware', 0.0):g}, blind {good.get('blind', 0.0):g}")


if __name__ == "__main__":
    main()
