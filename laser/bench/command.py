"""``laser bench``'s command (:func:`cmd_bench`): set up the targets, workload and SLOs
(:mod:`laser.bench.cli`), run one rate or the goodput search and its sweeps, report. One
:class:`_BenchRun` holds the run's state; each phase is one of its methods."""

from __future__ import annotations

import shlex
import sys
import time

from laser.bench.args import DEFAULT_POLICIES, _floats, parse_mix
from laser.bench.cli import (_default_lm, _rate_range, apply_budgets, build_targets, build_workload, calibrate_slos,
                             check_flags, parse_policies, with_best_baseline)


def cmd_bench(args) -> int:
    """``laser bench`` (see :mod:`laser.bench.cli`). Raises ValueError for exclusive or bad flags."""
    run = _BenchRun(args)
    run.setup()
    if args.batch_requests:
        from laser.bench.batchjob import bench_batch_job

        return bench_batch_job(args, run.bench, run.lm, run.tokenizer, run.max_len, run.tag)
    run.measure()
    run.sweep()
    run.close_progress()
    run.report()
    return 0


class _BenchRun:
    """One ``laser bench`` run: its targets, workload, SLOs and search parameters, then its results."""

    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.bar = None
        self.results_gp = None
        self.range_note = None
        self.budget_sweeps = {}
        self.sweeps = {}
        self.lo = self.hi = None

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        from laser.bench import report
        from laser.bench.best import expand_best, parse_budgets

        args = self.args
        if args.base_url and args.sim:
            raise ValueError("--base-url and --sim are exclusive")
        self.search = args.goodput or (args.request_rate is None and args.trace is None)
        check_flags(args, self.search)
        if args.batch_requests and (self.search or getattr(args, "cluster", None)):
            raise ValueError("--batch-requests needs --request-rate (one rate, no goodput search) and no --cluster")
        shown = parse_policies(args.policy or DEFAULT_POLICIES)
        # a simulated cluster compares controllers (--controller), not policies: no ':best' there
        by_target = bool(args.base_url or getattr(args, "cluster", None))
        if not by_target:
            shown = with_best_baseline(shown, self.search, auto=not args.no_auto_best)
        self.specs, self.groups = expand_best(shown, parse_budgets(args.best_budgets))
        if by_target:
            self.groups = {}
        self.progress = not args.no_progress
        self.targets, self.tokenizer, self.max_len, self.lm, self.mode = build_targets(args, self.specs)
        self.labels = list(self.targets) if by_target else [lb for lb, _, _ in shown]
        self.simulated = self.mode == "sim"
        self.tag = f" {report.SIM_TAG}" if self.simulated else ""
        self._announce()
        self.requests, self.trace_times, self.wl_desc = build_workload(args, self.tokenizer, self.max_len)
        print(f"workload: {self.wl_desc}")
        if not args.no_warmup and self.mode != "sim":
            for t in self.targets.values():
                t.warmup()
        self.cal = calibrate_slos(args, self.targets, self.requests, self.tokenizer)
        print(self.cal.format() + self.tag)
        self.slos = self.cal.slo_classes()
        budgets = apply_budgets(self.targets, self.specs, self.slos, self.lm or _default_lm(args))
        for lb, b in budgets.items():
            print(f"{lb}: token budget (max_num_batched_tokens) {b}")
        self._search_parameters()
        self.bench = self.make_bench(self.requests, self.slos)

    def _announce(self) -> None:
        args, lm = self.args, self.lm
        if self.simulated and getattr(args, "cluster", None):
            print(f"SIMULATED cluster {args.cluster}: controllers {', '.join(self.targets)} over simulated instances "
                  f"of {args.sim_model} on {lm.hardware.name} ({type(lm).__name__}: an estimate; virtual time, not "
                  f"measured).")
        elif self.simulated:
            print(f"SIMULATED run: policies on SimInstance, clock = {type(lm).__name__} (virtual time, not measured).")

    def _search_parameters(self) -> None:
        args, simulated = self.args, self.simulated
        if args.probe_timeout is not None:
            self.probe_timeout = args.probe_timeout
        else:
            self.probe_timeout = None if simulated else 60.0
        self.grid = args.grid_points or (8 if simulated else 4)
        self.steps = args.bisect_steps if args.bisect_steps is not None else (6 if simulated else 2)
        if self.progress:
            from tqdm.auto import tqdm

            est = len(self.targets) * ((self.grid + 2 + self.steps) if self.search else 1)
            self.bar = tqdm(total=est, desc="probes" + self.tag, unit="run", dynamic_ncols=True)
        self.time_cap = (args.search_time_cap if args.search_time_cap is not None
                         else (900.0 if simulated else 3600.0))

    def on_probe(self, p) -> None:
        from laser.bench import report

        line = report.format_probe_line(p, self.args.attainment_target) + self.tag
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def make_bench(self, reqs, slo_table):
        from laser.bench.runner import Benchmark

        args = self.args
        return Benchmark(self.targets, reqs, slo_table, burstiness=args.burstiness, seed=args.seed,
                         attainment_target=args.attainment_target, trace_times=self.trace_times,
                         probe_timeout_s=self.probe_timeout, progress=self.progress and not self.simulated,
                         on_probe=self.on_probe, early_stop=not args.no_early_stop and not self.simulated)

    # -- the runs -------------------------------------------------------------------------------
    def run_search(self, b):
        """Goodput of every shown label (``:best`` folded in); ``b.targets`` gains each
        ``:best`` label as an alias of its best candidate."""
        from laser.bench.best import resolve_best

        args = self.args
        res = b.goodput(self.lo, self.hi, self.grid, self.steps, full_grid=args.full_grid,
                        max_doublings=args.max_doublings, time_cap_s=self.time_cap)
        res, sw = resolve_best(res, self.groups, self.labels)
        for lb, bs in sw.items():
            b.targets[lb] = b.targets[bs.best_candidate]
        return res, sw

    def measure(self) -> None:
        """The goodput search (then full runs at the reference rate where the comparison needs
        them), or one run at ``--request-rate``."""
        from laser.bench.runner import probe_at, reference_rate

        args, bench, labels, tag = self.args, self.bench, self.labels, self.tag
        if not self.search:
            self.ref = args.request_rate
            bench.run_at(self.ref)
            return
        self.lo, self.hi, self.range_note = _rate_range(args, self.targets, self.requests, self.slos, self.lm,
                                                        self.mode)
        print(f"goodput search from {self.lo:.3g}-{self.hi:.3g} req/s ({self.range_note}); grid {self.grid}, then "
              f"doubling until every policy fails a probe (at most {args.max_doublings}), bisection {self.steps}; "
              f"time cap {self.time_cap:g} s; attainment target {args.attainment_target:g}")
        self.results_gp, self.budget_sweeps = self.run_search(bench)
        for bs in self.budget_sweeps.values():
            print(bs.format() + tag)
        ref = self.ref = args.report_rate or reference_rate(self.results_gp)
        # The comparison needs Laser and the best baseline run in full on the same arrivals
        # at ``ref``; any other target only needs some probe there (a stopped one is marked).
        base = [lb for lb in labels if lb != "laser"]
        best = max(base, key=lambda lb: self.results_gp[lb].goodput_rps) if base else None
        for lb in labels:
            have = probe_at(self.results_gp, lb, ref)
            if have is None or (have.early_stopped and lb in ("laser", best)):
                print(f"[{lb}] full run at the reference rate {ref:.3g} req/s for the comparison{tag}")
                self.results_gp[lb].probes.append(bench.probe(lb, ref, early_stop=False))

    def sweep(self) -> None:
        """The goodput sweeps over SLO scales, mixes and cluster sizes (search mode only)."""
        args, tag, sweeps = self.args, self.tag, self.sweeps
        if args.sweep_slo_scale and self.search:
            sweeps["slo_scale"] = {}
            for sc in _floats(args.sweep_slo_scale):
                print(f"-- SLO scale {sc:g}{tag}")
                sc_slos = self.cal.rescaled(sc).slo_classes()
                apply_budgets(self.targets, self.specs, sc_slos, self.lm or _default_lm(args))
                res, sw = self.run_search(self.make_bench(self.requests, sc_slos))
                sweeps["slo_scale"][f"{sc:g}"] = {lb: g.goodput_rps for lb, g in res.items()}
                sweeps.setdefault("slo_scale_best_budget", {})[f"{sc:g}"] = {lb: bs.best_budget
                                                                             for lb, bs in sw.items()}
        apply_budgets(self.targets, self.specs, self.slos, self.lm or _default_lm(args))
        if args.sweep_mix and self.search:
            sweeps["mix"] = {}
            for m in args.sweep_mix.split(","):
                mix = parse_mix(m.strip())
                print(f"-- mix {m.strip()}{tag}")
                reqs, _, _ = build_workload(args, self.tokenizer, self.max_len, mix=mix)
                res, sw = self.run_search(self.make_bench(reqs, self.slos))
                sweeps["mix"][m.strip()] = {lb: g.goodput_rps for lb, g in res.items()}
                sweeps.setdefault("mix_best_budget", {})[m.strip()] = {lb: bs.best_budget for lb, bs in sw.items()}
        if args.sweep_cluster and self.search and getattr(args, "cluster", None):
            from laser.bench.cluster import sweep_cluster

            sweeps["cluster_gpus"] = sweep_cluster(args, self.targets, self.requests, self.slos, self.lo, self.hi,
                                                   self.grid, self.steps, self.make_bench, tag, self.time_cap)

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.total = self.bar.n
            self.bar.close()

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> None:
        """Per-label summaries, the comparison, the JSON and the plots."""
        from laser.bench import report

        args = self.args
        policies_json, ref_probes = self._policy_reports()
        results = report.sanitize(self._results_json(policies_json))
        print(report.format_comparison(results))
        print(f"total wall time {results['wall_s']:.0f} s")
        if args.json:
            report.write_json(results, args.json)
            print(f"results written to {args.json}")
        if args.plots:
            self._plots(ref_probes)

    def _policy_reports(self) -> tuple[dict, dict]:
        from laser.bench import report
        from laser.bench.runner import probe_at

        args, bench = self.args, self.bench
        policies_json, ref_probes = {}, {}
        for lb in self.labels:
            tgt = bench.targets[lb]
            if self.results_gp is not None:
                p = probe_at(self.results_gp, lb, self.ref)
                g = self.results_gp[lb]
                probes = None
            else:
                p = probe_at(bench.probes, lb, self.ref)
                g = None
                probes = [q for q in bench.probes if q.label == lb]
            ref_probes[lb] = p
            policies_json[lb] = report.policy_json(lb, self.cal.targets, p, g, args.attainment_target,
                                                   tgt.describe(), probes)
            if lb in self.budget_sweeps:
                policies_json[lb]["budget_sweep"] = self.budget_sweeps[lb].to_json()
            extra = {"Policy / target": f"{lb} ({self.mode}{', disaggregated' if args.disaggregated else ''})"}
            print(report.format_summary(p.records, p.summary, rate=p.rate, simulated=self.simulated,
                                        goodput=g, extra=extra))
        return policies_json, ref_probes

    def _results_json(self, policies_json: dict) -> dict:
        from laser.bench import report

        args, simulated, targets_s = self.args, self.simulated, self.cal.targets
        search = None
        if self.search:
            search = {"rate_range_rps": [self.lo, self.hi], "range_note": self.range_note, "grid_points": self.grid,
                      "bisect_steps": self.steps, "max_doublings": args.max_doublings,
                      "time_cap_s": self.time_cap, "probe_timeout_s": self.probe_timeout}
        return {
            "benchmark": "laser bench",
            "simulated": simulated,
            "mode": self.mode,
            "note": ("SIMULATED: schedulers on SimInstance with a latency model in virtual time; not a measurement"
                     if simulated else "measured in real time"),
            "command": ("laser bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
                        if sys.argv[1:2] == ["bench"] else None),
            "policies_order": self.labels,
            "disaggregated": args.disaggregated,
            "workload": self.wl_desc,
            "arrivals": {"process": "trace" if args.trace else ("poisson" if args.burstiness == 1 else "gamma"),
                         "burstiness": args.burstiness, "seed": args.seed},
            "attainment_target": args.attainment_target,
            "search": search,
            "slo": self.cal.to_dict(),
            "slo_targets": {c: {"ttft_s": t.get("ttft"), "tbt_s": t.get("tbt")} for c, t in targets_s.items()},
            "reference_rate_rps": self.ref,
            "latency_model": type(self.lm).__name__ if self.lm is not None else None,
            "policies": policies_json,
            "comparison": report.comparison_json(policies_json),
            "sweeps": self.sweeps,
            "wall_s": round(time.perf_counter() - self.t_start, 1),
        }

    def _plots(self, ref_probes: dict) -> None:
        from laser.bench.plots import write_plots

        args, cal, results_gp = self.args, self.cal, self.results_gp
        wl_txt = f"{self.wl_desc['mix']} mix" if "mix" in self.wl_desc else "trace"
        slo_txt = f"{cal.base} SLOs x{cal.scale:g}" + (" (--slo-config)" if args.slo_config else "")
        probes_by = {lb: (results_gp[lb].probes if results_gp else [q for q in self.bench.probes if q.label == lb])
                     for lb in self.labels}
        paths = write_plots(args.plots, probes_by_label=probes_by if self.search else None,
                            goodputs={lb: g.goodput_rps for lb, g in results_gp.items()} if results_gp else None,
                            target=args.attainment_target, ref_probes={k: v for k, v in ref_probes.items() if v},
                            slo_targets=cal.targets, slo_scale_sweep=self.sweeps.get("slo_scale"),
                            mix_sweep=self.sweeps.get("mix"), simulated=self.simulated, workload=wl_txt, slos=slo_txt)
        print("plots: " + ", ".join(str(p) for p in paths))
