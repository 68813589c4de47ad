"""KV hand-off cost on a real 1P1D Ray cluster: streamed layer by layer during the final
prefill chunk vs sent whole after it.

One Ray 1P1D cluster (``laser`` controller, so the decode instance is chosen at arrival); the
front end's ``stream_kv`` switch alternates between the two modes request by request (same
actors, same prompts, interleaved), one prompt at a time. Per prompt length it prints the KV
bytes and medians of

* hand-off after prefill end: the prefill instance's export (right after the last layer and
  the first token) -> the request adopted by the decode instance (a shared host clock);
* the first token gap: first -> second token as the client sees it (the hand-off plus one
  decode step and the front end's round trips);
* TTFT: arrival -> first token (streaming's sends run inside the prefill step).

    python benchmarks/ray_transfer.py [--model PATH] [--lengths 64 256 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

from laser.cluster.engine import start_cluster
from laser.core.request import SamplingParams


def one(cl, prompt: list[int], req_id: str, stream: bool) -> dict:
    """Run one request alone; its hand-off and token timings (seconds)."""
    cl.stream_kv = stream
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    n0, b0 = len(cl.stats.handoff_seconds), cl.stats.transfer_bytes
    streamed0 = cl.stats.streamed_transfers
    req = cl.add_request(prompt, sp, req_id=req_id)
    out = [o for o in cl.drain(600) if o.finished][-1]
    assert cl.stats.streamed_transfers - streamed0 == int(stream), "mode not taken"
    t = out.token_times
    return {"handoff": cl.stats.handoff_seconds[n0], "gap": t[1] - t[0], "ttft": t[0] - req.arrival_time,
            "bytes": cl.stats.transfer_bytes - b0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cl = start_cluster("laser", 1, 1, use_ray=True, model=args.model, dtype="float32", latency_profile=None,
                       threads_per_instance=1)
    layers = next(iter(cl.handles.values())).num_layers
    cl.add_request([5] * 16, SamplingParams(max_tokens=2), req_id="warmup")
    cl.drain(600)
    rows = []
    for n in args.lengths:
        res = {True: [], False: []}
        for r in range(args.repeats):
            prompt = [(7 * j + r) % 1000 + 3 for j in range(n)]
            for stream in (r % 2 == 0, r % 2 != 0):  # alternate which mode goes first
                res[stream].append(one(cl, prompt, f"t{n}-{r}-{int(stream)}", stream))
        med = {s: {k: statistics.median(x[k] for x in v) for k in ("handoff", "gap", "ttft")} for s, v in res.items()}
        rows.append((n, res[True][0]["bytes"], med))
    print(f"layers {layers}; median of {args.repeats} requests per mode, modes interleaved; seconds")
    print("| prompt tokens | KV bytes | hand-off after prefill end: whole / streamed | first token gap: "
          "whole / streamed | TTFT: whole / streamed |")
    print("|---|---|---|---|---|")
    for n, b, m in rows:
        w, s = m[False], m[True]
        print(f"| {n} | {b} | {w['handoff']:.4f} / {s['handoff']:.4f} ({w['handoff'] / s['handoff']:.1f}x) | "
              f"{w['gap']:.4f} / {s['gap']:.4f} | {w['ttft']:.3f} / {s['ttft']:.3f} |")
    import ray

    ray.shutdown()


if __name__ == "__main__":
    main()
