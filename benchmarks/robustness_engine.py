"""Real-engine spot checks of the robustness grid (issue 16, item 3): does the simulator's
verdict at a grid point hold on the real engine?

Reads the JSON of a ``benchmarks/robustness.py`` run (its ``--kind`` rows, ``avx2-fp32`` or
``amx-bf16``: the measured profile of this CPU kind), picks the points with the lowest, the
median and the highest laser / sarathi:best ratio, and at each one runs, on the REAL engine
(SmolLM2-135M in the kind's dtype, 1 torch thread, planning with the same shipped profile) and in the SIMULATOR on the same
requests, arrivals and SLO targets:

* ``laser`` and ``sarathi@<best budget>`` (EDF queue, the budget the grid found best), at
  the rate where the simulator put Laser's goodput (a rate above sarathi:best's goodput).
  The engine plans with the profile as it is, or (``--calibrate``) with it calibrated online
  as ``laser serve`` does by default (each policy its own calibration).

The simulator predicts laser passes (>= 90 % of requests within SLO) and sarathi fails there.
Printed per point: attainment (and per class) of both, real vs simulated, mean TTFT and P99
TBT. A real run lasts as long as its arrivals (rate x requests), so each point uses the first
``n`` requests of the point's workload with ``n = min(num_prompts, rate x --seconds)`` (at
least ``--min-requests``); the simulator runs that same prefix, so the two columns compare
like with like (the prefix's knee can differ from the 40-request grid's knee).

    python benchmarks/robustness.py --quick --kinds avx2-fp32 --budgets 32,64,128,256
    python benchmarks/robustness_engine.py bench-results/robustness.json --seconds 240

Run it on a quiet machine: the engine's timing is real, and the profile the engine plans
with must match the machine (see docs/benchmarks.md on stale profiles).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from robustness import hardware_kinds, slo_table  # noqa: E402  (script directory is on sys.path)

from laser.bench.hardware_kinds import spot_check_rows
from laser.bench.runner import Benchmark, EngineTarget, SimTarget
from laser.bench.workloads import sample_mix
from laser.core.config import SchedulerConfig
from laser.latency import CalibratedLatencyModel


def pick_points(rows: list[dict]) -> list[tuple[str, dict]]:
    """(name, row) for the worst, median and best ratio among ``rows`` with a ratio (one row
    can fill several names when fewer than three points have a ratio)."""
    rated = sorted((r for r in rows if r.get("ratio") is not None), key=lambda r: r["ratio"])
    if not rated:
        raise SystemExit("no grid point with a ratio in that JSON")
    return [("worst", rated[0]), ("median", rated[(len(rated) - 1) // 2]), ("best", rated[-1])]


def summary_row(run) -> dict:
    o = run.summary.overall
    return {"attainment": run.attainment, "class_attainment": run.class_attainment(),
            "ttft_mean_s": o.ttft_mean, "tbt_p99_s": o.tbt_p99, "unfinished": run.unfinished,
            "wall_s": run.wall_s}


def check_point(engine, kind: dict, row: dict, tokenizer, seconds: float, min_requests: int,
                calibrate: bool = False) -> dict:
    """Run laser and sarathi@best on the real engine and in the simulator at Laser's
    simulated goodput rate of ``row``; returns both policies' summaries, real and simulated."""
    mixv = tuple(float(x) for x in row["mix"].split(":"))
    requests = sample_mix(mixv, row["num_prompts"], row["seed"], row["length_scale"], tokenizer, None)
    slos = slo_table(kind, requests, tokenizer, row["slo_scale"], row["seed"])  # as the grid run judged them
    rate = row["laser_goodput_rps"]
    n = max(min_requests, min(len(requests), math.ceil(rate * seconds)))
    budget = row["best_budget"]
    sar = f"sarathi@{budget}"
    policies = {"laser": ("laser", {"queue_order": "edf"}),
                sar: ("sarathi", {"queue_order": "edf", "max_num_batched_tokens": budget})}
    # on the engine each policy plans with its own calibration (from 1.0), or with the profile as is
    engine_targets = {lb: EngineTarget(pol, engine=engine, label=lb, config_overrides=cfg,
                                       latency_model=CalibratedLatencyModel(kind["lm"]) if calibrate else kind["lm"])
                      for lb, (pol, cfg) in policies.items()}
    sim_targets = {lb: SimTarget(pol, kind["lm"], config=SchedulerConfig(policy=pol, **cfg),
                                 num_blocks=kind["num_blocks"], label=lb)
                   for lb, (pol, cfg) in policies.items()}
    prefix = requests[:n]
    real = Benchmark(engine_targets, prefix, slos, seed=row["seed"])
    sim = Benchmark(sim_targets, prefix, slos, seed=row["seed"])
    out = {"rate_rps": rate, "requests": n, "budget": budget, "policies": {}}
    for label in ("laser", sar):
        s = sim.probe(label, rate, early_stop=False)
        t1 = time.perf_counter()
        r = real.probe(label, rate, early_stop=False)
        out["policies"][label] = {"real": summary_row(r), "sim": summary_row(s)}
        cal = engine_targets[label].lm
        if isinstance(cal, CalibratedLatencyModel):  # how far the profile was off while this ran
            qs = [cal.ratio_quantile(x) for x in (0.1, 0.5, 0.9)]
            out["policies"][label]["calibration"] = {"factor": cal.factor, "steps": cal.observed,
                                                     "ratio_quantiles": qs}
            print(f"  {'':<12} calibration factor {cal.factor:.2f} over {cal.observed} steps; measured/predicted "
                  f"P10/P50/P90 {' / '.join(f'{x:.2f}' for x in qs)}", flush=True)
        print(f"  {label:<12} real {r.attainment:.2f}  sim {s.attainment:.2f}  "
              f"(real mean TTFT {r.summary.overall.ttft_mean:.2f} s, P99 TBT {r.summary.overall.tbt_p99:.3f} s; "
              f"{time.perf_counter() - t1:.0f} s)", flush=True)
    return out


def fmt_classes(ca: dict) -> str:
    return " ".join(f"{c} {v:.2f}" for c, v in sorted(ca.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid_json", help="JSON written by benchmarks/robustness.py (with rows of --kind)")
    ap.add_argument("--kind", default="avx2-fp32", choices=["avx2-fp32", "amx-bf16"],
                    help="the CPU kind whose grid rows and shipped profile to use; the engine runs in its dtype "
                         "(this machine must be of that kind)")
    ap.add_argument("--seconds", type=float, default=240.0, help="arrival span per real run (sets the prefix size)")
    ap.add_argument("--min-requests", type=int, default=12, help="at least this many requests per run")
    ap.add_argument("--json", default="bench-results/robustness-engine.json", help="results JSON path")
    ap.add_argument("--calibrate", action="store_true",
                    help="the engine plans with the profile calibrated online (as `laser serve` does by "
                         "default; laser.latency.calibrated), not with the profile as is")
    ap.add_argument("--only", default=None, help="run only these of worst,median,best")
    args = ap.parse_args(argv)

    from laser.bench.workloads import HFTokenizer
    from laser.cli import set_threads
    from laser.core.config import CacheConfig
    from laser.frontend.engine import Engine

    grid = json.loads(Path(args.grid_json).read_text())
    try:
        rows, kind = spot_check_rows(grid, args.kind, hardware_kinds())
    except ValueError as e:
        raise SystemExit(f"{args.grid_json}: {e}" if str(e).startswith("no ") else str(e)) from None
    set_threads(1)
    # the engine plans with the same fitted model the simulator runs on
    engine = Engine(policy="laser", dtype=kind["dtype"], cache=CacheConfig(kv_cache_gib=1.0), latency_model=kind["lm"])
    if engine.kv_cache.num_blocks != kind["num_blocks"]:
        print(f"note: the engine's KV pool has {engine.kv_cache.num_blocks} blocks, the simulator "
              f"{kind['num_blocks']}", flush=True)
    tokenizer = HFTokenizer(engine.tokenizer)
    EngineTarget("vllm", engine=engine).warmup()
    out = {"benchmark": "benchmarks/robustness_engine.py", "grid": args.grid_json, "calibrated": args.calibrate,
           "command": "python benchmarks/robustness_engine.py " + " ".join(sys.argv[1:]),
           "engine": f"SmolLM2-135M, {kind['dtype']}, 1 thread", "profile": kind["why"], "points": []}
    done: dict[int, dict] = {}
    picked = pick_points(rows)
    if args.only:
        picked = [(n, r) for n, r in picked if n in args.only.split(",")]
    for name, row in picked:
        if id(row) in done:  # fewer than three rated points: one row fills several names
            out["points"].append({**done[id(row)], "name": name})
            continue
        print(f"[{name}] mix {row['mix']} seed {row['seed']} len x{row['length_scale']:g} SLO x{row['slo_scale']:g}: "
              f"grid laser {row['laser_goodput']} / sarathi:best {row['sarathi_best_goodput']} "
              f"= {row['ratio']:.2f}x", flush=True)
        res = check_point(engine, kind, row, tokenizer, args.seconds, args.min_requests, args.calibrate)
        done[id(row)] = {"name": name, **{k: row[k] for k in ("mix", "seed", "length_scale", "slo_scale", "ratio")},
                         **res}
        out["points"].append(done[id(row)])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    print("\npoint   mix    seed len  slo  rate   n  policy        real   sim   real per class")
    for p in out["points"]:
        for label, v in p["policies"].items():
            print(f"{p['name']:<7} {p['mix']:<6} {p['seed']:>4} {p['length_scale']:>3g} {p['slo_scale']:>4g} "
                  f"{p['rate_rps']:.3f} {p['requests']:>3}  {label:<12} {v['real']['attainment']:.2f}  "
                  f"{v['sim']['attainment']:.2f}  {fmt_classes(v['real']['class_attainment'])}")
    print(f"results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
