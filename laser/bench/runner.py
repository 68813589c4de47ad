"""Benchmark drivers and the goodput search.

Three kinds of target serve a timed list of :class:`~laser.bench.workloads.WorkloadRequest`
and return one :class:`~laser.core.metrics.RequestRecord` per request:

* :class:`EngineTarget` — an in-process :class:`~laser.frontend.engine.Engine` (or a prefill+decode
  :class:`~laser.frontend.disagg.DisaggregatedPair`) driven by :func:`laser.frontend.online.run_online`:
  arrivals are released at layer boundaries, in real time. Several targets share one
  loaded engine: each run installs a fresh scheduler of its policy (nothing else of the
  engine changes) and checks ``check_integrity(expect_empty=True)`` before and after.
* :class:`ClientTarget` — any OpenAI-compatible server at a base URL, measured from the
  client (httpx, streaming SSE): token times counted exactly from per-chunk token ids
  (``return_token_ids``) or the usage totals (:mod:`laser.bench.client_timing`). The request's SLO goes as the ``slo_class`` body field and the ``x-slo-class``
  header; its targets (ms) as ``x-slo-ttft-ms`` / ``x-slo-tbt-ms`` headers, so a Laser
  server schedules for the very targets the client measures against.
* :class:`SimTarget` — the same schedulers on :class:`~laser.sim.SimInstance` with a
  latency model as the clock (virtual time). Simulated results are labelled as such.

:class:`Benchmark` runs every target on the same arrivals, interleaved (for each probed
rate, every target before the next rate), so a noisy machine shifts all of them alike,
and finds each target's goodput with :func:`laser.bench.goodput.search_goodput` (paper §9:
the highest rate at which >= 90 % of requests meet their SLO).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from laser.bench.arrivals import arrival_times
from laser.bench.goodput import DEFAULT_MAX_DOUBLINGS, GoodputResult, search_goodput
from laser.bench.sim_target import SimTarget, run_sim_pair  # noqa: F401 (re-exported)
from laser.bench.target import (MissCounter, RunOutput, Target, _Decided, _request_bar, _slo_for,  # noqa: F401
                                _summary_duration, is_certain_miss, missing_record)
from laser.bench.workloads import WorkloadRequest
from laser.core.metrics import RequestRecord, RunSummary, record_from_request, summarize
from laser.core.request import SLO, SamplingParams
from laser.core.slo import SLOClasses


# --------------------------------------------------------------------------------------- engine


class EngineTarget(Target):
    """One policy on an in-process engine (``engine``) or prefill/decode pair (``pair``).

    ``latency_model`` is what the policy plans with (Laser needs it; baselines ignore it).
    ``cold_prefix_cache``: every run starts with an empty prefix cache (default; False: what
    earlier runs left cached stays, e.g. a system prompt warmed beforehand).
    """

    kind = "engine"

    def __init__(self, policy: str, engine=None, pair=None, latency_model=None, label: str | None = None,
                 config_overrides: dict | None = None, cold_prefix_cache: bool = True):
        if (engine is None) == (pair is None):
            raise ValueError("give exactly one of engine, pair")
        self.policy = policy
        self.overrides = dict(config_overrides or {})
        self.engine, self.pair = engine, pair
        self.lm = latency_model
        self.label = label or policy
        self.runs = 0
        self.cold_prefix_cache = cold_prefix_cache
        self._ids: dict[str, list[int]] = {}

    @property
    def engines(self) -> list:
        return [self.engine] if self.engine is not None else [self.pair.prefill, self.pair.decode]

    @property
    def tokenizer(self):
        return self.engines[0].tokenizer

    def _encode(self, prompt: str) -> list[int]:
        ids = self._ids.get(prompt)
        if ids is None:
            ids = self._ids[prompt] = self.engines[0].encode_prompt(prompt)
        return ids

    def describe(self) -> dict:
        e = self.engines[0]
        return {**super().describe(), "policy": self.policy, "disaggregated": self.pair is not None,
                "model": e.model_name, "dtype": str(e.dtype).removeprefix("torch."),
                "latency_model": type(self.lm).__name__ if self.lm is not None else "policy default",
                "scheduler": {**dataclasses.asdict(e.scheduler_config), "policy": self.policy, **self.overrides}}

    def run(self, requests, slos, timeout_s=None, progress=False, stop_below=None, background=None) -> RunOutput:
        """(See :meth:`Target.run`.) ``background``: a
        :class:`~laser.bench.batchjob.JobDispatcher` whose requests run beside ``requests``
        (single engine only); the run lasts until it has none left (or ``timeout_s``)."""
        from laser.frontend.online import TimedRequest, run_online

        for e in self.engines:
            e.set_policy(self.policy, self.lm, **self.overrides)
            if self.cold_prefix_cache:
                e.kv_cache.block_manager.reset_prefix_cache()
        self.runs += 1
        inner = self.engine if self.engine is not None else self.pair
        if self.pair is not None:
            self.pair.adopted.clear()
        misses = MissCounter(len(requests), stop_below)
        resolve = getattr(inner, "resolve", lambda r: r)
        clock = self.engines[0].clock

        def check():
            if misses.allowed is not None and misses.decided([record_from_request(resolve(r)) for r in target.added], clock()):
                raise _Decided

        if background is not None:
            if self.pair is not None:
                raise ValueError("a background batch job runs on a single engine, not a disaggregated pair")
            background.attach(self._job_adder(), self.engine.scheduler, clock, f"{self.label}-{self.runs}")
        target = _Tap(inner, check, background)
        stream = []
        for i, wr in enumerate(requests):
            sp = SamplingParams(max_tokens=wr.output_len, temperature=0.0, ignore_eos=True)
            stream.append(TimedRequest(wr.arrival_time, self._encode(wr.prompt), sp, _slo_for(slos, wr.slo_class),
                                       req_id=f"{self.label}-{self.runs}-{i}"))
        bar = _request_bar(len(stream), f"{self.label}", progress)

        def on_output(o):
            if o.finished and bar is not None:
                bar.update(1)

        t_start = time.perf_counter()
        t0 = clock()
        stopped = False
        try:
            run_online(target, stream, on_output=on_output, timeout_s=timeout_s)
        except _Decided:
            stopped = True
            for r in target.added:
                if not resolve(r).is_finished:
                    inner.abort(r.req_id)
        finally:
            if bar is not None:
                bar.close()
            if background is not None:
                background.abort_unfinished(inner.abort)
        wall = time.perf_counter() - t_start
        span = clock() - t0
        by_id = {r.req_id: resolve(r) for r in target.added}
        records = []
        for i, (it, wr) in enumerate(zip(stream, requests)):
            r = by_id.get(it.req_id)
            records.append(record_from_request(r) if r is not None else missing_record(i, wr, _slo_for(slos, wr.slo_class), t0))
        for e in self.engines:
            e.check_integrity(expect_empty=True)
        counters = [e.scheduler.report().counters for e in self.engines]
        queries = sum(c["prefix_cache_queries"] for c in counters)
        hits = sum(c["prefix_cache_hits"] for c in counters)
        return RunOutput(records, _summary_duration(records), wall, stopped, target.busy_s, span,
                         hits / queries if queries else None)

    def _job_adder(self):
        def add(req_id: str, wr: WorkloadRequest, slo: SLO, now: float):
            sp = SamplingParams(max_tokens=wr.output_len, temperature=0.0, ignore_eos=True)
            return self.engine.add_request(self._encode(wr.prompt), sp, slo, req_id=req_id, arrival_time=now)
        return add

    def warmup(self) -> None:
        warm = [WorkloadRequest("best_effort", "Warm up the engine with a short prompt, please.", 12, 4, 0.0),
                WorkloadRequest("best_effort", "A second short prompt runs alongside the first one.", 12, 4, 0.0)]
        self.run(warm, SLOClasses({}), timeout_s=120)


class _Tap:
    """What :func:`run_online` drives: the engine (or pair), plus a list of every request
    added, a check after every step (which may raise :class:`_Decided`), the seconds spent in
    steps (``busy_s``), and an optional background job dispatched before every step (the run
    goes on while it has requests left)."""

    def __init__(self, inner, check: Callable[[], None], background=None):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_check", check)
        object.__setattr__(self, "_background", background)
        object.__setattr__(self, "added", [])
        object.__setattr__(self, "busy_s", 0.0)

    def add_request(self, *args, **kwargs):
        req = self._inner.add_request(*args, **kwargs)
        self.added.append(req)
        return req

    def has_unfinished(self) -> bool:
        bg = self._background
        return self._inner.has_unfinished() or (bg is not None and bg.has_work())

    def step(self):
        if self._background is not None:
            self._background.dispatch()
        t = time.perf_counter()
        out = self._inner.step()
        object.__setattr__(self, "busy_s", self.busy_s + time.perf_counter() - t)
        self._check()
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):  # arrival_hook goes to the engine itself
        setattr(self._inner, name, value)


# ------------------------------------------------------------------------------------ benchmark


@dataclass
class RateRun:
    """One run of one target at one request rate: a point the goodput search probes."""

    label: str
    rate: float | None  # req/s; None = the trace's own times
    records: list[RequestRecord] = field(repr=False)
    summary: RunSummary = field(repr=False)
    wall_s: float = 0.0
    # stopped early once it could no longer pass: its attainment is then a lower bound
    early_stopped: bool = False
    prefix_hit_rate: float | None = None  # prefix-cache hit rate of the run (RunOutput)

    @property
    def attainment(self) -> float:
        return self.summary.overall.attainment or 0.0

    def class_attainment(self) -> dict[str, float]:
        return {c: s.attainment or 0.0 for c, s in self.summary.per_class.items()}

    @property
    def unfinished(self) -> int:
        return sum(not r.finished for r in self.records)


def tbt_token_budget(lm, tbt: float, num_layers: int | None = None, decode_batch: int = 8,
                     decode_context: int = 256, multiple: int = 16, limit: int = 8192) -> int:
    """Sarathi-Serve's rule for its token budget: the largest budget (a multiple of
    ``multiple``, at least ``multiple``) whose iteration - a prefill chunk plus
    ``decode_batch`` decode tokens at ``decode_context`` - the latency model ``lm``
    predicts within ``tbt`` seconds (the tightest TBT target)."""
    from laser.core.plan import StepPlan, Work

    n = num_layers or lm.num_layers

    def it(k: int) -> float:
        works = [Work(f"d{i}", decode_context - 1, 1, 0, n, True) for i in range(decode_batch)]
        chunk = k - decode_batch
        if chunk > 0:
            works.append(Work("p", 0, chunk, 0, n, False))
        return lm.predict_iteration(StepPlan(n, works))

    best = multiple
    k = multiple
    while k <= limit and it(k) <= tbt:
        best = k
        k += multiple
    return best


class Benchmark:
    """Runs targets on the same requests and arrivals; keeps every probe.

    Args:
        targets: label -> target. Every rate is run on all of them back to back.
        requests: the workload (prompts, classes, lengths); arrival times are set per rate.
        slos: the SLO classes requests are judged (and, for engines, scheduled) against.
        burstiness: Gamma shape of the inter-arrival gaps (1 = Poisson).
        seed: arrival seed. The same seed at every rate: arrivals at rate r are one base
            pattern divided by r (common random numbers across rates and targets).
        trace_times: replay these arrival times (seconds; a trace) instead of Gamma arrivals;
            a rate then rescales them to that mean rate.
        probe_timeout_s: seconds after the last arrival a probe may run on (drain);
            unfinished requests are misses. None: until done.
        early_stop: stop a probe as soon as it certainly fails (more than (1 - target) · n
            certain misses); pass/fail and goodput are unchanged, but the attainment of
            such a probe is then a lower bound (the aborted requests count as misses).
        on_probe: called with every finished probe (progress output).
    """

    def __init__(self, targets: dict[str, Target], requests: Sequence[WorkloadRequest], slos: SLOClasses,
                 burstiness: float = 1.0, seed: int = 0, attainment_target: float = 0.9,
                 trace_times: Sequence[float] | None = None, probe_timeout_s: float | None = None,
                 progress: bool = False, on_probe: Callable[[RateRun], None] | None = None,
                 early_stop: bool = False):
        if not targets:
            raise ValueError("no targets")
        self.targets = dict(targets)
        self.requests = list(requests)
        self.slos = slos
        self.burstiness, self.seed = burstiness, seed
        self.attainment_target = attainment_target
        self.trace_times = None if trace_times is None else np.asarray(trace_times, dtype=np.float64)
        self.probe_timeout_s = probe_timeout_s
        self.progress = progress
        self.on_probe = on_probe
        self.early_stop = early_stop
        self.probes: list[RateRun] = []
        self._base: np.ndarray | None = None

    # -- arrivals ------------------------------------------------------------------------------
    def times_at(self, rate: float | None) -> np.ndarray:
        """Arrival times (s) of the requests at ``rate`` req/s (None: trace times)."""
        n = len(self.requests)
        if self.trace_times is not None:
            t = self.trace_times - (self.trace_times[0] if n else 0.0)
            if rate is None or n < 2 or t[-1] <= 0:
                return t
            return t * ((n - 1) / t[-1] / rate)
        if rate is None:
            raise ValueError("a rate is needed without a trace")
        if math.isinf(rate):
            return np.zeros(n)
        if self._base is None:
            self._base = arrival_times(n, 1.0, self.burstiness, self.seed)
        return self._base / rate

    def workload_at(self, rate: float | None) -> list[WorkloadRequest]:
        return [dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(self.requests, self.times_at(rate))]

    # -- probes --------------------------------------------------------------------------------
    def probe(self, label: str, rate: float | None, early_stop: bool | None = None) -> RateRun:
        """Run ``label`` at ``rate``; ``early_stop`` overrides the benchmark's setting."""
        wl = self.workload_at(rate)
        timeout = None
        if self.probe_timeout_s is not None:
            timeout = max((w.arrival_time for w in wl), default=0.0) + self.probe_timeout_s
        stop = self.attainment_target if (self.early_stop if early_stop is None else early_stop) else None
        out = self.targets[label].run(wl, self.slos, timeout_s=timeout, progress=self.progress, stop_below=stop)
        p = RateRun(label, rate, out.records, summarize(out.records, out.duration), out.wall_s, out.early_stopped,
                    out.prefix_hit_rate)
        self.probes.append(p)
        if self.on_probe is not None:
            self.on_probe(p)
        return p

    def run_at(self, rate: float | None, labels: Sequence[str] | None = None, rotate: int = 0) -> dict[str, RateRun]:
        """Every target (or ``labels``) at ``rate``, back to back; ``rotate`` shifts who goes first."""
        labels = list(labels if labels is not None else self.targets)
        if labels:
            k = rotate % len(labels)
            labels = labels[k:] + labels[:k]
        return {lb: self.probe(lb, rate) for lb in labels}

    # -- goodput -------------------------------------------------------------------------------
    def goodput(self, lo: float, hi: float, grid_points: int = 4, bisect_steps: int = 2, rel_tol: float = 0.02,
                full_grid: bool = False, max_doublings: int = DEFAULT_MAX_DOUBLINGS,
                time_cap_s: float | None = None) -> dict[str, GoodputResult]:
        """Goodput of every target, starting from the rate grid ``[lo, hi]`` req/s: grid,
        then doubling (halving) until every target has failed (passed) a probe, then
        bisection; see :func:`laser.bench.goodput.search_goodput` (the one search)."""
        return search_goodput(self.probe, list(self.targets), lo, hi, attainment_target=self.attainment_target,
                              grid_points=grid_points, bisect_steps=bisect_steps, rel_tol=rel_tol,
                              full_grid=full_grid, max_doublings=max_doublings, time_cap_s=time_cap_s)


def common_rates(results: dict[str, GoodputResult]) -> list[float]:
    """Rates every target was probed at (ascending)."""
    sets = [{p.rate for p in g.probes} for g in results.values()]
    return sorted(set.intersection(*sets)) if sets else []


def reference_rate(results: dict[str, GoodputResult], ours: str = "laser") -> float | None:
    """The rate at which the comparison table reports TTFT/attainment (every target on the
    same arrivals there): the best baseline's goodput (baselines: every target but
    ``ours``; all targets when ``ours`` is absent) - a rate that baseline passed in full;
    when no baseline passed any rate, the lowest rate every target ran.

    Targets without a full probe at that rate must be run there (see ``laser bench``)."""
    base = [g for lb, g in results.items() if lb != ours] or list(results.values())
    cap = max((g.goodput_rps for g in base), default=0.0)
    if cap > 0:
        return cap
    rates = common_rates(results)
    if rates:
        return rates[0]
    probed = sorted({p.rate for g in results.values() for p in g.probes if p.rate is not None})
    return probed[0] if probed else None


def probe_at(results_or_probes, label: str, rate: float | None) -> RateRun | None:
    """The last probe of ``label`` at ``rate`` (from a results dict or a probe list)."""
    if isinstance(results_or_probes, dict):
        probes = results_or_probes[label].probes
    else:
        probes = [p for p in results_or_probes if p.label == label]
    found = [p for p in probes if p.rate == rate and p.label == label]
    return found[-1] if found else None


def saturation_rate(target: Target, requests: Sequence[WorkloadRequest], slos: SLOClasses) -> float:
    """Finished requests per second when the whole workload arrives at once (an upper
    bound of any goodput); meant for a :class:`SimTarget` (cheap)."""
    wl = [dataclasses.replace(r, arrival_time=0.0) for r in requests]
    out = target.run(wl, slos)
    done = sum(r.finished for r in out.records)
    if not out.duration or not done:
        raise RuntimeError("saturation run finished nothing")
    return done / out.duration
