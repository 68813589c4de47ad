"""Does admission refuse only what would miss, and admit only what is served in time? (issue 28,
item 3; SIMULATED, virtual time.) One mixed Laser instance behind the server's admission
(``--on-infeasible reject``: :class:`laser.sim.admitting.AdmittingSim`), bursts of mixed prompts:
summarization (80-250 tokens, 8 s), chat (10-60 tokens, 1 s) and code (10-40 tokens, 0.5 s)
at the shipped classes x4, in random order, 0-40 ms apart, 16 output tokens each. CPU shapes: ``cpu``
(a layer call's fixed cost dominates: SmolLM2 on one core of an AVX2 VM, ``burst_sim.py``'s),
``mid`` / ``fast`` (1.7x / 3x faster, their bursts as much denser) and ``slow`` (1.5x slower).

Per shape and queue-time model (``--models``; default: the instance's, :func:`laser.scheduler.ttft.model_for`):
requests with a TTFT target, admitted, refused, **false admits** (admitted and missed its target)
and **false refuses** (refused, but a replay with it admitted -- every other decision kept -- serves
it in time without making an admitted request miss). A false admit is worse than a false refuse.

    PYTHONPATH=. python benchmarks/admission_burst.py [--seeds 1-16] [--shapes cpu,mid,fast,slow] [--models default]
"""

from __future__ import annotations

import argparse
import random

from laser.core.request import Request, SamplingParams
from laser.core.slo import SLOClasses
from laser.latency import SimpleLatencyModel
from laser.sim.admitting import AdmittingSim

N = 30


def _shape(speed: float) -> tuple[SimpleLatencyModel, float]:
    """``burst_sim.py``'s ``cpu`` latency shape ``speed`` times faster, and the burst density (1 / speed)."""
    return SimpleLatencyModel(num_layers=N, per_layer=4.4e-3 / speed, per_token=1.46e-4 / speed,
                              per_context=2e-8 / speed), 1 / speed


SHAPES = {"cpu": _shape(1.0), "mid": _shape(1.7), "fast": _shape(3.0), "slow": _shape(1 / 1.5)}
SLOS = SLOClasses.load(scale=4.0)
KINDS = {"summarization": (80, 250), "chat": (10, 60), "code": (10, 40)}


def burst(seed: int, density: float, n: int = 18) -> list[tuple[str, int, float, str]]:
    """``n`` prompts (a third of each kind, shuffled), 0-40 ms apart times ``density``:
    ``[(req id, prompt tokens, arrival s, class)]``."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS for _ in range(n // 3)]
    rng.shuffle(kinds)
    out, t = [], 0.0
    for i, k in enumerate(kinds):
        lo, hi = KINDS[k]
        out.append((f"{k}{i}", rng.randint(lo, hi), t, k))
        t += rng.uniform(0.0, 0.04) * density
    return out


def run(spec, lm, model: str | None, replay: dict | None = None) -> tuple[AdmittingSim, dict[str, Request]]:
    """``spec`` (:func:`burst`) through admission (``reject``) on a simulated instance of ``lm``
    (``replay``: decisions by id taken as given)."""
    sim = AdmittingSim("laser", N, lm, "reject", SLOS, replay=replay, model=model)
    reqs = {}
    for rid, prompt, t, cls in spec:
        reqs[rid] = Request([7] * prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                            SLOS.get(cls), arrival_time=t, req_id=rid)
        sim.submit(reqs[rid])
    sim.run(max_steps=500_000, before_step=sim.publish)
    return sim, reqs


def _met(r: Request) -> bool:
    return bool(r.token_times) and r.token_times[0] - r.arrival_time <= r.slo.ttft + 1e-9


def judge(spec, lm, model: str | None) -> tuple[int, int, int, int, int]:
    """(requests with a target, admitted, refused, false admits, false refuses) of one burst."""
    sim, reqs = run(spec, lm, model)
    admitted = [rid for rid, (d, _) in sim.decisions.items() if d == "admitted" and reqs[rid].slo.ttft is not None]
    refused = [rid for rid, (d, _) in sim.decisions.items() if d == "rejected"]
    false_admits = sum(not _met(reqs[rid]) for rid in admitted)
    false_refuses = 0
    decided = {rid: d for rid, (d, _) in sim.decisions.items()}
    for rid in refused:
        alt_reqs = run(spec, lm, model, {**decided, rid: "admitted"})[1]
        hurt = any(_met(reqs[a]) and not _met(alt_reqs[a]) for a in admitted)
        false_refuses += _met(alt_reqs[rid]) and not hurt
    with_target = sum(SLOS.get(cls).ttft is not None for *_, cls in spec)
    return with_target, len(admitted), len(refused), false_admits, false_refuses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1-16", help="a range lo-hi or a comma list")
    ap.add_argument("--shapes", default="cpu,mid,fast,slow")
    ap.add_argument("--models", default="default", help="queue-time models (default: the instance's)")
    ap.add_argument("--requests", type=int, default=18)
    args = ap.parse_args()
    lo, _, hi = args.seeds.partition("-")
    seeds = range(int(lo), int(hi) + 1) if hi else [int(s) for s in args.seeds.split(",")]
    for shape in args.shapes.split(","):
        lm, density = SHAPES[shape]
        for m in args.models.split(","):
            tot = [0] * 5
            for seed in seeds:
                row = judge(burst(seed, density, args.requests), lm, None if m == "default" else m)
                tot = [a + b for a, b in zip(tot, row)]
                print(f"    {shape} {m} seed {seed}: with target {row[0]}, admitted {row[1]}, refused {row[2]}, "
                      f"false admits {row[3]}, false refuses {row[4]}", flush=True)
            print(f"{shape:>5} {m:>8} seeds {seeds[0]}-{seeds[-1]}: with target {tot[0]}, admitted {tot[1]}, "
                  f"refused {tot[2]}, false admits {tot[3]}, false refuses {tot[4]}", flush=True)


if __name__ == "__main__":
    main()
