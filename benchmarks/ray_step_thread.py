"""Decode step time inside a Ray instance actor: stepped on the thread that built its engine, or
on one of the actor's pool threads (issue 26: a second thread's OpenMP team).

Starts a local Ray session and, per variant, one ``mixed`` instance actor with ``--threads``
torch threads:

* ``actor``: the cluster's own launch path (:func:`laser.cluster.ray_actors.start_instances`,
  what ``laser serve --mixed-instances`` and :func:`~laser.cluster.launch.start_cluster` use);
* ``pool``: the same :class:`~laser.instance.worker.InstanceWorker` as an actor of the same
  concurrency with ``own_thread=False`` -- built on the thread that runs the actor's
  ``__init__`` and stepped on whichever of its pool threads takes the call (how every instance
  actor ran before it had an owner thread).

Per batch size the variants take turns (blocks of ``--steps`` decode steps each, ``--rounds``
times, alternating which goes first): ``batch`` greedy requests of a 16-token prompt are added,
the steps run until all of them decode, and then the per-step time each step answer reports
(``step_s``, inside the actor: no Ray round trip) is recorded for ``--steps`` steps in which all
``batch`` requests made a token. Prints the median and the interquartile range per variant and
batch size, and the ratio pool / actor. Shuts Ray down at the end.

    python benchmarks/ray_step_thread.py --threads 2 --batches 1 8 [--variants actor pool]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray

from laser.cluster import ray_actors
from laser.core.request import Request, SamplingParams


def start(variant: str, threads: int, kw: dict, iid: int):
    """A ``mixed`` instance actor's handle (see the module docstring for the variants)."""
    if variant == "actor":
        return ray_actors.start_instances([(iid, "mixed")], kw, threads=threads, call_timeout_s=600.0,
                                          start_timeout_s=900.0)[0]
    cls = ray_actors._actor_class()
    actor = cls.options(num_cpus=threads).remote(iid, "mixed", kw, threads, own_thread=False)
    desc = ray.get(actor.describe.remote(), timeout=900.0)
    return ray_actors.RayHandle(actor, desc, 600.0)


def block(h, batch: int, steps: int, tag: str) -> list[float]:
    """``steps`` decode step times (ms) at ``batch`` running requests on instance ``h``."""
    sp = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        h.call("add_request", Request([(7 * j + i) % 1000 + 3 for j in range(16)], sp, req_id=rid,
                                      arrival_time=time.monotonic()))
    out: list[float] = []
    decoding: set[str] = set()  # requests past their first token (prefill done)
    while len(out) < steps:
        res = h.call("step")
        made = [ev[0] for ev in res["events"]]
        if len(decoding) == batch and len(made) == batch:
            out.append(res["step_s"] * 1e3)
        decoding.update(made)
    for rid in ids:
        h.call("abort", rid)
    while h.call("step")["busy"]:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["actor", "pool"], choices=["actor", "pool"])
    args = ap.parse_args()
    ray.init(num_cpus=args.threads * len(args.variants), include_dashboard=False,
             object_store_memory=ray_actors.OBJECT_STORE_BYTES, log_to_driver=False)
    try:
        kw = dict(model=args.model, policy="vllm", dtype=args.dtype, latency_calibration=False, seed=0)
        handles = {v: start(v, args.threads, kw, i) for i, v in enumerate(args.variants)}
        for v, h in handles.items():  # one warm-up block each
            block(h, 1, 5, f"warm-{v}")
        for b in args.batches:
            res: dict[str, list[float]] = {v: [] for v in args.variants}
            for r in range(args.rounds):
                order = args.variants if r % 2 == 0 else args.variants[::-1]
                for v in order:
                    res[v] += block(handles[v], b, args.steps, f"{v}-{b}-{r}")
            med = {v: statistics.median(x) for v, x in res.items()}
            for v, x in res.items():
                q = statistics.quantiles(x, n=4)
                print(f"threads {args.threads} batch {b:3d} {v:6s} step median {med[v]:7.2f} ms "
                      f"(IQR {q[0]:.2f}-{q[2]:.2f}, n={len(x)})", flush=True)
            if "actor" in med and "pool" in med:
                print(f"threads {args.threads} batch {b:3d} pool / actor = {med['pool'] / med['actor']:.2f}x",
                      flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
