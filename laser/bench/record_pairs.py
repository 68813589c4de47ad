"""Per-request comparison of two runs of the same arrivals (e.g. the simulator and the real engine).

``benchmarks/sim_vs_real.py`` runs both targets on one arrival list (common random numbers), so
record ``i`` of either run is workload request ``i``. :func:`paired_rows` lines the two up, one row
per request (times relative to each run's own arrival, so the two clocks need not agree), and
:func:`pair_summary` condenses them per class into where the time differs: TTFT, mean and P99 TBT,
and the requests whose SLO verdict flipped. Times in seconds; torch-free.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from laser.core.metrics import RequestRecord


def _req_row(r: RequestRecord, t0: float) -> dict:
    """One run's view of a request: arrival offset from ``t0``, prompt tokens, TTFT, mean / P99 TBT
    (s; None when absent), tokens produced, SLO met."""
    return {"arrival": r.arrival_time - t0, "prompt_len": r.prompt_len, "ttft": r.ttft, "tpot": r.tpot, "p99_tbt": r.p99_tbt,
            "tokens": r.num_output_tokens, "met": r.slo_met}


def paired_rows(a: Sequence[RequestRecord], b: Sequence[RequestRecord]) -> list[dict]:
    """One dict per request: ``i``, ``class``, ``output_len`` and ``a`` / ``b`` (each :func:`_req_row`,
    arrivals relative to that run's first arrival). Raises ValueError when the two runs are not of
    the same requests (count or class differ at some index)."""
    if len(a) != len(b):
        raise ValueError(f"runs of {len(a)} and {len(b)} requests are not the same arrivals")
    ta = min((r.arrival_time for r in a), default=0.0)
    tb = min((r.arrival_time for r in b), default=0.0)
    rows = []
    for i, (ra, rb) in enumerate(zip(a, b)):
        if ra.slo_class != rb.slo_class:
            raise ValueError(f"request {i}: class {ra.slo_class} vs {rb.slo_class}")
        rows.append({"i": i, "class": ra.slo_class, "output_len": ra.output_len,
                     "a": _req_row(ra, ta), "b": _req_row(rb, tb)})
    return rows


def _diffs(rows: list[dict], key: str) -> list[float]:
    return [r["b"][key] - r["a"][key] for r in rows if r["a"][key] is not None and r["b"][key] is not None]


def _med(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def pair_summary(rows: list[dict]) -> dict[str, dict]:
    """Per class (and ``all``): ``n``; the median of b - a in TTFT, TPOT and P99 TBT (s); the
    median b / a TTFT ratio; ``b_only`` / ``a_only``: requests only b / only a met the SLO."""
    out = {}
    for c in sorted({r["class"] for r in rows}) + ["all"]:
        rs = [r for r in rows if c == "all" or r["class"] == c]
        ratios = [r["b"]["ttft"] / r["a"]["ttft"] for r in rs if r["a"]["ttft"] and r["b"]["ttft"] is not None]
        out[c] = {"n": len(rs), "ttft_diff": _med(_diffs(rs, "ttft")), "ttft_ratio": _med(ratios),
                  "tpot_diff": _med(_diffs(rs, "tpot")), "p99_tbt_diff": _med(_diffs(rs, "p99_tbt")),
                  "b_only": sum(r["b"]["met"] and not r["a"]["met"] for r in rs),
                  "a_only": sum(r["a"]["met"] and not r["b"]["met"] for r in rs)}
    return out


def format_pair_summary(summary: dict[str, dict], a: str = "sim", b: str = "real") -> list[str]:
    """Table lines of :func:`pair_summary` (ms; ``b - a`` medians)."""
    def ms(x):
        return "" if x is None else f"{1e3 * x:+.1f}"

    lines = [f"  per request, {b} - {a} (median): {'class':<14} {'n':>4} {'TTFT ms':>9} {'TTFT x':>7} "
             f"{'TPOT ms':>8} {'P99 TBT ms':>10}  met only by {b} / {a}"]
    for c, s in summary.items():
        ratio = "" if s["ttft_ratio"] is None else f"{s['ttft_ratio']:.2f}"
        lines.append(f"  {'':<34}{c:<14} {s['n']:>4} {ms(s['ttft_diff']):>9} {ratio:>7} {ms(s['tpot_diff']):>8} "
                     f"{ms(s['p99_tbt_diff']):>10}  {s['b_only']} / {s['a_only']}")
    return lines
