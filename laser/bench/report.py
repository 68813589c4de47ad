"""Benchmark output: a ``vllm bench serve``-style summary block, the comparison table, JSON.

Labels follow ``vllm bench serve`` where the metrics overlap ("Successful requests",
"Benchmark duration (s)", "Mean TTFT (ms)", "P99 ITL (ms)", ...), so numbers can be read
side by side; inter-token latency (ITL) is our TBT. An SLO-attainment section follows.
Simulated results carry ``[SIMULATED]`` in every header and ``"simulated": true`` in JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from laser.bench.goodput import NO_GOODPUT_JSON, GoodputResult, display_goodput_json
from laser.bench.workloads import WORKLOADS
from laser.core.metrics import PERCENTILE_METHOD, RequestRecord, RunSummary

WIDTH = 50
SIM_TAG = "[SIMULATED]"


def _pct(values: Sequence[float], q: float) -> float | None:
    if not len(values):
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method=PERCENTILE_METHOD))


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _ms(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v * 1e3:.{nd}f}"


def _num(v: float | None, nd: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def class_order(c: str):
    return (WORKLOADS.index(c) if c in WORKLOADS else len(WORKLOADS), c)


def _line(label: str, value) -> str:
    return "{:<40} {:<10}".format(label, value)


def format_summary(records: Sequence[RequestRecord], summary: RunSummary, title: str = "Serving Benchmark Result",
                   rate: float | None = None, simulated: bool = False, goodput: GoodputResult | None = None,
                   extra: dict | None = None) -> str:
    """The summary block of one run (one target at one rate); ``goodput``: the target's goodput
    search result, shown as :meth:`GoodputResult.display` (no line without one)."""
    t = f" {title}{' ' + SIM_TAG if simulated else ''} "
    o = summary.overall
    started = [r for r in records if r.token_times]
    tpots = [r.tpot for r in started if r.tpot is not None]
    itls = [g for r in started for g in r.tbts]
    dur = summary.duration
    lines = [f"{t:=^{WIDTH}}"]
    for k, v in (extra or {}).items():
        lines.append(_line(f"{k}:", v))
    lines.append(_line("Request rate (req/s):", "trace" if rate is None else ("inf" if math.isinf(rate) else f"{rate:.3f}")))
    lines.append(_line("Successful requests:", o.finished))
    lines.append(_line("Failed/unfinished requests:", o.count - o.finished))
    lines.append(_line("Benchmark duration (s):", _num(dur)))
    lines.append(_line("Total input tokens:", o.prompt_tokens))
    lines.append(_line("Total generated tokens:", o.output_tokens))
    lines.append(_line("Request throughput (req/s):", _num(o.request_throughput)))
    lines.append(_line("Output token throughput (tok/s):", _num(o.output_throughput)))
    total_tp = (o.prompt_tokens + o.output_tokens) / dur if dur else None
    lines.append(_line("Total Token throughput (tok/s):", _num(total_tp)))
    lines.append(f"{'Time to First Token':-^{WIDTH}}")
    lines.append(_line("Mean TTFT (ms):", _ms(o.ttft_mean)))
    lines.append(_line("Median TTFT (ms):", _ms(o.ttft_median)))
    lines.append(_line("P99 TTFT (ms):", _ms(o.ttft_p99)))
    lines.append(f"{'Time per Output Token (excl. 1st token)':-^{WIDTH}}")
    lines.append(_line("Mean TPOT (ms):", _ms(o.tpot_mean)))
    lines.append(_line("Median TPOT (ms):", _ms(_pct(tpots, 50))))
    lines.append(_line("P99 TPOT (ms):", _ms(_pct(tpots, 99))))
    lines.append(f"{'Inter-token Latency (TBT)':-^{WIDTH}}")
    lines.append(_line("Mean ITL (ms):", _ms(o.tbt_mean)))
    lines.append(_line("Median ITL (ms):", _ms(_pct(itls, 50))))
    lines.append(_line("P99 ITL (ms):", _ms(o.tbt_p99)))
    lines.append(f"{'SLO attainment (TTFT and P99 TBT)':-^{WIDTH}}")
    lines.append(_line("SLO attainment (%):", _num(None if o.attainment is None else 100 * o.attainment, 1)))
    for c in sorted(summary.per_class, key=class_order):
        cs = summary.per_class[c]
        rec = next((r for r in records if r.slo_class == c), None)
        tgt = ""
        if rec is not None:
            tgt = f" [TTFT {_ms(rec.ttft_slo, 0)} / TBT {_ms(rec.tbt_slo, 0)} ms]"
        att = _num(None if cs.attainment is None else 100 * cs.attainment, 1)
        lines.append(_line(f"  {c} (%):", f"{att}{tgt}"))
        lines.append(_line(f"  {c} mean TTFT / P99 ITL (ms):", f"{_ms(cs.ttft_mean)} / {_ms(cs.tbt_p99)}"))
    if goodput is not None:
        lines.append(_line("Goodput (req/s):", goodput.display()))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_probe_line(p, target: float) -> str:
    """One line per probe (progress log)."""
    cls = " ".join(f"{c}={a:.2f}" for c, a in sorted(p.class_attainment().items(), key=lambda x: class_order(x[0])))
    o = p.summary.overall
    rate = "trace" if p.rate is None else f"{p.rate:.3g} req/s"
    mark = "pass" if p.attainment + 1e-12 >= target else "FAIL"
    unfinished = f", {p.unfinished} unfinished" if p.unfinished else ""
    if p.early_stopped:
        unfinished += " (stopped early: certain to fail; attainment is a lower bound)"
    hits = getattr(p, "prefix_hit_rate", None)
    hits = "" if hits is None else f", prefix-cache hit rate {100 * hits:.1f} %"
    return (f"[{p.label}] {rate}: attainment {p.attainment:.3f} {mark} ({cls}), mean TTFT {_ms(o.ttft_mean, 0)} ms, "
            f"P99 ITL {_ms(o.tbt_p99, 0)} ms{hits}{unfinished}, wall {p.wall_s:.1f} s")


# ------------------------------------------------------------------------------ comparison


def baselines_of(labels: Sequence[str], ours: str = "laser") -> list[str]:
    return [lb for lb in labels if lb != ours] if ours in labels else []


def comparison_rows(policies: dict[str, dict], ours: str = "laser") -> list[dict]:
    """Rows of the table policy / goodput / ratio to the best baseline / mean TTFT (from the JSON)."""
    labels = list(policies)
    base = baselines_of(labels, ours)
    # a baseline without a knee (it passed the whole workload as one burst) beats any finite goodput
    best = max(base, key=lambda lb: (bool(policies[lb].get("goodput_unbounded")),
                                     policies[lb].get("goodput_rps") or 0.0)) if base else None
    best_g = policies[best].get("goodput_rps") if best else None
    rows = []
    for lb in labels:
        d = policies[lb]
        g = d.get("goodput_rps")
        # no ratio against or of a goodput without a knee (the workload passed as one burst), nor of
        # one below the probed range (its 0.0 only says "below the lowest rate probed")
        no_knee = d.get("goodput_unbounded", False) or bool(best and policies[best].get("goodput_unbounded"))
        below = bool(d.get("goodput_below_range"))
        ratio = (g / best_g) if (g is not None and best_g and not below and not (no_knee and lb != best)) else None
        rows.append({"policy": lb, "goodput_rps": g, "goodput": display_goodput_json(d, notes=False), "ratio": ratio,
                     "mean_ttft_s": d.get("mean_ttft_s"), "attainment": d.get("attainment"),
                     "p99_tbt_s": d.get("p99_tbt_s"), "lower_bound": d.get("goodput_lower_bound", False),
                     "best_baseline": lb == best, "capped": d.get("goodput_capped"),
                     "unbounded": d.get("goodput_unbounded", False),
                     "below_range": d.get("goodput_below_range", False),
                     "best_budget": (d.get("budget_sweep") or {}).get("best_budget"),
                     "partial": d.get("reference_probe_early_stopped", False)})
    return rows


def format_comparison(results: dict, ours: str = "laser") -> str:
    """The table: policy | goodput | x best baseline | mean TTFT | attainment | P99 ITL (at the reference rate).

    A goodput shows as ">=x" only when the search's cap stopped it before that policy
    failed a probe (the cap is listed under the table); a ``:best`` policy shows its budget.
    """
    pol = results["policies"]
    sim = results.get("simulated", False)
    ref = results.get("reference_rate_rps")
    head = f"Comparison{' ' + SIM_TAG if sim else ''}"
    if ref is not None:
        head += f" - TTFT/attainment/ITL at {ref:.3g} req/s, same arrivals for every policy"
    lines = [head]
    rows = comparison_rows(pol, ours)
    best = next((r for r in rows if r["best_baseline"]), None)
    if best is not None:
        lines.append(f"best baseline: {_policy_name(best)} - the ratio column is against it")
    w = max([12] + [len(_policy_name(r)) for r in rows])
    lines.append(f"{'policy':<{w}} {'goodput (req/s)':>16} {'vs best baseline':>17} {'mean TTFT (ms)':>15} "
                 f"{'attainment':>11} {'P99 ITL (ms)':>13}")
    capped = [f"{r['policy']}: {r['capped']}" for r in rows if r["lower_bound"]]
    for row in rows:
        gs = row["goodput"]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        if row["best_baseline"]:
            ratio += " (best)"
        att = "-" if row["attainment"] is None else f"{row['attainment']:.3f}"
        if row["partial"]:
            att += "*"
        lines.append(f"{_policy_name(row):<{w}} {gs:>16} {ratio:>17} {_ms(row['mean_ttft_s'], 1):>15} {att:>11} "
                     f"{_ms(row['p99_tbt_s'], 1):>13}")
    if any(r["unbounded"] for r in rows):
        lines.append("unbounded: the whole workload arriving at once still met the attainment target (no knee)")
    if capped:
        lines.append(">= : the search cap was hit before the policy failed a probe (" + "; ".join(capped) + ")")
    if any(r["below_range"] for r in rows):
        lines.append("< : every probe failed, down to the lowest rate probed")
    if any(r["partial"] for r in rows):
        lines.append("* stopped early at the reference rate (certain to fail): its columns cover the part that ran")
    comp = results.get("comparison") or {}
    for other, r in (comp.get("mean_ttft_ratio") or {}).items():
        if r is not None:
            lines.append(f"mean TTFT {ours} / {other}: {r:.2f}x")
    return "\n".join(lines)


def _policy_name(row: dict) -> str:
    b = row.get("best_budget")
    return row["policy"] if b is None else f"{row['policy']} (budget {b})"


# ------------------------------------------------------------------------------------ JSON


def _class_block(summary: RunSummary | None, targets: dict) -> dict:
    out = {}
    classes = set(targets) | set(summary.per_class if summary else ())
    for c in sorted(classes, key=class_order):
        cs = summary.per_class.get(c) if summary else None
        t = targets.get(c, {})
        out[c] = {
            "attainment": cs.attainment if cs else None,
            "mean_ttft_s": cs.ttft_mean if cs else None,
            "p99_ttft_s": cs.ttft_p99 if cs else None,
            "p99_tbt_s": cs.tbt_p99 if cs else None,
            "mean_tpot_s": cs.tpot_mean if cs else None,
            "count": cs.count if cs else 0,
            "ttft_slo_s": t.get("ttft"),
            "tbt_slo_s": t.get("tbt"),
        }
    return out


def probe_json(p) -> dict:
    o = p.summary.overall
    return {
        "rate_rps": p.rate,
        "attainment": p.attainment,
        "per_class_attainment": p.class_attainment(),
        "mean_ttft_s": o.ttft_mean,
        "p99_ttft_s": o.ttft_p99,
        "p99_tbt_s": o.tbt_p99,
        "mean_tbt_s": o.tbt_mean,
        "mean_tpot_s": o.tpot_mean,
        "request_throughput": o.request_throughput,
        "duration_s": p.summary.duration,
        "unfinished": p.unfinished,
        "early_stopped": p.early_stopped,
        "wall_s": p.wall_s,
    }


def policy_json(label: str, targets: dict, ref_probe=None, goodput=None, attainment_target: float = 0.9,
                describe: dict | None = None, probes=None) -> dict:
    """Per-policy block. Latencies/attainment are at the reference probe; goodput from the search."""
    s = ref_probe.summary if ref_probe is not None else None
    o = s.overall if s is not None else None
    d = {
        **(goodput.to_json() if goodput is not None else NO_GOODPUT_JSON),
        "reference_rate_rps": ref_probe.rate if ref_probe is not None else None,
        # the reference probe stopped once it certainly failed: its latencies cover only what ran
        "reference_probe_early_stopped": bool(ref_probe is not None and ref_probe.early_stopped),
        "attainment": o.attainment if o else None,
        "mean_ttft_s": o.ttft_mean if o else None,
        "p99_ttft_s": o.ttft_p99 if o else None,
        "p99_tbt_s": o.tbt_p99 if o else None,
        "mean_tbt_s": o.tbt_mean if o else None,
        "mean_tpot_s": o.tpot_mean if o else None,
        "mean_e2e_s": o.e2e_mean if o else None,
        "request_throughput": o.request_throughput if o else None,
        "per_class": _class_block(s, targets),
        "probes": [probe_json(p) for p in (probes if probes is not None else (goodput.probes if goodput else []))],
        "summary_at_reference": s.to_dict() if s is not None else None,
        "target": describe or {},
    }
    if goodput is not None:
        for c, g in goodput.class_goodput(attainment_target).items():
            d["per_class"].setdefault(c, {})["goodput_rps"] = g
    return d


def comparison_json(policies: dict[str, dict], ours: str = "laser") -> dict:
    labels = list(policies)
    base = baselines_of(labels, ours)
    if not base:
        return {}
    best = max(base, key=lambda lb: policies[lb].get("goodput_rps") or 0.0)
    g_best = policies[best].get("goodput_rps")
    g_ours = policies[ours].get("goodput_rps")
    ttft = policies[ours].get("mean_ttft_s")

    def ratio(a, b):
        return a / b if (a is not None and b) else None

    return {
        "ours": ours,
        "best_baseline": best,
        "goodput_ratio": (None if policies[ours].get("goodput_unbounded") or policies[best].get("goodput_unbounded")
                          else ratio(g_ours, g_best)),
        "mean_ttft_ratio": {lb: ratio(ttft, policies[lb].get("mean_ttft_s")) for lb in base},
    }


def write_json(results: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=_json_default, allow_nan=False))


def _json_default(o):
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def sanitize(o):
    """Replace inf/nan by None (strict JSON)."""
    if isinstance(o, dict):
        return {(str(k) if not isinstance(k, str) else k): sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [sanitize(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o
