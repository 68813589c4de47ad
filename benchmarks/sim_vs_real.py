"""Simulator vs real engine: SLO attainment per class on the same arrivals (REAL engine + SIMULATED).

The simulator prices every step with the engine's own latency profile (the one its policies
plan with) and takes it as exact. This benchmark checks that assumption end to end:

1. build the engine as ``laser bench`` does (``--latency-profile auto``: the cached profile of
   this model, dtype, hardware, threads and executor path, measured on first use), the workload
   (``laser.bench.workloads``: the multi-SLO mix) and the SLO targets (``laser bench``'s
   calibration: by default scaled to the engine's measured isolated latencies);
2. put the simulator on the machine as it runs now (``--sim-machine measured``, the default;
   ``knee_on_machine``): a first run of the workload on the real engine (at ``--speed-fraction``
   x the knee on the profile as is; a second one below the knee it finds when it ran past it)
   measures how fast the machine runs the engine's steps against the profile, decode and
   prefill apart, and how far its steps scatter around that fitted price
   (``laser.latency.machine_speed``); the simulator's clock is then the profile at that speed,
   each simulated step drawing its own ratio from the run's scatter of its kind
   (``JitteredLatencyModel``, seeded), and its engine plans as the real one does (the online
   calibration, which measures the simulated scatter as the engine measures the real one and
   divides its margins by it). The profile is measured once and the host drifts (an isolated
   decode step of 10.7-14.8 ms on one VM in one afternoon: docs/benchmarks.md "The AMX kind, session 28"), and a simulated machine
   that never runs a step late plans with full margins and never lands a plan past its target:
   either alone put the simulated knee past the real engine's (``--sim-machine profile``: the
   profile as is, taken as exact, as before);
   then find the simulated knee -- the goodput of the policy in the simulator
   (``laser.bench.goodput.search_goodput``: the highest rate at which >= 90 % of requests meet
   their SLO); ``--knee RPS`` skips the search and uses the rate given, e.g. the knee a previous
   run printed;
3. run the simulator and the real engine at the knee and at 0.8x of it (``--fractions``), on the
   same arrivals (one ``Benchmark``: common random numbers), the real engine in two ways
   (``--real``): ``inprocess`` (``EngineTarget``: ``laser.online.run_online``, arrivals released at
   layer boundaries in real time) and ``serve`` (a ``laser serve`` subprocess with the same engine
   flags and the same profile file, driven through HTTP by ``laser bench``'s client:
   ``ClientTarget``, streaming, each request carrying its class and targets in headers). Each
   is measured (step 2), its knee searched and compared in one go, in process first: the served
   engine shares the cores with its front end and the client, so it has its own machine, front
   end under load and knee (a served simulation, below), and the host drifts less between a
   run's measurement and its comparison;
4. print the attainment per class side by side (sim, each real run, real - sim), and mean TTFT;
   then per class the median per-request difference real - sim (TTFT, TPOT, P99 TBT) and the
   requests whose verdict flipped (``laser.bench.record_pairs``; ``--json`` keeps every request);
5. compare each real run also with its *twin* (``inproc@m``, ``serve@m``): the simulation on the
   machine as that run measured it -- the profile scaled per kind of work to the speed of the
   engine's own steps in that run, their scatter included (in process: ``core.step_log``; served: the server's step log,
   ``laser serve --step-log`` and ``GET /engine/steps``, with the engine thread's time split:
   step wall, its CPU, the wait between (GIL, core), time between steps), plus its scheduling time per step
   (``laser.latency.machine_speed``: decode and prefill layer calls apart), planned as the engine
   plans (its online calibration). The simulation of step 2 prices the machine as the first run
   found it, which on a shared host may have drifted since: the twin tells what the simulator gets
   wrong from what the machine did (on the AVX512 EPYC the engine's steps ran 0.79x / 0.85x of the profile's
   decode / prefill price in one run, and the plain simulation's TTFTs were 1.25x the engine's).
   The served run is compared with a *served* simulation (``SimTarget(served=True)``): the same
   profile plus the front end's share of a TTFT (``frontend_ttft_s``), measured on the started
   server (``laser.bench.frontend_cost``: idle one-token requests, client wall minus the engine's
   TTFT the server reports) and kept in the profile -- with ``--sim-machine measured``, the
   served engine's own machine and its front end under load as its first served runs measured
   them; the served twin adds instead the front end
   its run measured under load (:func:`loaded_frontend`: the client's TTFT minus the engine's,
   12-19 ms against 5-6 ms idle on the 2-vCPU EPYC); the in-process run is compared with the plain
   simulation. Per rate, the served probe's mean TTFT at the server (``/metrics``) is printed
   beside the client's, with the server's hops (HTTP arrival -> its handler -> the engine; the first
   token's step end -> the event loop), the server process's CPU per request (and its part outside
   the engine's steps) and the benchmark client's own CPU per request: the client shares the host
   (``--client-nice 10`` sends at a lower priority than the server, approximating a client on
   another machine; report such a run as its own figure).

Target (issue "the real engine behaves like the simulator"): real within 5 points of sim per
class at both rates. The real runs are measurements: on a busy machine they are slower than the
profile says (the online calibration, on by default, scales the plans to the machine as it runs).

Usage (SmolLM2 defaults: 120 prompts, 30 per code / summarization class, so one request is 3.3
points -- at a class attainment of 0.8-0.9 one run's own sampling error is 5-7 points, so
``--num-prompts 240`` halves a request's weight; about 6 minutes with a cached profile, 12 with
240 prompts; a first run profiles first):
    python benchmarks/sim_vs_real.py [--policy laser] [--num-prompts 120] [--length-scale 0.15]
        [--mix 2:1:1] [--seed 7] [--threads 1] [--fractions 1,0.8] [--real inprocess,serve]
        [--knee RPS] [--sim-machine measured|profile] [--speed-fraction 0.8] [--client-nice N]
        [--serve-cpu-bind auto] [--json out.json] [-- laser bench flags]

The prefix cache is off unless a flag after ``--`` names it (every rate replays the same prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import NamedTuple
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_args(argv: list[str]):
    """``laser bench`` flags parsed by its own parser (one owner of their defaults)."""
    from laser.bench.args import register

    p = argparse.ArgumentParser(prog="laser")
    register(p.add_subparsers(dest="cmd"))
    return p.parse_args(["bench", *argv])


def sim_target(args, policy: str, lm, engine, served: bool = False, label: str = "sim"):
    """The policy on a :class:`SimTarget` priced by ``lm``, sized like ``engine`` (KV blocks,
    block size, intermediate cache, scheduler flags); ``served``: behind the HTTP front end (every
    token ``lm.frontend_ttft_s`` later at the client)."""
    from laser.bench.cli import _sched_config
    from laser.bench.runner import SimTarget

    bm = engine.kv_cache.block_manager
    return SimTarget(policy, lm, engine.model_config.num_layers, _sched_config(args, policy), num_blocks=bm.num_blocks,
                     block_size=bm.block_size, icache_tokens=args.intermediate_cache_tokens, label=label,
                     served=served)


def class_table(pairs: dict) -> list[str]:
    """Rows: class, then per real run (label -> (its simulated probe, its measured probe)) the
    simulated and the real attainment and their difference (points), then the mean TTFT (ms) of
    each simulated and real run, and the count."""
    rows = [f"  {'class':<16}" + "".join(f" {'sim':>6} {lb:>9} {'pts':>6}" for lb in pairs)
            + "   TTFT ms:" + "".join(f" {'sim':>6} {lb:>9}" for lb in pairs) + "  n"]
    probes = [p for pair in pairs.values() for p in pair]
    classes = sorted(set().union(*(p.summary.per_class for p in probes)))

    def pick(probe, c):
        return probe.summary.overall if c == "all" else probe.summary.per_class.get(c)

    def num(x, spec, scale=1.0):
        return "" if x is None else format(x * scale, spec)

    for c in [*classes, "all"]:
        line = f"  {c:<16}"
        for sp, rp in pairs.values():
            sa, ra = (getattr(pick(p, c), "attainment", None) for p in (sp, rp))
            line += (f" {num(sa, '6.3f'):>6} {num(ra, '9.3f'):>9}"
                     f" {'' if sa is None or ra is None else f'{100 * (ra - sa):+6.1f}':>6}")
        line += "          "
        for sp, rp in pairs.values():
            line += "".join(f" {num(getattr(pick(p, c), 'ttft_mean', None), spec, 1e3):>{w}}"
                            for p, spec, w in ((sp, "6.0f", 6), (rp, "9.0f", 9)))
        counts = {getattr(pick(rp, c), "count", None) for _, rp in pairs.values()} - {None}
        rows.append(line + f"  {'/'.join(str(n) for n in sorted(counts))}")
    return rows


#: steps the served engine keeps for its twin (``laser serve --step-log``): more than one rate's run
STEP_LOG = 200_000


def serve_target(stack: ExitStack, args, policy: str, profile, opts, label: str = "serve"):
    """A ``laser serve`` subprocess building the engine ``args`` describe (``laser.cli.engine_argv``:
    the in-process engine's flags) with ``policy`` and the latency profile ``profile`` (a fitted one is
    saved to a file the server loads as is), and a warmed-up ``ClientTarget`` on it (returned). The server stops, and
    its log is copied to ``opts.log_dir`` (when given), as ``stack`` closes. ``opts`` (this script's flags):
    ``client_nice``, ``client_cpus`` (``ClientTarget``'s ``nice``, ``cpus``), the server's ``serve_cpu_bind``. Raises
    RuntimeError when the server does not start."""
    from laser.bench.client import ClientTarget
    from laser.bench.serve_proc import Server, free_port, keep_log
    from laser.cli import engine_argv

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="laser-sim-vs-real-")))
    same = {"latency_profile": str(profile.save(tmp / "profile.json"))} if hasattr(profile, "save") else {}
    server = Server(tmp / "data", free_port(), [*engine_argv(args, policy=policy, cpu_bind=opts.serve_cpu_bind, **same),
                                                "--log-level", "warning", "--step-log", str(STEP_LOG)])
    stack.callback(keep_log, server.log_path, opts.log_dir or "", "sim-vs-real")
    stack.callback(server.stop)
    print(f"laser serve ready in {server.start():.0f} s at {server.base_url}", flush=True)
    target = ClientTarget(server.base_url, label=label, nice=opts.client_nice, cpus=opts.client_cpus)
    target.warmup()
    target.server = server  # its /metrics: the server-side TTFT (server_ttft)
    return target


def server_ttft(server, classes) -> dict:
    """Per class: (sum, count) of the server's TTFT histogram (``/metrics``: HTTP arrival -> the end
    of the first token's step, server clock), of its front-end histogram (HTTP arrival -> the
    engine took the request) and of the first token's hop (its step's end -> the event loop has it)
    so far; a probe's own is the difference of two reads."""
    out = {}
    for c in classes:
        out[c] = tuple(server.metric((name + suffix,), slo_class=c) or 0.0
                       for name in ("laser:time_to_first_token_seconds", "laser:request_frontend_seconds",
                                    "laser:first_token_delivery_seconds", "laser:request_handler_wait_seconds")
                       for suffix in ("_sum", "_count"))
    return out


def server_ttft_line(before: dict, after: dict, probe) -> str:
    """One line: per class, the served probe's mean TTFT at the server (between ``before`` and
    ``after``, :func:`server_ttft`) beside the client's (``probe``), and the server's mean time from
    HTTP arrival to the engine taking the request and from the first token's step end to the event
    loop having it, in ms."""
    parts = []
    for c, now in after.items():
        s1, n1, f1, m1, d1, k1, h1, j1 = now
        s0, n0, f0, m0, d0, k0, h0, j0 = before.get(c, (0.0, 0) * 4)
        cl = probe.summary.per_class.get(c)
        if n1 > n0:
            fe = f" ({1e3 * (h1 - h0) / (j1 - j0):.1f} to the handler, " if j1 > j0 else " ("
            fe += f"{1e3 * (f1 - f0) / (m1 - m0):.1f} to the engine" if m1 > m0 else "-"
            fe += f", {1e3 * (d1 - d0) / (k1 - k0):.1f} back)" if k1 > k0 else ")"
            parts.append(f"{c} {1e3 * (s1 - s0) / (n1 - n0):.0f} / {1e3 * (getattr(cl, 'ttft_mean', 0) or 0):.0f}{fe}")
    return ("  serve, mean TTFT ms at the server (HTTP arrival -> first token's step) / at the client "
            "[in brackets: HTTP arrival -> the handler runs, -> the engine has it, first token's step end -> "
            "the event loop has it]: "
            + ", ".join(parts))


def client_cpu_line(target) -> str:
    """One line: the benchmark client's own CPU per request in its last run (``ClientTarget.cpu_s /
    sent``: its thread's time, ms) and its niceness over the server's; the client shares the host."""
    cpu, sent, nice = (getattr(target, k, None) for k in ("cpu_s", "sent", "nice"))
    per = 1e3 * cpu / sent if cpu is not None and sent else float("nan")
    return f"  serve, the benchmark client: {per:.2f} ms CPU a request ({sent} sent{f', at nice +{nice}' if nice else ''})"


def _cpu_seconds(server) -> float | None:
    """The server process's CPU seconds so far (``Server.cpu_seconds``; None when not known)."""
    fn = getattr(server, "cpu_seconds", None)
    return fn() if fn is not None else None


def loaded_frontend(before: dict, after: dict, probe) -> float | None:
    """Seconds the front end added to a served run's TTFTs under load: over its first tokens, the
    client's mean TTFT minus the engine's own (the server's TTFT from HTTP arrival minus its
    HTTP arrival -> engine time; :func:`server_ttft` reads ``before`` and ``after`` the run;
    ``probe``: the run at the client), weighted by each class's count. It is what the idle
    ``frontend_ttft_s`` becomes when the event loop, the engine thread and the benchmark's client
    share the cores (on the 2-vCPU EPYC: 12-14 ms against 5-6 ms idle). None without first tokens."""
    num = den = 0.0
    for c, now in after.items():
        s1, n1, f1, m1 = now[:4]
        s0, n0, f0, m0 = before.get(c, (0.0, 0) * 4)[:4]
        cl = probe.summary.per_class.get(c)
        n = n1 - n0
        if n <= 0 or m1 - m0 != n or cl is None or not getattr(cl, "ttft_mean", None):
            continue
        num += n * cl.ttft_mean - ((s1 - s0) - (f1 - f0))
        den += n
    return num / den if den else None


def frontend_term(target, profile, probes: int) -> float | None:
    """Measure what ``laser serve``'s front end adds to a TTFT (:func:`laser.bench.frontend_cost.
    measure_frontend_ttft`, on the idle server behind ``target``) and keep it in ``profile`` as
    ``frontend_ttft_s`` (the latency model owns measured timings; the served simulation reads it
    there). Returns it (seconds; None: the server reports no engine TTFT, the profile keeps 0)."""
    from laser.bench.frontend_cost import measure_frontend_ttft

    fe = measure_frontend_ttft(target.base_url, target.resolve_model(), n=probes)
    if fe is not None:
        profile.frontend_ttft_s = fe
    print(f"front end of laser serve: {'not reported' if fe is None else f'{1e3 * fe:.1f} ms'} per TTFT "
          f"(median of {probes} idle one-token requests: client wall - the engine's TTFT)", flush=True)
    return fe


def parse_args(argv: list[str]):
    """(this script's parsed flags, the ``laser bench`` flags after ``--``). Exits on a bad flag."""
    extra = []
    if "--" in argv:
        k = argv.index("--")
        argv, extra = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="laser")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--length-scale", type=float, default=0.15)
    ap.add_argument("--mix", default="2:1:1")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slo-base", choices=["paper", "measured"], default="measured")
    ap.add_argument("--fractions", default="1,0.8", help="rates to run, as fractions of the simulated knee")
    ap.add_argument("--real", default="inprocess,serve",
                    help="real runs: inprocess (EngineTarget), serve (laser serve through HTTP), or both (default)")
    ap.add_argument("--knee", type=float, default=None,
                    help="the simulated knee, req/s, as a previous run printed it: no goodput search")
    ap.add_argument("--sim-machine", choices=["measured", "profile"], default="measured",
                    help="the simulator's machine: 'measured' (default): the profile at the speed and step "
                         "scatter a first real run measures (at --speed-fraction x the knee on the profile as is, "
                         "or x --knee), planned as the engine plans; 'profile': the profile as is, taken as exact")
    ap.add_argument("--sim-draws", type=int, default=5,
                    help="a simulation on a machine whose steps scatter is repeated over this many draws of the "
                         "scatter per rate, printed as mean and range per class (default %(default)s; 1: none)")
    ap.add_argument("--speed-fraction", type=float, default=0.8,
                    help="the first run's rate, as a fraction of the knee on the profile as is or of --knee "
                         "(0.1-1; default %(default)s; a second run at this fraction of the knee the first finds, "
                         "when it ran past it)")
    ap.add_argument("--log-dir", default=None, help="keep the laser serve log here (default: not kept)")
    ap.add_argument("--knee-time-cap", type=float, default=180.0,
                    help="wall seconds after which the simulated knee search starts no new probe (default %(default)s)")
    ap.add_argument("--grid", type=int, default=8, help="goodput search grid points (simulated)")
    ap.add_argument("--bisect", type=int, default=6, help="goodput search bisection steps (simulated)")
    ap.add_argument("--probe-timeout", type=float, default=60.0,
                    help="seconds a real run may go on after its last arrival (unfinished: misses; "
                         "default %(default)s)")
    ap.add_argument("--frontend-probes", type=int, default=9,
                    help="idle one-token requests that measure the served front end's TTFT share (default %(default)s)")
    ap.add_argument("--serve-cpu-bind", default="none", help="the served engine's --cpu-bind (default none)")
    ap.add_argument("--client-cpus", default=None, help="the served run's client sends on these CPUs (a list)")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="the served run's benchmark client sends at this much more niceness than the server "
                         "(e.g. 10: approximates a client on another machine; default %(default)s: the same)")
    ap.add_argument("--json", default=None,
                    help="write the results here, with every request's TTFT / TBT sim and real side by side")
    a = ap.parse_args(argv)
    a.reals = [x.strip() for x in a.real.split(",") if x.strip()]
    if not a.reals or set(a.reals) - {"inprocess", "serve"}:
        ap.error(f"--real: want inprocess, serve or both, got {a.real!r}")
    if a.knee is not None and not (a.knee > 0 and math.isfinite(a.knee)):
        ap.error(f"--knee: want a finite rate > 0 req/s, got {a.knee}")
    if a.sim_draws < 1:
        ap.error(f"--sim-draws: want >= 1, got {a.sim_draws}")
    if not 0.1 <= a.speed_fraction <= 1.0:  # (nan and inf too)
        ap.error(f"--speed-fraction: want 0.1-1 (a fraction of a knee), got {a.speed_fraction}")
    try:
        a.fraction_list = [float(x) for x in a.fractions.split(",")]
    except ValueError:
        a.fraction_list = []
    if not a.fraction_list or not all(math.isfinite(f) and f > 0 for f in a.fraction_list):
        ap.error(f"--fractions: want a comma-separated list of fractions > 0, got {a.fractions!r}")
    if not any("prefix-caching" in x for x in extra):
        # every rate replays the same prompts: a prefix cache would serve a later rate's prompts from
        # an earlier one's (a served run at 0.8x measured 91 ms mean chat TTFT against 271 ms simulated)
        extra = [*extra, "--no-enable-prefix-caching"]
    return a, extra


class MeasuredRun(NamedTuple):
    """A real run (:func:`measured_probe`): its probe, the machine its steps measured (None without a
    complete step) and, served, the server's TTFT counters before and after it (:func:`server_ttft`),
    the seconds its front end added to a TTFT under that load (:func:`loaded_frontend`) and the
    engine thread's and stalls' lines and summary (:func:`served_speed`)."""

    probe: object
    speed: object
    seen: dict | None = None
    after: dict | None = None
    frontend_s: float | None = None
    thread_line: str = ""
    stalls: dict | None = None


def measured_probe(both, label: str, rate: float, profile, classes) -> MeasuredRun:
    """Run real target ``label`` of ``both`` at ``rate`` req/s and measure the machine its steps ran on
    (in process: its ``core.step_log``, :func:`machine_speed_of`; ``laser serve``'s client target,
    one with a ``server``: the server's step log and ``/metrics``, per class in ``classes``)."""
    target = both.targets[label]
    server = getattr(target, "server", None)
    if server is None:
        core = target.engine.core
        core.step_log, before = [], (core.step_stats.steps, core.step_stats.schedule_s)
        p = both.probe(label, rate, early_stop=False)
        return MeasuredRun(p, machine_speed_of(target.engine, profile, before))
    seen, before = server_ttft(server, classes), server.engine_steps()
    before["cpu"] = _cpu_seconds(server)
    p = both.probe(label, rate, early_stop=False)
    speed, line, stalls = served_speed(server, profile, before, getattr(target, "sent", 0))
    after = server_ttft(server, classes)
    return MeasuredRun(p, speed, seen, after, loaded_frontend(seen, after, p), line, stalls)


def start_speed(a, real, profile, requests, slos, rate: float, basis: str, again: bool = False,
                fallback: str = "the profile as is"):
    """The machine as it runs now: the speed and step scatter of a first run of the workload at
    ``rate`` req/s on ``real`` (:func:`measured_probe`: in process, or ``laser serve``'s client
    target, then also the seconds its front end added to a TTFT under that load), printed with that
    run's attainment and ``basis`` (how ``rate`` was chosen, e.g. "0.8x the knee on the profile as
    is"; ``again``: a second such run, below the knee the first one found; ``fallback``: what the
    simulator keeps when the run has no complete step, printed). Returns (the speed, or None
    without a complete step; the front end's seconds, None in process or without first tokens)."""
    from laser.bench.runner import Benchmark

    run = Benchmark({real.label: real}, requests, slos, seed=a.seed, probe_timeout_s=a.probe_timeout)
    m = measured_probe(run, real.label, rate, profile, sorted({r.slo_class for r in requests}))
    where = "in-process" if m.seen is None else "served"
    print(f"the machine now: a {'second' if again else 'first'} {where} run at {rate:.3f} req/s "
          f"({basis}; attainment {m.probe.attainment:.3f}, {m.probe.wall_s:.0f} s): "
          + (f"no complete step: the simulator keeps {fallback}" if m.speed is None else m.speed.describe())
          + ("" if m.frontend_s is None else f"; its front end under that load {1e3 * m.frontend_s:.1f} ms a TTFT"),
          flush=True)
    return m.speed, m.frontend_s


def on_machine(target, speed, profile, seed: int, planner, frontend_s: float | None = None) -> None:
    """Simulate ``target`` on the machine ``speed`` measured (its scatter included, draws seeded by
    ``seed``), planned with ``planner`` (the engine's online calibration, which then measures the
    simulated machine's spread as the engine measures the real one's); a served ``target`` with
    the front end ``frontend_s`` seconds a TTFT as measured under load (None: the idle one)."""
    target.machine_model = speed.model(profile, jitter=True, seed=seed)
    target.planner = planner
    if getattr(target, "served", False):
        target.frontend_override_s = frontend_s


def knee_on_machine(a, sim, real, profile, requests, slos, planner):
    """The simulated knee, and the machine ``sim`` was put on for it (None: the profile as is).
    ``real``: the engine in process, or ``laser serve``'s client target (``sim``: the served
    simulation, which then also takes the front end as the first runs measured it under load).

    ``--sim-machine profile``: the knee of ``sim`` as it is (or ``--knee``). ``measured``: a first
    run on ``real`` (:func:`start_speed`) at ``--speed-fraction`` x the knee on the profile as is
    (or x ``--knee``) measures the machine, ``sim`` is put on it (:func:`on_machine`, planned
    with ``planner``) and the knee is searched there (unless given); when the first run went past
    that knee, a second one at the same fraction of it measures the machine again (the first
    one's stays when the second has no complete step) and the knee is searched once more. A
    first run without a complete step leaves ``sim`` on the profile as is, with its knee."""
    if a.sim_machine != "measured":
        return simulated_knee(a, sim, requests, slos), None
    base = a.knee if a.knee is not None else simulated_knee(a, sim, requests, slos, "on the profile as is")
    if not base:
        return base, None
    rate = base * a.speed_fraction
    basis = f"{a.speed_fraction:g}x the knee {'given' if a.knee is not None else 'on the profile as is'}"
    start, fe = start_speed(a, real, profile, requests, slos, rate, basis)
    if start is None:
        return base, None
    on_machine(sim, start, profile, a.seed, planner, fe)
    if a.knee is not None:
        return a.knee, start
    knee = simulated_knee(a, sim, requests, slos, "on the machine as measured")
    if knee and rate > knee:  # measured past the machine's own knee (another mix of steps than near
        # it: mostly prefill, few decode-only steps): once more, below it
        again, fe = start_speed(a, real, profile, requests, slos, knee * a.speed_fraction,
                                f"{a.speed_fraction:g}x the knee on the machine as measured", again=True,
                                fallback="the first run's machine")
        if again is not None:
            start = again
            on_machine(sim, start, profile, a.seed, planner, fe)
            knee = simulated_knee(a, sim, requests, slos, "on the machine as measured")
    return knee, start


def simulated_knee(a, sim, requests, slos, where: str = "") -> float:
    """``--knee`` when given, else the goodput of the policy on ``sim`` (printed; ``where``: what
    machine ``sim`` is)."""
    from laser.bench.runner import Benchmark, saturation_rate

    if a.knee is not None:
        print(f"knee given: {a.knee:.3f} req/s (no search)")
        return a.knee
    sims = Benchmark({"sim": sim}, requests, slos, seed=a.seed)
    cap = saturation_rate(sim, requests, slos)
    ts = time.perf_counter()
    gp = sims.goodput(0.1 * cap, cap, a.grid, a.bisect, time_cap_s=a.knee_time_cap)["sim"]
    knee = gp.goodput_rps
    print(f"simulated knee{' ' + where if where else ''} (goodput of {a.policy} at 90% attainment): {knee:.3f} "
          f"req/s [SIMULATED] "
          f"({len(gp.probes)} simulated probes, {time.perf_counter() - ts:.0f} s"
          f"{'; stopped by the ' + gp.capped if gp.capped else ''}; pass --knee {knee:.4g} to reuse it)")
    return knee


#: real run -> (its simulated twin on the machine as it ran: a target of ``runs``, the table's label);
#: each twin runs at the speed its own real run's steps measured (the served engine's: its step log)
TWINS = {"inprocess": ("sim@m", "inproc@m"), "serve": ("sim-served@m", "serve@m")}


def served_speed(server, profile, before: dict, sent: int = 0):
    """The speed the served engine's steps ran at since ``before`` (its ``GET /engine/steps``
    counters then: :meth:`laser.bench.serve_proc.Server.engine_steps`), as :func:`machine_speed_of`
    measures the in-process engine's; and a line on where the engine thread's time went meanwhile
    (step wall, its CPU, the wait between: GIL or core; time between steps), ms per step, and one on
    its stalls (:func:`laser.bench.stalls.stall_summary`: steps far over their price, garbage
    collections), with that summary. With ``before["cpu"]`` (the server process's CPU seconds then,
    :meth:`~laser.bench.serve_proc.Server.cpu_seconds`) and ``sent`` requests, the line adds the
    process's CPU per request and its part outside the engine's steps (event loop, tokenizer
    thread, HTTP, the engine thread between steps). (None, "", None) without steps."""
    from laser.bench.stalls import format_stalls, stall_summary
    from laser.latency.machine_speed import fit_machine_speed

    now = server.engine_steps(before["total"])
    st0, st1 = before["step_stats"], now["step_stats"]
    n = st1["steps"] - st0["steps"]
    if n <= 0:
        return None, "", None
    host = (st1["schedule_s"] - st0["schedule_s"]) / n
    speed = fit_machine_speed(profile, now["steps"], None, host)
    t0, t1 = before["engine_thread"], now["engine_thread"]
    k = max(1, t1["steps"] - t0["steps"])
    per = {f: 1e3 * (t1[f] - t0[f]) / k for f in ("step_s", "step_cpu_s", "between_s")}
    line = (f"  serve engine thread, ms per step ({k} steps): step {per['step_s']:.2f} (on a core "
            f"{per['step_cpu_s']:.2f}, waited {per['step_s'] - per['step_cpu_s']:.2f}), between steps "
            f"{per['between_s']:.2f}")
    cpu = _cpu_seconds(server)
    if sent and cpu is not None and before.get("cpu") is not None:
        total, steps = cpu - before["cpu"], t1["step_cpu_s"] - t0["step_cpu_s"]
        line += (f"\n  serve process CPU, ms a request ({sent} sent): {1e3 * total / sent:.1f}, of which outside "
                 f"the engine's steps {1e3 * (total - steps) / sent:.1f}")
    stalls = stall_summary(now.get("timed", ()), before.get("gc"), now.get("gc"))
    return speed, line + "\n" + format_stalls(stalls), stalls


def machine_speed_of(engine, profile, before: tuple[int, float]):
    """The speed the engine's steps ran at since its ``core.step_log`` was set (against
    ``profile``: :func:`laser.latency.machine_speed.fit_machine_speed`), with its scheduling and
    bookkeeping time per step since ``before`` (``core.step_stats``' steps and ``schedule_s`` then);
    the log is then switched off. None without a step."""
    from laser.latency.machine_speed import fit_machine_speed

    steps, engine.core.step_log = engine.core.step_log or (), None
    st = engine.core.step_stats
    host = (st.schedule_s - before[1]) / (st.steps - before[0]) if st.steps > before[0] else 0.0
    return fit_machine_speed(profile, steps, engine.model_config.num_layers, host)


def scatter_draws(both, label: str, rate: float, k: int) -> list[dict] | None:
    """Attainment per class (and ``"all"``) of simulated ``label`` at ``rate`` over ``k`` draws of
    its machine's step scatter (seeds ``seed .. seed + k - 1`` of its
    :class:`~laser.latency.machine_speed.JitteredLatencyModel`; the first is the table's run); None
    for fewer than 2 draws or a machine without scatter."""
    from laser.latency.machine_speed import step_hook

    reseed = step_hook(getattr(both.targets[label], "machine_model", None), "reseed")
    if k < 2 or reseed is None:
        return None
    seed0, out = reseed.__self__.seed, []
    try:
        for i in range(k):
            reseed(seed0 + i)  # (the target's run starts from it)
            p = both.probe(label, rate, early_stop=False)
            out.append({**p.class_attainment(), "all": p.attainment})
    finally:
        reseed(seed0)
    return out


def draws_line(label: str, draws: list[dict], real_label: str, real) -> str:
    """One line: per class the mean (min-max) attainment over the simulated draws, and the real
    run's points from that mean."""
    parts = []
    for c in [*sorted(k for k in draws[0] if k != "all"), "all"]:
        xs = [d.get(c, 0.0) for d in draws]
        mean = sum(xs) / len(xs)
        got = real.attainment if c == "all" else real.class_attainment().get(c)
        pts = "" if got is None else f", {real_label} {100 * (got - mean):+.1f} pts"
        parts.append(f"{c} {mean:.3f} ({min(xs):.3f}-{max(xs):.3f}{pts})")
    return f"  {label} over {len(draws)} draws of its machine's scatter, mean (min-max): " + "; ".join(parts)


def compare_at(both, runs: dict, sim_of: dict, rate: float, f: float, fe, wl_classes,
               profile=None, draws: int = 1) -> tuple[list[str], dict]:
    """Run every simulated and real target of ``both`` at ``rate`` (``f`` x the knee); returns the
    table's lines and the JSON record (with every request of each real run beside its simulated
    twin: :func:`laser.bench.record_pairs.paired_rows`). ``sim_of``: real label -> its simulated
    run's label. With the targets of :data:`TWINS` in ``runs`` and an in-process run: each real
    run is also compared with its twin simulated on the machine as the in-process run measured it
    (``profile`` scaled, planned as the engine plans), on the same arrivals. ``draws``: a simulated
    run on a machine whose steps scatter is also repeated over this many draws of the scatter
    (:func:`scatter_draws`: mean and range per class, beside the real run)."""
    from laser.bench.record_pairs import format_pair_summary, pair_summary, paired_rows

    sims = {lb: both.probe(lb, rate, early_stop=False) for lb in dict.fromkeys(sim_of.values())}
    rps, speeds, sim_of, thread_line, stalls, served = {}, {}, dict(sim_of), "", None, None
    for lb in list(sim_of):
        run = measured_probe(both, lb, rate, profile, wl_classes)
        rps[lb] = run.probe
        if TWINS[lb][0] in runs:
            speeds[lb] = run.speed
            if run.seen is not None:
                thread_line, stalls = run.thread_line, run.stalls
        if run.seen is not None:
            served = run
    compared = {lb: (sims[sim_of[lb]], rp) for lb, rp in rps.items()}
    seen, after = (None, None) if served is None else (served.seen, served.after)
    fe_load = None if served is None else served.frontend_s
    for lb, (twin, label) in TWINS.items():
        if speeds.get(lb) is not None and lb in rps and twin in runs:
            runs[twin].machine_model = speeds[lb].model(profile, jitter=True, seed=both.seed)
            if lb == "serve":  # the served twin: the front end as the run measured it, under load
                runs[twin].frontend_override_s = fe_load
            sims[twin] = both.probe(twin, rate, early_stop=False)
            compared[label], sim_of[label] = (sims[twin], rps[lb]), twin
    walls = ", ".join(f"{lb} run {rp.wall_s:.0f} s" for lb, rp in rps.items())
    lines = [f"rate {rate:.3f} req/s ({f:g}x knee): attainment per class   [sim = SIMULATED (served: "
             f"+{1e3 * (fe or 0.0):.1f} ms front end), {' / '.join(rps)} = measured; {walls}]"]
    for lb, sp in speeds.items():
        if sp is not None:
            fe_twin = (f"; its front end as measured under load, {1e3 * fe_load:.1f} ms a TTFT"
                       if lb == "serve" and fe_load is not None else "")
            lines.append(f"  {TWINS[lb][1]}: {lb} beside its twin simulated at the speed of its own steps: "
                         f"{sp.describe()}{fe_twin}")
    lines += class_table(compared)
    spread = {}
    for lb, (sp, rp) in compared.items():
        d = scatter_draws(both, sim_of[lb], rate, draws) if sim_of[lb] not in spread else spread[sim_of[lb]]
        if d:
            spread[sim_of[lb]] = d
            lines.append(draws_line(sim_of[lb], d, lb, rp))
    if seen is not None:
        lines.append(server_ttft_line(seen, after, rps["serve"]))
        lines.append(client_cpu_line(runs["serve"]))
    if thread_line:
        lines.append(thread_line)
    pairs = {lb: paired_rows(sp.records, rp.records) for lb, (sp, rp) in compared.items()}
    for lb, rows in pairs.items():
        lines += format_pair_summary(pair_summary(rows), sim_of[lb], lb)
    rec = {"fraction": f, "rate_rps": rate,
           **{lb: {"overall": sp.attainment, "per_class": sp.class_attainment()} for lb, sp in sims.items()},
           **{lb: {"overall": rp.attainment, "per_class": rp.class_attainment(), "wall_s": rp.wall_s,
                   "unfinished": rp.unfinished, "sim": sim_of[lb], "requests": pairs[lb]}
              for lb, (_, rp) in compared.items()}}
    if spread:
        rec["sim_draws"] = spread
    if speeds.get("inprocess") is not None:
        rec["machine_speed"] = dataclasses.asdict(speeds["inprocess"])
    if speeds.get("serve") is not None:
        rec["machine_speed_served"] = dataclasses.asdict(speeds["serve"])
    if stalls is not None:
        rec["serve_stalls"] = stalls
    if fe_load is not None:
        rec["frontend_loaded_s"] = fe_load
    if seen is not None:
        cl = runs["serve"]
        rec["client"] = {k: getattr(cl, k, None) for k in ("cpu_s", "sent", "nice")}
    return lines, rec


def main(argv=None) -> int:
    a, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    from laser.bench.cli import build_targets, build_workload, calibrate_slos, parse_policies
    from laser.bench.runner import Benchmark

    t0 = time.perf_counter()
    flags = ["--policy", a.policy, "--num-prompts", str(a.num_prompts), "--length-scale", str(a.length_scale),
             "--mix", a.mix, "--seed", str(a.seed), "--threads", str(a.threads), "--dtype", a.dtype,
             "--slo-base", a.slo_base, *(["--model", a.model] if a.model else []), *extra]
    args = bench_args(flags)
    specs = parse_policies(a.policy)
    targets, tokenizer, max_len, lm, mode = build_targets(args, specs)
    real = targets[specs[0][0]]
    engine = real.engine
    profile = getattr(lm, "inner", lm)  # the fitted profile, not the engine's online calibration of it
    sim = sim_target(args, a.policy, profile, engine)
    requests, _, wl_desc = build_workload(args, tokenizer, max_len)
    real.warmup()
    cal = calibrate_slos(args, {"real": real}, requests, tokenizer)
    slos = cal.slo_classes()
    meta = getattr(profile, "metadata", {}) or {}
    print(f"engine: {getattr(engine, 'model_name', '?')} {a.dtype}, {a.threads} threads, profile of "
          f"{meta.get('created', '?')} ({meta.get('executor', 'eager')} executor, "
          f"{100 * (meta.get('measurement') or {}).get('clean_fraction', float('nan')):.0f}% of its timings clean)")
    print(f"workload: {wl_desc}")
    print(cal.format())
    from laser.instance.model_instance import planning_model

    # Each real run is measured, its knee searched and compared there in one go: a host that drifts
    # then moves less between the measurement and the comparison (in process first, then served)
    wl_classes = sorted({r.slo_class for r in requests})
    out = {"command": "python benchmarks/sim_vs_real.py " + " ".join(sys.argv[1:]), "workload": wl_desc,
           "slo": cal.to_dict(), "knee_given": a.knee is not None, "sim_machine": a.sim_machine,
           "profile": {k: meta.get(k) for k in ("created", "threads", "executor", "hardware")}, "runs": []}

    def compare(runs: dict, label: str, sim_label: str, knee: float, fe_sim) -> None:
        twin = TWINS[label][0]  # the twin on the machine as the run went (clock set per rate), planned as the engine plans
        runs[twin] = sim_target(args, a.policy, profile, engine, served=label == "serve", label=twin)
        runs[twin].planner = planning_model
        both = Benchmark(runs, requests, slos, seed=a.seed, probe_timeout_s=a.probe_timeout)
        lines = []
        for f in a.fraction_list:
            more, rec = compare_at(both, runs, {label: sim_label}, knee * f, f, fe_sim, wl_classes, profile,
                                   a.sim_draws)
            lines += more
            out["runs"].append(rec)
        print("\n".join(lines), flush=True)

    compared = 0
    if "inprocess" in a.reals:
        knee, start = knee_on_machine(a, sim, real, profile, requests, slos, planning_model)
        out.update(knee_rps=knee, start_speed=None if start is None else dataclasses.asdict(start))
        if knee:
            compare({"sim": sim, "inprocess": real}, "inprocess", "sim", knee, None)
            compared += 1
        else:
            print("no simulated rate passed in process: nothing to compare there")
    if "serve" in a.reals:
        with ExitStack() as stack:
            server = serve_target(stack, args, specs[0][1], profile, a)
            fe = frontend_term(server, profile, a.frontend_probes)
            sim_served = sim_target(args, a.policy, profile, engine, served=True, label="sim-served")
            # the served engine on its own machine, with its own knee: it shares the cores with its front
            # end and the client (its steps scatter more than in process, its front end takes longer the
            # more it streams), so it saturates earlier
            knee, start = knee_on_machine(a, sim_served, server, profile, requests, slos, planning_model)
            out.update(knee_served_rps=knee, start_speed_served=None if start is None else dataclasses.asdict(start),
                       frontend_ttft_s=fe, frontend_loaded_start_s=sim_served.frontend_override_s)
            if knee:
                compare({"sim-served": sim_served, "serve": server}, "serve", "sim-served", knee,
                        sim_served.frontend_s())
                compared += 1
            else:
                print("no simulated rate passed on the served machine: nothing to compare there")
    if not compared:
        return 1
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"total wall time {out['wall_s']:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
