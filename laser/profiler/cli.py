"""``laser profile``: measure the latency model of this machine, and report its accuracy.

    laser profile [--model M] [--dtype D] [--threads T] [--output PATH] [--reuse]
                  [--evaluate] [--json PATH] [--policies vllm,sarathi,laser]

Where the profile goes: ``--output PATH`` (or ``--latency-profile PATH``, the same;
``--output`` wins), else the cache file of this (model, dtype, hardware, threads) that
engine starts read (``--latency-profile auto``; a ``--quick`` profile is written only
where you name). It is measured anew and written there, unless ``--reuse``: then a file
you named is loaded as is (an error if it is corrupt or made for another setup: it is
never profiled over; measured there only when missing), and the cache file is loaded
when it is valid and still matches this machine, else made again (as at engine start).
The scheduling flags (``--policy``, ``--queue-order``, token budgets, SLOs) and
``--no-latency-calibration`` do not change what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


# engine flags that do not change what is measured (scheduling, SLOs, online calibration)
_UNMEASURED_FLAGS = {"policy", "queue_order", "max_num_batched_tokens", "max_num_seqs", "slo_config", "slo_scale",
                     "default_slo_class", "latency_calibration", "jitter_margin", "best_effort_share"}


def register(subparsers) -> None:
    from ..cli import add_engine_args, policy_names, positive_float

    p = subparsers.add_parser("profile", help="profile the latency model on this machine (and report its accuracy)",
                              description=__doc__.replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, policy_default="vllm")
    # What is measured does not depend on the scheduler: keep those flags (scripts may pass
    # a whole engine command line) but out of --help. --latency-profile names the file written.
    for a in p._actions:
        if a.dest in _UNMEASURED_FLAGS:
            a.help = argparse.SUPPRESS
        elif a.dest == "latency_profile":
            a.help = ("profile file to write, as --output (which wins when both are given); 'auto' (default): the "
                      "cache file of this setup that engine starts read")
    p.add_argument("--output", "-o", default=None,
                   help="profile file to write (default: --latency-profile's, else the "
                        "per-model/dtype/hardware/threads cache file)")
    p.add_argument("--reuse", action="store_true",
                   help="load the profile instead of measuring it: a file named by --output/--latency-profile as "
                        "is (an error if it is corrupt or made for another setup; measured only when missing), the "
                        "cache file when it is valid and matches this machine now (else measured again)")
    p.add_argument("--budget", type=positive_float, default=40.0,
                   help="seconds of timing after which profiling stops repeating samples (default 40; every "
                        "sample still gets two timings, so a busy machine takes longer)")
    p.add_argument("--evaluate", action="store_true",
                   help="then measure held-out layer steps and scheduler iterations and report accuracy")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the accuracy report as JSON (with --evaluate; default: not written)")
    p.add_argument("--policies", default="vllm,sarathi,laser", type=policy_names,
                   help="comma list of policies whose plans --evaluate times (default %(default)s)")
    p.add_argument("--repeatability", action="store_true",
                   help="with --evaluate (a profile measured now): time every held-out case twice and report how "
                        "well the two agree, the ceiling the machine's timing noise puts on the accuracy (the test "
                        "set's timing doubles: raise --eval-budget)")
    p.add_argument("--eval-budget", type=positive_float, default=100.0,
                   help="seconds of timing after which --evaluate stops repeating measurements (default 100)")
    p.add_argument("--min-repeats", type=int, default=None, metavar="K",
                   help="timings every sample (and held-out case) gets whatever the budgets; its time is their "
                        "median (default 5 with --evaluate: one call jitters by ~10%% on a VM and a held-out figure "
                        "is only as good as the times it is scored against; 2 otherwise, and with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="a small sample grid and a short evaluation (seconds; smoke tests, not for serving); "
                        "caps the budgets at 10 s and 20 s")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (default: shown on a terminal)")
    p.set_defaults(func=cmd_profile)


def _engine(args):
    from ..cli import setup_cpus
    from ..core.config import CacheConfig, SchedulerConfig
    from ..frontend.engine import Engine
    from ..latency import SimpleLatencyModel

    setup_cpus(args)  # the same default as engine starts, so the profile matches them
    cache = CacheConfig(block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                        intermediate_cache_tokens=args.intermediate_cache_tokens)
    # The profile measures the executor: the policy does not matter, and no profile is loaded
    # (the placeholder latency model is never used for planning here).
    return Engine(model=args.model, policy="vllm", dtype=args.dtype, quantization=args.quantization, cache=cache,
                  scheduler=SchedulerConfig(policy="vllm"), latency_model=SimpleLatencyModel(num_layers=1))


def _unwritable(path) -> str | None:
    """Why ``path`` cannot be written (checked before minutes of profiling), or None."""
    import tempfile

    if not path:
        return None
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while probe and not os.path.isdir(probe):  # save() creates missing folders
        probe = os.path.dirname(probe)
    try:
        with tempfile.NamedTemporaryFile(dir=probe or "."):
            pass
    except OSError as e:
        return f"cannot write into {probe}: {e.strerror or e}"
    return None


def summary_lines(lm) -> list[str]:
    """A few fitted numbers and predictions, for people."""
    from ..latency.fitted import prefill_step_factor

    rep = lm.report
    out = [f"  stateless: width {rep['stateless'].get('width')}, fit error {100 * (rep['stateless'].get('error') or 0):.1f}%",
           f"  attention: features {rep['attention'].get('feature_set')}, fit error "
           f"{100 * (rep['attention'].get('error') or 0):.1f}% of attention alone (fitted relative to the layer)",
           f"  head: width {rep['head'].get('width')}, fit error {100 * (rep['head'].get('error') or 0):.1f}%",
           f"  layer-call overhead: {lm.layer_overhead_s * 1e6:.0f} us, attention x"
           f"{getattr(lm, 'layer_attention_scale', 1.0):.3f} inside a layer"]
    if "layer" in rep:
        out[-1] += f" (whole-layer fit error {100 * rep['layer']['error']:.1f}%)"
    if "step_overhead" in rep:
        so = rep["step_overhead"]
        out.append(f"  step overhead (beyond layers, embedding, head): {so['step_s'] * 1e6:.0f} us per step + "
                   f"{so['compose_s'] * 1e6:.0f} us per batch composition + {so['compose_work_s'] * 1e6:.0f} us per "
                   f"composed work (fit error {100 * so['error']:.1f}%)")
    if "decode_step" in rep:
        ds = rep["decode_step"]
        out.append(f"  decode layers inside a step: stateless x{ds['scale']:.3f}, attention x{ds['attention_scale']:.3f} "
                   f"of the call timed alone ({ds['n']} whole decode steps, fit error {100 * ds['error']:.1f}%)")
    if "prefill_step" in rep:
        ps = rep["prefill_step"]
        slope = ps.get("slope", 0.0)
        at = {n: prefill_step_factor(ps["scale"], slope, n) for n in (32, 1024)}
        size = (f" at 256 prefill tokens, x (tokens / 256)^-{slope:.3f}: x{at[32]:.3f} at 32, x{at[1024]:.3f} at 1,024"
                if slope else "")
        out.append(f"  layers holding a prefill chunk inside a step: x{ps['scale']:.3f} of the call timed alone{size} "
                   f"({ps['n']} whole prefill and mixed steps, fit error {100 * ps['error']:.1f}%, "
                   f"{100 * ps['error_alone']:.1f}% priced as timed alone)")
    if getattr(lm, "decode_warm", ()):
        parts = [f"{r} row{'s' if r > 1 else ''} x{fs[0]:.2f} -> x{fs[-1]:.2f}" for r, fs in lm.decode_warm
                 if min(fs) < 1.0]
        longest = max(len(fs) for _, fs in lm.decode_warm)
        out.append(f"  decode steps in a streak (after 1 -> {longest} decode steps, of the price after other work): "
                   f"{', '.join(parts) or 'no saving'} ({rep.get('decode_warm', {}).get('n', 0)} places in streaks timed)")
    if lm.mask_row_s:
        out.append(f"  grammar mask (structured output): {lm.mask_row_s * 1e3:.3f} ms per sampled row")
    out.append("  predicted (one layer / whole iteration):")
    for b in (1, 16, 64):
        ctx = [512] * b
        out.append(f"    decode batch {b:>3} @ ctx 512: {lm.step_layer_time((1,) * b, ctx) * 1e3:8.2f} ms / "
                   f"{lm.predict_decode_iteration(ctx) * 1e3:8.1f} ms")
    for q in (128, 512, 2048):
        out.append(f"    prefill {q:>4} tokens:        {lm.step_layer_time((q,), (q,)) * 1e3:8.2f} ms / "
                   f"{lm.predict_prefill(q) * 1e3:8.1f} ms")
    return out


def cmd_profile(args) -> int:
    """``laser profile``: measure (or, with ``--reuse``, load) the latency profile, save it, print
    its summary; with ``--evaluate`` measure a held-out test set and report the accuracy. 2 on a
    usage error or a file that cannot be written."""
    from .. import profiler

    progress = not args.no_progress and sys.stderr.isatty()
    lp = getattr(args, "latency_profile", None)
    explicit = args.output or (lp if lp not in (None, "auto") else None)  # where the user said
    if _flag_error(args, explicit):
        return 2
    if args.quick:
        args.budget, args.eval_budget = min(args.budget, 10.0), min(args.eval_budget, 20.0)
    t0 = time.perf_counter()
    engine = _engine(args)
    load_s = time.perf_counter() - t0
    path = explicit or profiler.default_path(engine)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    ev = dict(num_layer_steps=6, plans_per_policy=2, max_tokens=256, max_batch=16, num_requests=8, num_small_decode=3) \
        if args.quick else {}
    if args.evaluate:
        ev["min_repeats"] = args.min_repeats or (2 if args.quick else 5)
    got = _measure_or_load(args, engine, explicit, path, policies, ev, progress)
    if got is None:
        return 2
    lm, rep, path, prof_s, loaded = got
    warned = _print_profile(lm, rep, path, loaded, prof_s, load_s)
    if not args.evaluate:
        return 0
    return _evaluation(args, engine, lm, rep, path, policies, ev, progress, t0, warned)


def _flag_error(args, explicit) -> bool:
    """Print the usage error of ``laser profile``'s flags, if any (then True)."""
    if args.min_repeats is not None and args.min_repeats < 1:
        print("laser: error: --min-repeats needs a positive count", file=sys.stderr)
        return True
    if args.quick and args.reuse and not explicit:
        print("laser: error: --quick --reuse needs --output or --latency-profile PATH (a quick profile must not "
              "become the default one)",
              file=sys.stderr)
        return True
    for flag, on in (("--json", args.json), ("--repeatability", args.repeatability)):
        if on and (not args.evaluate or (flag == "--repeatability" and args.reuse)):
            print(f"laser: error: {flag} needs --evaluate" + (" on a profile measured now (not --reuse)"
                                                           if args.reuse and args.evaluate else ""), file=sys.stderr)
            return True
    for flag, target in (("--json", args.json), ("--output", explicit)):
        problem = _unwritable(target)
        if problem:
            print(f"laser: error: {flag} {target}: {problem}", file=sys.stderr)
            return True
    return False


def _measure_or_load(args, engine, explicit, path, policies, ev, progress):
    """The profile (measured now, with the test set interleaved under ``--evaluate``; or read from
    ``path`` under ``--reuse``): ``(lm, report or None, path, seconds, loaded)``, None when it
    could not be saved."""
    from .. import profiler

    grid = profiler.ProfileGrid.tiny() if args.quick else None
    if args.min_repeats and not args.evaluate:  # (with --evaluate: ev["min_repeats"])
        grid = grid or profiler.default_grid(engine.runner)
        grid.min_repeats = args.min_repeats
    rep = None
    t1 = time.perf_counter()
    loaded = False  # the profile was read from its file, not measured now
    if args.reuse:
        # the user's own file is used as is or rejected, never profiled over
        create = not explicit or not os.path.exists(path)
        before = os.path.getmtime(path) if os.path.exists(path) else None
        lm = profiler.load_or_create(engine, path, create=create, progress=progress, budget_s=args.budget, grid=grid)
        prof_s = time.perf_counter() - t1
        # (a stale cached profile is made again: then the file changed)
        loaded = before is not None and os.path.exists(path) and os.path.getmtime(path) == before
        return lm, rep, path, prof_s, loaded
    print(f"[laser] profiling {profiler.model_name_of(engine)} ({profiler.dtype_name(engine.dtype)}, "
          f"{profiler.profile_metadata(engine)['threads']} threads, "
          f"{profiler.executor_path_of(engine)} executor)"
          + (" and measuring a held-out test set, interleaved" if args.evaluate else "") + " ...",
          file=sys.stderr)
    if args.evaluate:
        lm, rep = profiler.profile_and_evaluate(engine, grid=grid, policies=policies, progress=progress,
                                                budget_s=args.budget + args.eval_budget,
                                                repeatability=args.repeatability, **ev)
    else:
        lm = profiler.profile(engine, None, progress=progress, budget_s=args.budget, grid=grid)
    prof_s = time.perf_counter() - t1
    if args.quick and not explicit:
        path = "(not saved: --quick profiles go only where --output says)"
    else:
        try:
            lm.save(path)
        except OSError as e:
            print(f"laser: error: cannot write the profile to {path}: {e}", file=sys.stderr)
            return None
    return lm, rep, path, prof_s, loaded


def _print_profile(lm, rep, path, loaded: bool, prof_s: float, load_s: float) -> bool:
    """Print the profile's measurement line and summary; returns whether the profile was warned
    about as disturbed where it was measured."""
    from .pipeline import disturbed_enough_to_warn

    m = lm.metadata.get("measurement", {})
    what = "profile + test set" if rep is not None else "profile"
    dropped = m.get("dropped_outliers") or 0
    took = (f"loaded (profiled in {lm.metadata.get('profile_seconds', '?')} s on {lm.metadata.get('created', '?')})"
            if loaded else f"{what} took {prof_s:.1f} s")
    print(f"[laser] profile {path}: {len(lm.samples)} samples, each the median of its undisturbed repeats"
          + (f" ({dropped} dropped as outliers of the fit, likely slowed by another process)" if dropped else "")
          + f"; {took} (model load {load_s:.1f} s)"
          + (f", {100 * m['clean_fraction']:.0f}% of timed calls clean" if "clean_fraction" in m else "")
          + (f", {100 * m['disturbed_fraction']:.0f}% disturbed (reference calls re-timed up to "
             f"{100 * m.get('max_reference_drift', 0):.0f}% over their best)" if "disturbed_fraction" in m else ""))
    # A profile measured now was warned about where it was measured (the profiler's log), one
    # loaded from its file where it was loaded (``load_or_create``): not again here.
    warned = not loaded and disturbed_enough_to_warn(m)
    for line in summary_lines(lm):
        print(line)
    return warned


def _evaluation(args, engine, lm, rep, path, policies, ev, progress, t0: float, warned: bool) -> int:
    """``--evaluate``: the held-out test set's accuracy report (measured now for a loaded profile),
    printed and written to ``--json``."""
    from .. import profiler

    if rep is None:  # a loaded profile: measure the test set now
        t2 = time.perf_counter()
        if args.quick:
            ev.update(rounds=(1, 2), warmup_s=0.2)
        rep = profiler.evaluate(engine, lm, policies=policies, progress=progress, budget_s=args.eval_budget, **ev)
        rep["evaluate_seconds"] = round(time.perf_counter() - t2, 1)
    rep["total_seconds"] = round(time.perf_counter() - t0, 1)
    rep["profile_path"] = str(path)
    rep["command"] = ("laser " + " ".join(sys.argv[1:])) if sys.argv[1:2] == ["profile"] else None
    # the test set measured interleaved with a profile warned about shares its warning
    print(profiler.format_report(rep, warn_busy=not (warned and rep["measurement"].get("interleaved_with_profile"))))
    print(f"[laser] total {rep['total_seconds']:.1f} s")
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=1)
        except OSError as e:
            print(f"laser: error: cannot write the report to {args.json}: {e}", file=sys.stderr)
            return 2
        print(f"[laser] accuracy report written to {args.json}")
    return 0
