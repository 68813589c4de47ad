"""Where a real engine's step time departs from its latency profile, part by part (REAL engine).

Runs the embedded model (SmolLM2-135M) on this CPU with one policy, planning with a latency
profile (default: the shipped AVX2 profile the simulator grids use), and times every complete
step and its parts with ``time.perf_counter`` around the executor's own hooks
(:class:`laser.model.runner.ModelRunner`): the layer calls (``forward_layer``), the batch
composition (``compose``: attention metadata, once per constant-composition segment), the
embedding (``join``) and the LM head + sampling (``finish``). Each is set beside the profile's
prediction of the same work (``step_layer_time`` per call, ``embed_time``, ``head_time``; the model
has no composition term). Two workloads: ``--rate R`` releases ``--requests`` requests with
Poisson arrivals through :func:`laser.frontend.online.run_online` (steps as a server sees them: small and
varied), without it they all arrive at once (large batched steps). Greedy sampling, classes
code / chat / summarization in turn (TBT 0.2 / 0.4 / 0.8 s).

The simulator runs on the profile's predictions; a measured / predicted ratio away from 1 is a
gap between the simulated and the real engine (the online calibration,
:mod:`laser.latency.calibrated`, scales the whole prediction by one factor; a part the model
lacks, or one whose error depends on the step's shape, it cannot correct).

Run it with nothing else on the machine. Usage:
    python benchmarks/latency_gap.py [--policy laser] [--requests 24] [--rate 0.5] [--profile PATH]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_PROFILE = HERE / "profiles" / "avx2-fp32-smollm2-135m.json"


class Tap:
    """Wraps a runner's executor hooks to time each step and its parts (seconds)."""

    def __init__(self, runner, lm):
        self.lm, self.runner = lm, runner
        self.steps: list[dict] = []  # one per complete step
        self.calls: list[tuple[tuple, tuple, float]] = []  # (query lens, context lens, seconds) per layer call
        self._part = dict.fromkeys(("join", "compose", "finish"), 0.0)
        self._segments = 0
        self._batch: tuple[tuple, tuple] = ((), ())
        self._last_end = time.perf_counter()
        ex, comp, model = runner.execute, runner.compose, runner.model
        fl = model.forward_layer

        def execute(plan, requests, stop_at=None, **kw):
            self._part = dict.fromkeys(self._part, 0.0)
            self._segments = 0
            ncalls = len(self.calls)
            t = time.perf_counter()
            idle = t - self._last_end
            res = ex(plan, requests, stop_at=stop_at, **kw)
            self._last_end = end = time.perf_counter()
            if plan.works and res.stopped_layer >= plan.last_layer:
                n = plan.num_layers
                self.steps.append({
                    "wall": end - t, "pred": lm.predict_iteration(plan), "idle_before": idle,
                    "layers": sum(c[2] for c in self.calls[ncalls:]),
                    "layers_pred": sum(lm.step_layer_time(q, c) for q, c, _ in self.calls[ncalls:]),
                    "embed_pred": lm.embed_time(sum(w.num_tokens for w in plan.works if w.layer_start == 0)),
                    "head_pred": lm.head_time(sum(1 for w in plan.works if w.layer_end == n and w.sample)),
                    "segments": self._segments, **self._part})
            return res

        def compose(active, layers):
            self._segments += 1
            self._batch = (tuple(w.num_tokens for w in active), tuple(w.context_len for w in active))
            t = time.perf_counter()
            out = comp(active, layers)
            self._part["compose"] += time.perf_counter() - t
            return out

        def forward_layer(i, hidden, meta):
            t = time.perf_counter()
            out = fl(i, hidden, meta)
            self.calls.append((*self._batch, time.perf_counter() - t))
            return out

        for name in ("join", "finish"):
            def timed(*a, _f=getattr(runner, name), _n=name):
                t = time.perf_counter()
                out = _f(*a)
                self._part[_n] += time.perf_counter() - t
                return out
            setattr(runner, name, timed)
        runner.execute, runner.compose, model.forward_layer = execute, compose, forward_layer

    def reset(self) -> None:
        self.steps.clear()
        self.calls.clear()


def pct(v, qs=(10, 50, 90)) -> str:
    return " / ".join(f"{x:.3f}" for x in np.percentile(v, qs))


def report(tap: Tap) -> None:
    st = tap.steps
    if not st:
        print("no complete step was timed")
        return
    col = {k: np.array([s[k] for s in st]) for k in st[0]}
    n = len(st)
    r = col["wall"] / col["pred"]
    print(f"{n} complete steps, mean {1e3 * col['wall'].mean():.1f} ms measured, {1e3 * col['pred'].mean():.1f} ms "
          f"predicted; measured / predicted per step P10/P50/P90 {pct(r)}, total {col['wall'].sum() / col['pred'].sum():.3f}")
    lt = np.array([c[2] for c in tap.calls])
    lp = np.array([tap.lm.step_layer_time(q, c) for q, c, _ in tap.calls])
    dec = np.array([all(x == 1 for x in q) for q, _, _ in tap.calls])
    print(f"layer calls ({len(lt)}): measured / predicted P10/P50/P90 {pct(lt / lp)}, total {lt.sum() / lp.sum():.3f}; "
          f"decode-only {pct(lt[dec] / lp[dec]) if dec.any() else '-'}; with prefill "
          f"{pct(lt[~dec] / lp[~dec]) if (~dec).any() else '-'}")
    ntok = np.array([sum(q) for q, _, _ in tap.calls])
    bins = [(1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, 1 << 30)]
    print("layer calls by tokens in the call: " + "; ".join(
        f"{lo}{'-' + str(hi) if hi != lo and hi < 1 << 30 else ('+' if hi != lo else '')}: "
        f"{np.median(lt[m] / lp[m]):.3f} ({int(m.sum())})"
        for lo, hi in bins if (m := (ntok >= lo) & (ntok <= hi)).any()) + "  (median measured / predicted, calls)")
    print("per step, ms (measured | predicted): "
          f"layer calls {1e3 * col['layers'].mean():.1f} | {1e3 * col['layers_pred'].mean():.1f}; "
          f"compose {1e3 * col['compose'].mean():.2f} ({col['segments'].mean():.1f} segments) | not modelled; "
          f"embed {1e3 * col['join'].mean():.2f} | {1e3 * col['embed_pred'].mean():.2f}; "
          f"head + sampling {1e3 * col['finish'].mean():.2f} | {1e3 * col['head_pred'].mean():.2f}; "
          f"walk and the rest {1e3 * (col['wall'] - col['layers'] - col['compose'] - col['join'] - col['finish']).mean():.2f}"
          " | 0")
    for name, mask in (("one segment", col["segments"] == 1), ("several segments", col["segments"] > 1),
                       ("predicted < 60 ms", col["pred"] < 0.06), ("predicted >= 60 ms", col["pred"] >= 0.06),
                       ("after > 20 ms idle", col["idle_before"] > 0.02)):
        if mask.any():
            print(f"  {name:<20} {int(mask.sum()):>4} steps: measured / predicted P50 {np.median(r[mask]):.3f}, "
                  f"P80 {np.percentile(r[mask], 80):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="laser", help="scheduling policy (default: laser)")
    ap.add_argument("--requests", type=int, default=24, help="requests timed after the warm-up (default: 24)")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this rate (req/s); all at once without")
    ap.add_argument("--profile", default=str(DEFAULT_PROFILE), help="latency profile the scheduler plans with")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default: 0)")
    a = ap.parse_args(argv)
    if a.requests < 1:
        ap.error(f"--requests must be >= 1, got {a.requests}")
    if a.rate is not None and not a.rate > 0:
        ap.error(f"--rate must be > 0, got {a.rate}")

    from laser.cli import set_threads
    from laser.profiler.pipeline import cpu_hardware_string
    from laser.core.config import CacheConfig
    from laser.frontend.engine import Engine
    from laser.latency import FittedLatencyModel
    from laser.frontend.online import TimedRequest, run_online
    from laser.core.request import SLO, SamplingParams

    from laser.latency import LatencyProfileError
    from laser.scheduler import POLICIES

    if a.policy not in POLICIES:
        ap.error(f"--policy {a.policy!r}: unknown; one of {', '.join(sorted(POLICIES))}")
    set_threads(1)
    try:
        lm = FittedLatencyModel.load(a.profile)
    except (LatencyProfileError, OSError, ValueError) as e:
        ap.error(f"--profile {a.profile}: {e}")
    engine = Engine(policy=a.policy, dtype="float32", cache=CacheConfig(kv_cache_gib=1.0), latency_model=lm)
    tap = Tap(engine.runner, lm)
    rng = random.Random(a.seed)
    classes = [SLO(1.0, 0.2, "code"), SLO(2.0, 0.4, "chat"), SLO(8.0, 0.8, "summarization")]
    vocab = engine.model_config.vocab_size

    def stream(n: int, rate: float | None, lo: int, hi: int) -> list:
        t, out = 0.0, []
        for i in range(n):
            t += rng.expovariate(rate) if rate else 0.0
            ids = [rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))]
            sp = SamplingParams(max_tokens=rng.randint(16, 64), temperature=0.0, ignore_eos=True)
            out.append(TimedRequest(t, ids, sp, classes[i % 3], req_id=f"gap-{len(tap.steps)}-{i}"))
        return out

    run_online(engine, stream(4, None, 32, 64))  # warm-up
    tap.reset()
    t0 = time.perf_counter()
    run_online(engine, stream(a.requests, a.rate, 40, 300))
    print(f"REAL engine: SmolLM2-135M fp32, 1 thread, {cpu_hardware_string()}; policy "
          f"{a.policy}; {a.requests} requests {'at once' if a.rate is None else f'at {a.rate:g} req/s'}; "
          f"profile {Path(a.profile).name}; {time.perf_counter() - t0:.0f} s")
    report(tap)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
