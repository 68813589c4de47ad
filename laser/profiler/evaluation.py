"""Accuracy report of the latency model (``laser profile --evaluate``).

Held-out measurements on the real runner -- modules and whole layer calls on random
batches (:func:`random_layer_batches`), and whole iterations planned by every policy's
scheduler (:mod:`.snapshots`) -- timed like the profile (:class:`~.timing.Bench`), then
scored against the model's predictions (:func:`score`, :func:`format_report`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..latency import FittedLatencyModel, LatencyModel
from ..latency.fitting import fit
from ..model.runner import ModelRunner
from ..core.plan import StepPlan, Work
from .calls import ExecutorCalls
from .grid import ProfileGrid, fit_to_pool
from .pipeline import (
    collect_samples,
    default_grid,
    fit_profile,
    pool_tokens,
    profile_cases,
    profile_metadata,
    run_bench,
    runner_of,
    samples_from_cases,
)
from .snapshots import PlanReplay, PlanSnapshot, plan_kind, policy_snapshots, small_decode_snapshots
from .timing import Bench, Case


def accuracy(pred: float, actual: float) -> float:
    """``1 - |pred - actual| / actual``, clipped to [0, 1]."""
    if not actual > 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - abs(pred - actual) / actual))


def summarize(preds: Sequence[float], actuals: Sequence[float]) -> dict:
    """Mean and P10 accuracy (fractions), count, and the mean signed error (pred/actual - 1)."""
    if not len(actuals):
        return {"n": 0, "mean_accuracy": None, "p10_accuracy": None, "mean_bias": None}
    acc = np.array([accuracy(p, a) for p, a in zip(preds, actuals)])
    bias = np.array([p / a - 1.0 for p, a in zip(preds, actuals)])
    return {"n": int(len(acc)), "mean_accuracy": float(acc.mean()), "p10_accuracy": float(np.percentile(acc, 10)),
            "mean_bias": float(bias.mean())}


def random_layer_batches(count: int, *, max_tokens: int = 2048, max_context: int = 4096,
                         pool_tokens: int = 1 << 30, max_batch: int = 64, block_size: int = 16,
                         seed: int = 1) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Held-out layer steps ``(kind, query_lens, context_lens)``: decode batches of 1..max_batch
    with mixed contexts, prefill chunks of 16..max_tokens (some after cached context), mixed steps."""
    rng = np.random.default_rng(seed)
    cap = max(2, min(max_context, pool_tokens))

    def ctxs(b):
        # mixed contexts: short chats and long documents side by side
        long = rng.random(b) < 0.3
        split = max(3, min(512, cap))
        c = np.where(long, rng.integers(split - 1, max(split, cap + 1), b), rng.integers(2, split, b))
        return [int(x) for x in c]

    def chunk():
        q = int(round(math.exp(rng.uniform(math.log(16), math.log(max_tokens)))))
        q = max(2, min(q, max_tokens, cap))
        cached = int(rng.integers(0, q + 1)) if rng.random() < 0.5 else 0
        return q, min(q + cached, cap)

    out = []
    for k in range(count):
        kind = ("decode", "prefill", "mixed")[k % 3]
        q, c = [], []
        if kind in ("decode", "mixed"):
            b = int(rng.integers(1, max_batch + 1))
            q += [1] * b
            c += ctxs(b)
        if kind in ("prefill", "mixed"):
            for _ in range(1 if kind == "mixed" or rng.random() < 0.7 else 2):
                qi, ci = chunk()
                q.append(qi)
                c.append(ci)
        out.append((kind, *fit_to_pool(q, c, pool_tokens, block_size)))
    return out



@dataclass
class EvalSet:
    """Held-out measurements: what is timed (cases) and what describes it."""

    cases: list[Case]
    batches: list  # (kind, query_lens, context_lens) of the layer steps
    snaps: list  # PlanSnapshot of the iterations
    small: list  # PlanSnapshot of the small-batch decode iterations
    num_layers: int = 1  # layers of the model (a "layer_pass" case runs them all)


def _eval_set(runner: ModelRunner, calls: ExecutorCalls, planning_lm: LatencyModel, *, policies: Sequence[str],
              num_layer_steps: int, plans_per_policy: int, seed: int, max_tokens: int, max_batch: int,
              num_requests: int, num_small_decode: int = 12) -> EvalSet:
    if runner.bm.usage() > 0:
        raise ValueError("evaluate needs an idle engine (its KV pool is written to)")
    cfg = runner.model.config
    pool = pool_tokens(runner)
    rng = np.random.default_rng(seed)
    batches = random_layer_batches(num_layer_steps, max_tokens=min(max_tokens, cfg.max_position, pool),
                                   max_context=min(2 * max_tokens, cfg.max_position), pool_tokens=pool,
                                   max_batch=max_batch, block_size=runner.bm.block_size, seed=seed)
    snaps: list[PlanSnapshot] = []
    for k, pol in enumerate(policies):
        snaps += policy_snapshots(runner, pol, planning_lm, keep=plans_per_policy, seed=seed + k,
                                  num_requests=num_requests)
    gen = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    for k, (kind, q, c) in enumerate(batches):
        cases.append(Case(("layer", k), calls.layer_call(q, c)))
        if kind == "decode":  # and as its layers run in a step (prefill layers cost the same either way)
            cases.append(Case(("layer_pass", k), calls.layer_pass_call(q, c)))
        cases.append(Case(("stateless", k), calls.stateless_call(sum(q))))
        cases.append(Case(("attention", k), calls.attention_call(q, c)))
    for n in sorted({int(x) for x in rng.integers(1, min(max_tokens, pool) + 1, 6)}):
        cases.append(Case(("embed", n), calls.embed_call(n)))
    for r in sorted({int(x) for x in rng.integers(1, max_batch + 1, 6)}):
        cases.append(Case(("head", r), calls.head_call(r)))
    for k, s in enumerate(snaps):
        cases.append(Case(("iteration", k), PlanReplay(runner, s, gen)))
    small = small_decode_snapshots(runner, num_small_decode, seed=seed + 3, max_batch=min(32, max_batch),
                                   max_context=min(512, cfg.max_position))
    for k, s in enumerate(small):
        cases.append(Case(("small_decode", k), PlanReplay(runner, s, gen)))
    return EvalSet(cases, batches, snaps, small, runner.num_layers)


def _eval_report(obj, es: EvalSet, lm: LatencyModel, tol: float, method: str, bench: Bench) -> dict:
    res: dict[str, list] = {k: [] for k in CASE_KINDS}
    for cs in es.cases:
        kind, k = cs.key
        if kind in LAYER_KINDS:
            bkind, q, c = es.batches[k]
            rec = {"kind": bkind, "batch": len(q), "tokens": sum(q), "sum_context": sum(c), "max_context": max(c),
                   "query_lens": list(q), "context_lens": list(c), "num_layers": es.num_layers}
        elif kind == "embed":
            rec = {"tokens": k}
        elif kind == "head":
            rec = {"rows": k}
        else:
            s = (es.snaps if kind == "iteration" else es.small)[k]
            rec = {"policy": s.policy, "step": s.index, "kind": plan_kind(s.plan, s.plan.num_layers),
                   "num_works": len(s.plan.works), "tokens": sum(w.num_tokens for w in s.plan.works),
                   "layer_calls": len(s.plan.layer_steps()), "num_layers": s.plan.num_layers,
                   "works": [[w.token_start, w.num_tokens, w.layer_start, w.layer_end, int(w.sample)]
                             for w in s.plan.works]}
        rec.update(actual_s=cs.estimate(), best_s=cs.best(), spread=cs.spread(), repeats=cs.repeats,
                   times=[float(t) for t in cs.times], clean_times=[float(t) for t in cs.clean],
                   clean_repeats=len(cs.clean), disturbed_repeats=len(cs.disturbed),
                   disturbed_only=not cs.times, settled=cs.settled(tol))
        res[kind].append(rec)
    all_cases = [r for v in res.values() for r in v]
    report = {
        "setup": profile_metadata(obj),
        "measurement": {
            "method": method,
            "repeats": sum(r["repeats"] for r in all_cases),
            "clean_fraction": round(sum(r["clean_repeats"] for r in all_cases)
                                    / max(1, sum(r["repeats"] for r in all_cases)), 3),
            "disturbed_fraction": round(sum(r["disturbed_repeats"] for r in all_cases)
                                        / max(1, sum(r["repeats"] for r in all_cases)), 3),
            "disturbed_cases": sum(r["disturbed_only"] for r in all_cases),
            "reference_checks": len(bench.checks),
            "reference_tol": bench.ref_tol,
            "max_reference_drift": round(bench.reference_drift(), 3),
            "settled_fraction": round(sum(r["settled"] for r in all_cases) / max(1, len(all_cases)), 3),
            "out_of_time": bench.out_of_time,
            "rounds": bench.rounds,
            "timing_seconds": round(bench.seconds, 1),
            "estimate_over_best": float(np.mean([r["actual_s"] / r["best_s"] for r in all_cases])),
            "two_fastest_spread": float(np.mean([r["spread"] for r in all_cases])),
        },
        "cases": res,
    }
    return score(report, lm)


_METHOD = ("per case: shuffled rounds (min {lo}, max {hi}) after a warm-up, every case once per round, "
           "more rounds for unsettled cases while time is left, at least {k} repeats per case whatever the time; "
           "time = median of the undisturbed repeats (of the clean ones when at least 3 ran clean); "
           "settled when the two fastest agree within {tol:.0f}% and one was clean (no task waiting for a CPU, /proc/pressure/cpu); "
           "repeats next to a re-timing of the reference calls (decode layer step at batch 8, 256-token prefill "
           "layer step) more than 5% over its best are disturbed and re-measured")


def evaluate(obj, lm: LatencyModel, *, policies: Sequence[str] = ("vllm", "sarathi", "laser"),
             num_layer_steps: int = 45, plans_per_policy: int = 10, progress: bool | None = None, seed: int = 1,
             budget_s: float = 100.0, rounds: tuple[int, int] = (3, 6), tol: float = 0.03,
             max_tokens: int = 2048, max_batch: int = 64, num_requests: int = 24, warmup_s: float = 1.0,
             num_small_decode: int = 12, min_repeats: int = 5) -> dict:
    """Accuracy of ``lm`` on held-out measurements of ``obj`` (an idle Engine or ModelRunner).

    * per module: stateless, attention, embedding and LM head on random held-out sizes;
    * per layer step: whole ``forward_layer`` calls on random batches vs ``predict_layer``; the
      decode batches also as every layer of the model in a pass (as they run in a step: one call
      chains them all), against ``num_layers`` x ``predict_layer``;
    * per iteration: plans of every policy's scheduler (planned with ``lm``) on synthetic
      request streams, ``ModelRunner.execute(plan)`` end to end vs ``predict_iteration(plan)``;
    * per small-batch decode iteration, reported apart: ``num_small_decode`` random decode
      iterations of 1..32 requests at contexts 16..512 (:func:`.snapshots.small_decode_snapshots`).

    Ground truth is measured like the profile (:class:`Bench`: interleaved rounds, the median
    of the undisturbed repeats, at least ``min_repeats`` of them per case whatever ``budget_s``:
    one call jitters by ~10 % on a VM, see ``Bench``'s ``min_repeats``). Returns a JSON-friendly
    dict (see ``format_report``).
    See :func:`profile_and_evaluate` for measuring the profile and the test set together.
    """
    runner = runner_of(obj)
    calls = ExecutorCalls(runner, seed + 100)
    with torch.inference_mode():
        es = _eval_set(runner, calls, lm, policies=policies, num_layer_steps=num_layer_steps,
                       plans_per_policy=plans_per_policy, seed=seed, max_tokens=max_tokens, max_batch=max_batch,
                       num_requests=num_requests, num_small_decode=num_small_decode)
        bench = Bench(rounds[0], max(rounds[1], min_repeats), tol, budget_s=budget_s, seed=seed,
                      min_repeats=min_repeats)
        run_bench(es.cases, bench, calls, warmup_s, "evaluating", progress)
    runner.bm.check_integrity(expect_empty=True)
    method = _METHOD.format(lo=rounds[0], hi=bench.max_rounds, tol=100 * tol, k=bench.min_repeats)
    rep = _eval_report(obj, es, lm, tol, method, bench)
    rep["measurement"]["interleaved_with_profile"] = False
    return rep


def profile_and_evaluate(obj, *, grid: ProfileGrid | None = None, policies: Sequence[str] = ("vllm", "sarathi", "laser"),
                         num_layer_steps: int = 45, plans_per_policy: int = 10, progress: bool | None = None,
                         seed: int = 0, budget_s: float = 140.0, max_tokens: int = 2048, max_batch: int = 64,
                         num_requests: int = 24, planning_lm: LatencyModel | None = None,
                         threads: int | None = None, num_small_decode: int = 12,
                         repeatability: bool = False, min_repeats: int = 5) -> tuple[FittedLatencyModel, dict]:
    """Profile and measure a held-out test set *in the same interleaved rounds*, then fit on
    the profile samples and score the test set (see :func:`evaluate`).

    Interleaving puts training and test measurements under the same machine conditions
    (other tenants, clock speed, allocator state drift over minutes on a shared host), so
    the report measures the latency model, not the drift. The schedulers plan the test
    iterations with ``planning_lm`` (default: a quick one-round profile on a small grid).
    ``repeatability``: every held-out case is timed a second time, as its own case in the same
    rounds, and ``report["repeatability"]`` says how well the two timings agree
    (:func:`repeatability_report`): the ceiling these timings put on any model's accuracy.
    ``min_repeats``: timings every profile sample and held-out case gets whatever ``budget_s``
    (their median is the measured time; ``Bench``'s ``min_repeats``): 5, where an engine's own
    profile at start takes 2 (``grid.min_repeats``), since a held-out figure is only as
    good as the single times it is scored against.
    """
    runner = runner_of(obj)
    grid = grid or default_grid(runner)
    t0 = time.perf_counter()
    if planning_lm is None:
        pre = ProfileGrid.tiny(rounds=(1, 1))
        pre.warmup_s = 0.3
        planning_lm = fit(collect_samples(runner, pre, progress=False, seed=seed + 7), num_layers=runner.num_layers)
    calls = ExecutorCalls(runner, seed)
    with torch.inference_mode():
        pcases = profile_cases(calls, grid)
        es = _eval_set(runner, calls, planning_lm, policies=policies, num_layer_steps=num_layer_steps,
                       plans_per_policy=plans_per_policy, seed=seed + 1, max_tokens=max_tokens, max_batch=max_batch,
                       num_requests=num_requests, num_small_decode=num_small_decode)
        bench = Bench(grid.min_rounds, max(grid.max_rounds, min_repeats), grid.tol, budget_s=budget_s, seed=seed,
                      min_repeats=min_repeats)
        setup_s = time.perf_counter() - t0
        twins = [Case(("twin", *c.key), c.run) for c in es.cases] if repeatability else []
        run_bench(pcases + es.cases + twins, bench, calls, grid.warmup_s, "profiling + evaluating", progress)
    runner.bm.check_integrity(expect_empty=True)
    stats: dict = {}
    model = fit_profile(obj, samples_from_cases(pcases, grid.tol, bench, stats), stats, time.perf_counter() - t0, threads)
    model.metadata["measurement"]["interleaved_with_evaluation"] = True
    rep = _eval_report(obj, es, model, grid.tol,
                       _METHOD.format(lo=grid.min_rounds, hi=bench.max_rounds, tol=100 * grid.tol,
                                                 k=bench.min_repeats), bench)
    rep["measurement"]["interleaved_with_profile"] = True
    rep["measurement"]["setup_seconds"] = round(setup_s, 1)
    if twins:
        rep["repeatability"] = repeatability_report(es, twins)
        recs = {kind: iter(v) for kind, v in rep["cases"].items()}
        for cs, tw in zip(es.cases, twins):  # the second timing's repeats, next to the first's
            rec = next(recs[cs.key[0]])
            rec["twin_times"], rec["twin_clean_times"] = [float(t) for t in tw.times], [float(t) for t in tw.clean]
            rec["twin_repeats"] = tw.repeats  # a disturbed repeat is counted here, not kept in twin_times
    return model, rep


def repeatability_report(es: EvalSet, twins: Sequence[Case]) -> dict:
    """How well two timings of the same held-out cases agree: ``twins[k]`` re-times
    ``es.cases[k]`` in the same rounds. Per group of :func:`score` (modules; layer steps and
    iterations, all and by kind; small decode iterations), the mean of ``accuracy(a, b)`` and
    ``accuracy(b, a)`` over the pairs of estimates. A model predicting each case's typical time
    exactly scores about ``1 - (1 - agreement) / sqrt(2)`` against one timing (independent
    noise on each), so an agreement of 0.90 caps the expected accuracy near 0.93."""
    groups: dict[str, list[float]] = {}
    names = {"layer": "layer step", "layer_pass": "layer step in a pass", "iteration": "iteration",
             "small_decode": "small decode it."}
    for cs, tw in zip(es.cases, twins):
        kind, k = cs.key
        a, b = cs.estimate(), tw.estimate()
        agree = 0.5 * (accuracy(a, b) + accuracy(b, a))
        if kind in LAYER_KINDS:
            sub = es.batches[k][0]
        elif kind in ("iteration", "small_decode"):
            s = (es.snaps if kind == "iteration" else es.small)[k]
            sub = plan_kind(s.plan, s.plan.num_layers)
        else:
            sub = None
        name = names.get(kind, f"module {kind}")
        groups.setdefault(name, []).append(agree)
        if sub and kind in ("layer", "iteration"):
            groups.setdefault(f"{name}: {sub}", []).append(agree)
    return {g: {"n": len(v), "agreement": float(np.mean(v))} for g, v in sorted(groups.items())}


CASE_KINDS = ("layer", "layer_pass", "stateless", "attention", "embed", "head", "iteration", "small_decode")
# Cases of a held-out layer batch: a layer call alone, the call's layers in a pass (decode batches: every
# layer in order, as in a step; its time is the pass's), its stateless part, its attention.
LAYER_KINDS = ("layer", "layer_pass", "stateless", "attention")


def _case_prediction(lm: LatencyModel, kind: str, rec: dict) -> float:
    if kind in LAYER_KINDS:
        q, c = tuple(rec["query_lens"]), tuple(rec["context_lens"])
        if kind == "layer":
            return lm.layer_time(q, c)
        if kind == "layer_pass":
            return rec["num_layers"] * lm.layer_time(q, c)
        return lm.stateless_time(sum(q)) if kind == "stateless" else lm.attention_time(q, c)
    if kind == "embed":
        return lm.embed_time(rec["tokens"])
    if kind == "head":
        return lm.head_time(rec["rows"])
    works = [Work(f"w{k}", ts, n, a, b, bool(smp)) for k, (ts, n, a, b, smp) in enumerate(rec["works"])]
    return lm.predict_iteration(StepPlan(rec["num_layers"], works))


def score(report: dict, lm: LatencyModel) -> dict:
    """(Re)compute predictions and accuracy summaries of an accuracy report for ``lm``.

    The measured ground truth in ``report["cases"]`` does not depend on the model, so a
    report can be re-scored for another (e.g. refitted) model without measuring again.
    """
    res = report["cases"]
    for kind in CASE_KINDS:
        for rec in res.get(kind, ()):
            rec["pred_s"] = _case_prediction(lm, kind, rec)

    def summ(recs):
        # cases whose every timing was disturbed (no time left to re-measure) are left out,
        # unless no other case is left
        recs = [r for r in recs if not r.get("disturbed_only")] or recs
        return summarize([r["pred_s"] for r in recs], [r["actual_s"] for r in recs])

    def by(recs, key):
        groups: dict[str, list] = {}
        for r in recs:
            groups.setdefault(r[key], []).append(r)
        return {g: summ(v) for g, v in sorted(groups.items())}

    meta = getattr(lm, "metadata", {}) or {}
    rep = getattr(lm, "report", {}) or {}
    report["model"] = {"profile_created": meta.get("created"),
                       "stateless_width": rep.get("stateless", {}).get("width"),
                       "head_width": rep.get("head", {}).get("width"),
                       "attention_features": rep.get("attention", {}).get("feature_set"),
                       "layer_overhead_s": getattr(lm, "layer_overhead_s", 0.0)}
    report["per_module"] = {m: summ(res.get(m, [])) for m in ("stateless", "attention", "embed", "head")}
    report["per_layer_step"] = {**summ(res.get("layer", [])), "by_kind": by(res.get("layer", []), "kind")}
    if res.get("layer_pass"):  # (reports before issue 26 item 3's in-step pricing have none)
        report["per_layer_step_in_pass"] = summ(res["layer_pass"])
    its = res.get("iteration", [])
    report["per_iteration"] = {**summ(its), "by_policy": by(its, "policy"), "by_kind": by(its, "kind")}
    small = res.get("small_decode", [])
    report["per_small_decode_iteration"] = {**summ(small), "by_batch": {
        f"{lo}-{hi}": summ([r for r in small if lo <= r["num_works"] <= hi]) for lo, hi in ((1, 4), (5, 12), (13, 32))}}
    return report


def format_report(rep: dict, warn_busy: bool = True) -> str:
    """Human-readable accuracy table; with ``warn_busy``, a warning line when over 10% of the
    timed calls were disturbed (False: the caller has warned about the same measurement)."""
    def pct(x):
        return "   n/a" if x is None else f"{100 * x:5.1f}%"

    def row(name, s):
        return f"  {name:<22} {pct(s['mean_accuracy'])}  {pct(s['p10_accuracy'])}  {s['n']:4d}"

    su = rep["setup"]
    lines = [f"Latency model accuracy: {su.get('model_name') or su['model_id']} {su['dtype']}, {su['threads']} threads, "
             f"{su.get('executor', 'eager')} executor, {su['hardware']}"
             + (" (test set measured interleaved with the profile)"
                if rep.get("measurement", {}).get("interleaved_with_profile") else ""),
             "  accuracy = 1 - |pred - actual| / actual",
             f"  {'':<22} {'mean':>6}  {'P10':>6}  {'n':>4}"]
    lines.append(" per module")
    for m, s in rep["per_module"].items():
        lines.append(row(m, s))
    lines.append(" per layer step")
    lines.append(row("all", rep["per_layer_step"]))
    for k, s in rep["per_layer_step"]["by_kind"].items():
        lines.append(row("  " + k, s))
    if rep.get("per_layer_step_in_pass"):
        lines.append(row("  decode, in a pass", rep["per_layer_step_in_pass"]))
    lines.append(" per iteration")
    lines.append(row("all", rep["per_iteration"]))
    for k, s in rep["per_iteration"]["by_policy"].items():
        lines.append(row("  policy " + k, s))
    for k, s in rep["per_iteration"]["by_kind"].items():
        lines.append(row("  " + k, s))
    sd = rep.get("per_small_decode_iteration")
    if sd:
        lines.append(" small-batch decode iterations (random, batch 1-32, context 16-512)")
        lines.append(row("all", sd))
        for k, s in sd["by_batch"].items():
            if s["n"]:
                lines.append(row("  batch " + k, s))
    ms = rep["measurement"]
    lines.append(f" measurement: {ms['repeats']} timed calls in {ms.get('rounds', '?')} rounds, "
                 f"{100 * ms['clean_fraction']:.0f}% clean, {100 * ms.get('disturbed_fraction', 0):.0f}% disturbed "
                 f"(reference calls up to {100 * ms.get('max_reference_drift', 0):.0f}% over their best), "
                 f"{100 * ms['settled_fraction']:.0f}% of cases settled; "
                 f"two fastest repeats {100 * ms.get('two_fastest_spread', 0):.1f}% apart, the median (the "
                 f"time used) {100 * (ms.get('estimate_over_best', 1.0) - 1):.0f}% above them"
                 + (" (ran out of time)" if ms["out_of_time"] else ""))
    rp = rep.get("repeatability")
    if rp:
        lines.append(" repeatability: each held-out case timed twice in the same rounds; mean agreement of the two "
                     "(a model scores about 1 - (1 - agreement) / 1.41 at best)")
        lines += [f"  {g:<22} {pct(v['agreement'])}          {v['n']:4d}" for g, v in rp.items()]
    if warn_busy and ms.get("disturbed_fraction", 0) > 0.1:
        lines.append(f" warning: {100 * ms['disturbed_fraction']:.0f}% of timed calls ran while the machine was slower "
                     "(another process competing for memory bandwidth or cores); figures may be off -- re-run on a "
                     "quiet machine")
    return "\n".join(lines)
