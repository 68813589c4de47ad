"""Fault drill (issue 28 item 6): a decode instance frozen mid-stream, as by SIGSTOP.

A 1P2D cluster on local Ray (one actor per core), four greedy chat streams; once every stream
decodes, the decode actor holding the most is stopped (SIGSTOP) and one more request arrives
0.5 s later (its Alg. 2 fan-out asks the frozen actor). Printed: seconds from the stop to each
moved stream's next token, the front end's decode gauge of the frozen actor after they moved,
and -- after SIGCONT, with the front end idle for 5 s as a server between requests -- what the
woken actor still holds (decoding requests, KV blocks in use).

The same file runs against an older checkout (it passes ``stall_timeout_s`` only where
``start_cluster`` takes it), for before/after figures::

    python benchmarks/frozen_instance.py                 # the embedded SmolLM2-135M, fp32
    python benchmarks/frozen_instance.py --model DIR --stall-timeout 3
"""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    ap.add_argument("--stall-timeout", type=float, default=3.0, help="decode stall timeout, s (default 3)")
    ap.add_argument("--call-timeout", type=float, default=5.0)
    ap.add_argument("--step-timeout", type=float, default=60.0)
    args = ap.parse_args()

    import ray

    from laser.cluster.launch import start_cluster
    from laser.core.config import SchedulerConfig
    from laser.core.request import SamplingParams
    from laser.latency import cpu_hardware_string

    kw = dict(model=args.model, dtype="float32", scheduler=SchedulerConfig(max_num_batched_tokens=64),
              call_timeout_s=args.call_timeout, step_timeout_s=args.step_timeout)
    if "stall_timeout_s" in inspect.signature(start_cluster).parameters:
        kw["stall_timeout_s"] = args.stall_timeout
    print(f"CPU: {cpu_hardware_string()}; timeouts: {', '.join(f'{k}={v}' for k, v in kw.items() if 'timeout' in k)}")
    cl = start_cluster("laser", 1, 2, **kw)
    try:
        sp = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        for i in range(4):
            cl.add_request([(5 + 3 * i + j) % 500 + 3 for j in range(30 + 10 * i)], sp, slo="chat", req_id=str(i))
        seen: dict[str, int] = {}
        while not all(t.owner in (1, 2) and seen.get(r, 0) >= 3 for r, t in cl.requests.items()):
            for o in cl.step():
                seen[o.req_id] = seen.get(o.req_id, 0) + len(o.new_token_ids)
        victim = max((1, 2), key=lambda d: sum(t.owner == d for t in cl.requests.values()))
        moved = {r for r, t in cl.requests.items() if t.owner == victim}
        actor = cl.handles[victim].actor
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        resumed: dict[str, float] = {}
        try:
            late = False
            while cl.has_unfinished() and time.monotonic() - t0 < 120:
                if not late and time.monotonic() - t0 > 0.5:
                    cl.add_request([7] * 40, sp, slo="chat", req_id="late")
                    late = True
                for o in cl.step():
                    if o.req_id in moved and o.req_id not in resumed and o.new_token_ids:
                        resumed[o.req_id] = time.monotonic() - t0
            gauge = getattr(cl.last_reports.get(victim), "num_decoding", None)
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"moved streams {sorted(moved)}: next token {', '.join(f'{v:.2f}' for _, v in sorted(resumed.items()))} s "
              f"after the stop")
        print(f"front-end gauge of the frozen instance after they moved: decoding = {gauge}")
        time.sleep(5.0)  # the front end idle (no step), as a server between requests
        rep = ray.get(actor.report.remote(), timeout=60)
        print(f"woken, front end idle 5 s: it holds {rep.num_decoding} decoding requests, "
              f"{rep.used_blocks} of {rep.total_blocks} KV blocks")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
