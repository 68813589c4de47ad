"""KV hand-off cost on a real 1P1D cluster: bytes and seconds per transfer, per layer.

Runs the same prompts through a Ray 1P1D cluster and an in-process 1P1D cluster (local
handles: the same export/import with no serialization), one prompt at a time, and prints
bytes, seconds per transfer and per layer for each prompt length.

    python benchmarks/ray_transfer.py [--model PATH] [--lengths 64 256 1024]
"""

from __future__ import annotations

import argparse
import statistics

from laser.cluster_engine import start_cluster
from laser.request import SamplingParams


def measure(cl, lengths: list[int], repeats: int) -> dict[int, tuple[int, float]]:
    out = {}
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for n in lengths:
        secs = []
        for r in range(repeats):
            before_b, before_n = cl.stats.transfer_bytes, len(cl.stats.transfer_seconds)
            cl.add_request([(7 * j + r) % 1000 + 3 for j in range(n)], sp, req_id=f"t{n}-{r}")
            cl.drain(600)
            secs.extend(cl.stats.transfer_seconds[before_n:])
            nbytes = cl.stats.transfer_bytes - before_b
        out[n] = (nbytes, statistics.median(secs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    kw = dict(model=args.model, dtype="float32", latency_profile=None, threads_per_instance=1)
    ray_cl = start_cluster("laser", 1, 1, use_ray=True, **kw)
    local_cl = start_cluster("laser", 1, 1, use_ray=False, **kw)
    layers = next(iter(ray_cl.handles.values())).num_layers
    rows = []
    for _ in range(1):  # interleaved per length below
        for n in args.lengths:
            rb, rs = measure(ray_cl, [n], args.repeats)[n]
            lb, ls = measure(local_cl, [n], args.repeats)[n]
            rows.append((n, rb, rs, ls))
    print(f"layers {layers}; median of {args.repeats} transfers; seconds = send -> written on the decode instance")
    print("| prompt tokens | KV bytes | Ray s/transfer | Ray ms/layer | in-process s/transfer | ratio |")
    print("|---|---|---|---|---|---|")
    for n, b, rs, ls in rows:
        print(f"| {n} | {b} | {rs:.4f} | {rs / layers * 1e3:.2f} | {ls:.4f} | {rs / ls:.1f}x |")
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
