"""Benchmark plots (matplotlib, Agg canvas, PNG). Simulated results say so in every title.

* ``attainment_vs_rate.png``  — SLO attainment of every probe per policy, the target line,
  each policy's goodput marked;
* ``goodput_vs_slo_scale.png`` — goodput per policy as every SLO target is scaled (paper: 0.8–1.3);
* ``goodput_vs_mix.png``       — goodput per policy for each class mix;
* ``ttft_cdf.png`` / ``tbt_cdf.png`` — per class, CDF of TTFT and of each request's P99 TBT
  (the metric the SLO judges) per policy at the reference rate, with the class target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from laser.bench.report import SIM_TAG, class_order


def _figure(w: float = 6.4, h: float = 4.2, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w * ncols if ncols > 1 else w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(s: str, simulated: bool) -> str:
    return f"{s} {SIM_TAG}" if simulated else s


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_attainment_vs_rate(probes_by_label: Mapping[str, Sequence], goodputs: Mapping[str, float | None],
                            target: float, path: Path, simulated: bool = False, subtitle: str = "") -> Path:
    """``probes_by_label``: label -> probes (with ``rate`` and ``attainment``)."""
    fig = _figure()
    ax = fig.add_subplot()
    any_partial = False
    for i, (lb, probes) in enumerate(probes_by_label.items()):
        pts = {}
        for p in probes:  # the last probe of a rate wins (a full re-run replaces a stopped one)
            if p.rate is not None and np.isfinite(p.rate):
                pts[p.rate] = (p.attainment, getattr(p, "early_stopped", False))
        if not pts:
            continue
        x = sorted(pts)
        y = [pts[r][0] for r in x]
        line, = ax.plot(x, y, marker="o", label=lb)
        stopped = [r for r in x if pts[r][1]]
        if stopped:
            any_partial = True
            ax.plot(stopped, [pts[r][0] for r in stopped], ls="none", marker="o", mfc="white",
                    mec=line.get_color())
        g = goodputs.get(lb)
        if g:
            ax.axvline(g, color=line.get_color(), ls=":", lw=1)
    if any_partial:
        ax.plot([], [], ls="none", marker="o", mfc="white", mec="gray", label="stopped early (lower bound)")
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(_title("SLO attainment vs request rate" + (f"\n{subtitle}" if subtitle else ""), simulated),
                 fontsize=10)
    return _save(fig, path)


def plot_goodput_sweep(sweep: Mapping, xlabel: str, path: Path, simulated: bool = False, bars: bool = False,
                       subtitle: str = "") -> Path:
    """``sweep``: x -> {label: goodput}. Lines over numeric x, grouped bars otherwise."""
    fig = _figure()
    ax = fig.add_subplot()
    xs = list(sweep)
    labels = list(dict.fromkeys(lb for v in sweep.values() for lb in v))
    if bars:
        w = 0.8 / max(1, len(labels))
        pos = np.arange(len(xs))
        for i, lb in enumerate(labels):
            ax.bar(pos + (i - (len(labels) - 1) / 2) * w, [sweep[x].get(lb) or 0.0 for x in xs], w, label=lb)
        ax.set_xticks(pos, [str(x) for x in xs])
    else:
        for lb in labels:
            ax.plot([float(x) for x in xs], [sweep[x].get(lb) or 0.0 for x in xs], marker="o", label=lb)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (req/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(_title(f"goodput vs {xlabel}" + (f"\n{subtitle}" if subtitle else ""), simulated), fontsize=10)
    return _save(fig, path)


def _cdf(ax, values: Sequence[float], label: str) -> None:
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=np.float64))
    if not len(v):
        return
    ax.step(v * 1e3, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def plot_cdfs(probes: Mapping[str, object], targets: Mapping[str, Mapping[str, float | None]], metric: str,
              path: Path, simulated: bool = False, subtitle: str = "") -> Path:
    """Per class, the CDF of ``metric`` ("ttft", or "tbt" = per-request P99 TBT) per label."""
    classes = sorted({r.slo_class for p in probes.values() for r in p.records}, key=class_order)
    n = max(1, len(classes))
    fig = _figure(4.2, 3.6, ncols=n)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, c in zip(axes, classes):
        for lb, p in probes.items():
            recs = [r for r in p.records if r.slo_class == c]
            vals = [r.ttft for r in recs] if metric == "ttft" else [r.p99_tbt for r in recs]
            _cdf(ax, vals, lb)
        t = (targets.get(c) or {}).get(metric)
        if t:
            ax.axvline(t * 1e3, color="gray", ls="--", lw=1, label="target")
        ax.set_title(c, fontsize=10)
        ax.set_xlabel(("TTFT" if metric == "ttft" else "per-request P99 TBT") + " (ms)")
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    what = "TTFT" if metric == "ttft" else "P99 TBT"
    fig.suptitle(_title(f"{what} CDF per class" + (f" - {subtitle}" if subtitle else ""), simulated), fontsize=10)
    return _save(fig, path)


def write_plots(out_dir: str | Path, *, probes_by_label=None, goodputs=None, target: float = 0.9,
                ref_probes=None, slo_targets=None, slo_scale_sweep=None, mix_sweep=None,
                simulated: bool = False, workload: str = "", slos: str = "") -> list[Path]:
    """Every plot there is data for; returns the files written. ``workload`` / ``slos``
    describe the mix and the SLO targets (a sweep plot omits the one it varies)."""
    out = Path(out_dir)
    both = ", ".join(x for x in (workload, slos) if x)
    paths = []
    if probes_by_label:
        paths.append(plot_attainment_vs_rate(probes_by_label, goodputs or {}, target, out / "attainment_vs_rate.png",
                                             simulated, both))
    if slo_scale_sweep:
        paths.append(plot_goodput_sweep(slo_scale_sweep, "SLO scale", out / "goodput_vs_slo_scale.png", simulated,
                                        subtitle=workload))
    if mix_sweep:
        paths.append(plot_goodput_sweep(mix_sweep, "mix (chat:code:summarization)", out / "goodput_vs_mix.png",
                                        simulated, bars=True, subtitle=slos))
    if ref_probes:
        paths.append(plot_cdfs(ref_probes, slo_targets or {}, "ttft", out / "ttft_cdf.png", simulated, both))
        paths.append(plot_cdfs(ref_probes, slo_targets or {}, "tbt", out / "tbt_cdf.png", simulated, both))
    return paths
