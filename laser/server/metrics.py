"""Prometheus metrics of the server (prometheus-client), one registry per app.

Names follow vLLM's where they overlap (``vllm:`` -> ``laser:``): time to first token,
inter-token latency and end-to-end latency histograms, running/waiting gauges, KV cache
usage, token and request counters. Laser adds per-SLO-class attainment counters and the
predicted-slack histogram. Every per-request series is labelled ``model_name`` and
``slo_class``.

Observations happen on the event loop when outputs are delivered (never on the engine
thread); the gauges are read from the engine when ``/metrics`` is scraped.

Beside them, the ``vllm:`` names a load-aware gateway reads (the Gateway API inference
extension, llm-d's scheduler): the same series summed over SLO classes, labelled
``model_name`` only, made at scrape time from ours (:class:`_VllmCollector`; one observation each).
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .heap import GC_PAUSES, GENERATIONS

# vLLM's buckets, with finer low ends for CPU-sized latencies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
SLACK_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.0, 5.0, 10.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's collectors in their own :class:`CollectorRegistry` (several apps per process)."""

    def __init__(self, model_name: str, async_engine=None, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.async_engine = async_engine
        self.registry = r = registry or CollectorRegistry()
        cls = ["model_name", "slo_class"]
        self.ttft = Histogram("laser:time_to_first_token_seconds", "Time to first token (from HTTP arrival).",
                              cls, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("laser:inter_token_latency_seconds", "Time between consecutive output tokens.",
                             cls, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("laser:e2e_request_latency_seconds", "Arrival to last token of finished requests.",
                             cls, buckets=E2E_BUCKETS, registry=r)
        self.frontend = Histogram("laser:request_frontend_seconds",
                                  "HTTP arrival (the app first sees the request) to the engine taking the request: "
                                  "the body's parsing and validation, tokenization, admission, the hop to the engine "
                                  "thread (its next layer boundary).", cls, buckets=TTFT_BUCKETS, registry=r)
        self.handler_wait = Histogram("laser:request_handler_wait_seconds",
                                      "HTTP arrival (the app first sees the request) to its handler running: the "
                                      "body read, parsed and validated while the event loop serves other work "
                                      "(part of laser:request_frontend_seconds).", cls, buckets=ITL_BUCKETS, registry=r)
        self.delivery = Histogram("laser:first_token_delivery_seconds",
                                  "The end of the engine step that made a request's first token to the event loop "
                                  "handing it to the request's stream (the engine thread's output work, the hop "
                                  "between threads: GIL hand-over).", cls, buckets=ITL_BUCKETS, registry=r)
        self.slack = Histogram("laser:predicted_slack_seconds",
                               "TTFT target minus the latency model's predicted TTFT at arrival.",
                               cls, buckets=SLACK_BUCKETS, registry=r)
        self.running = Gauge("laser:num_requests_running", "Requests holding KV (prefilling or decoding).",
                             cls, registry=r)
        self.waiting = Gauge("laser:num_requests_waiting", "Requests queued in the scheduler.", cls, registry=r)
        self.kv_usage = Gauge("laser:kv_cache_usage_perc", "KV cache usage (1 = 100%).", ["model_name"], registry=r)
        self.queued = Gauge("laser:num_requests_admitted_waiting",
                            "Accepted requests without a first token (bounded by --max-waiting).",
                            ["model_name"], registry=r)
        self.prompt_tokens = Counter("laser:prompt_tokens", "Prefilled prompt tokens.", cls, registry=r)
        self.generation_tokens = Counter("laser:generation_tokens", "Generated tokens.", cls, registry=r)
        self.success = Counter("laser:request_success", "Finished requests by finish reason.",
                               cls + ["finished_reason"], registry=r)
        self.attained = Counter("laser:slo_attained", "Finished requests that met TTFT and P99 TBT targets.",
                                cls, registry=r)
        self.missed = Counter("laser:slo_missed", "Finished requests that missed their SLO.", cls, registry=r)
        self.ttft_missed = Counter("laser:slo_ttft_missed", "Finished requests that missed the TTFT target.",
                                   cls, registry=r)
        self.tbt_missed = Counter("laser:slo_tbt_missed", "Finished requests whose P99 TBT missed the target.",
                                  cls, registry=r)
        self.miss_cause = Counter(
            "laser:slo_missed_cause", "Finished requests that missed their SLO, by what the server knows of why "
            "(one count per cause that applies): given_up (overload triage served its prefill behind the savable "
            "ones), preempted (KV freed and recomputed), demoted (served in another class than it asked for), "
            "predicted_infeasible (admission predicted its TTFT over the target), tbt_infeasible (its TBT target "
            "is out of reach even alone), failed_over (a cluster instance holding it failed and it moved), "
            "unexplained (none of those).", cls + ["cause"], registry=r)
        self.aborted = Counter("laser:request_aborted", "Requests aborted (client gone, shutdown, engine error).",
                               cls, registry=r)
        self.demoted = Counter("laser:request_demoted", "Demotions by requested class: demotable hot requests "
                               "served as warm under predicted pressure, and infeasible TTFT targets served "
                               "as a looser class or best_effort (--on-infeasible demote).", cls, registry=r)
        self.rejected = Counter("laser:request_rejected", "Requests refused before reaching the engine.",
                                ["model_name", "reason"], registry=r)
        self.engine_errors = Gauge("laser:engine_step_errors", "Engine steps that raised (since start).",
                                   ["model_name"], registry=r)
        self.admissions = Counter("laser:admission_decisions", "Admission control decisions by outcome, per "
                                  "requested class (admitted, demoted, rejected_infeasible, rejected_queue_full, "
                                  "rejected_unavailable).", cls + ["outcome"], registry=r)
        r.register(_SchedulerCollector(self))
        r.register(_ClusterCollector(self))
        r.register(_VllmCollector(self))
        r.register(_EngineThreadCollector(self))
        GC_PAUSES.install()  # the process's garbage collections, timed (once a process)
        self._classes_seen: set[str] = set()

    # -- observations (event loop) ------------------------------------------------------------------------
    def reject(self, reason: str, slo_class: str | None = None) -> None:
        """A request refused before the engine; with ``slo_class``, an admission decision too."""
        self.rejected.labels(self.model_name, reason).inc()
        if slo_class is not None:
            self.admissions.labels(self.model_name, slo_class, f"rejected_{reason.removeprefix('slo_')}").inc()

    def admitted(self, admission) -> None:
        """A request passed admission control."""
        outcome = "demoted" if admission.demoted else "admitted"
        self.admissions.labels(self.model_name, admission.requested.name, outcome).inc()
        if admission.demoted:
            self.demoted.labels(self.model_name, admission.requested.name).inc()
        slack = admission.slack
        if slack is not None and math.isfinite(slack):
            self.slack.labels(self.model_name, admission.requested.name).observe(slack)

    def on_output(self, stream, out) -> None:
        """Listener of :class:`~laser.frontend.async_engine.AsyncEngine`: one call per delivered output."""
        req = out  # the output's own copies (the live Request belongs to the engine thread)
        cls = out.slo.name
        self._classes_seen.add(cls)
        m, n = self.model_name, len(out.token_ids)
        if out.new_token_ids:
            self.generation_tokens.labels(m, cls).inc(len(out.new_token_ids))
            times = req.token_times
            if n == 1 and times:
                self.ttft.labels(m, cls).observe(times[0] - req.arrival_time)
                self.prompt_tokens.labels(m, cls).inc(len(out.prompt_token_ids))
                added = getattr(stream, "added_time", None)
                if added is not None:
                    self.frontend.labels(m, cls).observe(max(0.0, added - req.arrival_time))
                eng = getattr(self.async_engine, "engine", None)
                if eng is not None:  # on the event loop now: the hop from the engine thread
                    self.delivery.labels(m, cls).observe(max(0.0, eng.clock() - times[0]))
            elif n >= 2 and len(times) >= n:
                self.itl.labels(m, cls).observe(times[n - 1] - times[n - 2])
        if not out.finished:
            return
        if out.finish_reason in ("stop", "length"):
            self.success.labels(m, cls, out.finish_reason).inc()
            if req.token_times:
                self.e2e.labels(m, cls).observe(req.token_times[-1] - req.arrival_time)
                ttft_ok, tbt_ok = out.slo_outcome()
                if ttft_ok and tbt_ok:
                    self.attained.labels(m, cls).inc()
                else:
                    self.missed.labels(m, cls).inc()
                    for cause in miss_causes(out.miss_causes, getattr(stream, "admission", None)):
                        self.miss_cause.labels(m, cls, cause).inc()
                    if not ttft_ok:
                        self.ttft_missed.labels(m, cls).inc()
                    if not tbt_ok:
                        self.tbt_missed.labels(m, cls).inc()
        else:
            self.aborted.labels(m, cls).inc()

    def aborted_request(self, slo_class: str) -> None:
        """A request ended without a final output (client disconnected, engine error)."""
        self.aborted.labels(self.model_name, slo_class).inc()

    # -- scrape -------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the engine's gauges (racy reads, never blocks the engine thread)."""
        ae = self.async_engine
        if ae is None:
            return
        running, waiting = ae.class_counts()
        classes = set(ae.slo_classes.names()) | self._classes_seen | set(running) | set(waiting)
        for c in classes:
            self.running.labels(self.model_name, c).set(running.get(c, 0))
            self.waiting.labels(self.model_name, c).set(waiting.get(c, 0))
        self.kv_usage.labels(self.model_name).set(ae.kv_cache_usage())
        self.queued.labels(self.model_name).set(ae.num_queued)
        self.engine_errors.labels(self.model_name).set(ae.num_step_errors)

    def render(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)


def miss_causes(engine_causes: tuple[str, ...], a) -> tuple[str, ...]:
    """Why a finished request that missed its SLO may have: the engine's causes
    (:attr:`laser.core.request.Request.miss_causes`, copied into its output) plus those of its
    admission ``a`` (:class:`laser.frontend.admission.Admission`, None when it had none:
    ``demoted``, ``predicted_infeasible``: the TTFT predicted at admission was over the target it
    asked for); ``("unexplained",)`` when none applies."""
    causes = list(engine_causes)
    if a is not None:
        if a.demoted and "demoted" not in causes:
            causes.append("demoted")
        if a.predicted_ttft is not None and a.requested.ttft is not None and a.predicted_ttft > a.requested.ttft:
            causes.append("predicted_infeasible")
    return tuple(causes) or ("unexplained",)


class _ClusterCollector:
    """A cluster front end's counters (:class:`laser.cluster.engine.ClusterStats`) and each
    instance's liveness, read when scraped (plain counters; racy reads are harmless)."""

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        ae = self.metrics.async_engine
        eng = getattr(ae, "engine", None)
        st = getattr(eng, "stats", None)
        if not hasattr(eng, "handles") or st is None:
            return
        m = self.metrics.model_name
        up = GaugeMetricFamily("laser:instance_alive", "1 while the controller counts the instance alive.",
                               labels=["model_name", "instance", "role"])
        for i, h in sorted(eng.handles.items()):
            up.add_metric([m, str(i), h.role], 1.0 if h.alive else 0.0)
        yield up
        yield from self._instance_gauges(eng, m)
        for name, doc, value in (
            ("kv_transfers", "Prefill -> decode KV hand-offs completed.", st.transfers),
            ("kv_transfer_bytes", "KV bytes handed off (all layers).", st.transfer_bytes),
            ("kv_transfer_seconds", "Seconds from send to written on the decode instance, summed.",
             sum(st.transfer_seconds)),
            ("kv_transfer_resends", "Hand-offs re-sent after their decode instance failed.", st.resends),
            ("kv_transfers_streamed", "Hand-offs whose KV was streamed layer by layer during prefill.",
             st.streamed_transfers),
            ("kv_handoff_seconds", "Seconds from prefill end (first token) to the request adopted by its "
             "decode instance, summed.", sum(st.handoff_seconds)),
            ("instance_failures", "Instances marked dead (died or missed a timeout).", st.instance_failures),
            ("recoveries", "Requests re-prefilled elsewhere after their instance failed.", st.recoveries),
            ("recoveries_seed_kept", "Re-prefills of seeded sampled requests; each continued its seeded stream "
             "(draws are a function of seed and position).", st.seeded_recoveries),
            ("migrations", "Decode -> decode moves of a running request (KV memory or T_g broke).", st.migrations),
            ("instance_rejoins", "Dead instances that came back (restarted) and rejoined, empty.", st.rejoins),
            ("node_restarts", "Times the lost local Ray node was started again with its instances.",
             st.node_restarts),
            ("recovery_seconds", "Seconds from an instance failure to the next token of each recovered "
             "request, summed.", sum(st.recovery_seconds)),
            ("controller_decisions", "Requests routed by the global controller.", st.routes),
            ("controller_decision_seconds", "Seconds spent routing, summed.", st.route_seconds),
        ):
            c = CounterMetricFamily(f"laser:{name}", doc, labels=["model_name"])
            c.add_metric([m], value)
            yield c


    @staticmethod
    def _instance_gauges(eng, m: str):
        """Per-instance state from each instance's report after its last step (§7.1), and its prefix
        cache counters (the cluster's ``vllm:prefix_cache_*``: one series per instance)."""
        labels = ["model_name", "instance", "role"]
        fams = {
            "queue": GaugeMetricFamily("laser:instance_queue_length", "Requests with prefill work left.", labels=labels),
            "decoding": GaugeMetricFamily("laser:instance_num_decoding", "Requests decoding.", labels=labels),
            "kv": GaugeMetricFamily("laser:instance_kv_cache_usage_perc", "KV blocks in use (1 = 100%).",
                                    labels=labels),
            "iter": GaugeMetricFamily("laser:instance_iteration_seconds", "Last measured decode iteration.",
                                      labels=labels),
            "t_g": GaugeMetricFamily("laser:instance_t_g_seconds", "Tightest TBT target of its decode "
                                     "requests (T_g; +Inf: none).", labels=labels),
            "pcq": CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries per instance: prompt "
                                       "tokens looked up at first admission (tokens; vLLM's name).", labels=labels),
            "pch": CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits per instance: prompt tokens "
                                       "found cached at first admission (tokens; vLLM's name).", labels=labels),
        }
        for i, rep in sorted(eng.last_reports.items()):
            if rep is None:
                continue
            lv = [m, str(i), rep.role]
            fams["queue"].add_metric(lv, len(rep.queue))
            fams["decoding"].add_metric(lv, rep.num_decoding)
            fams["kv"].add_metric(lv, rep.used_blocks / rep.total_blocks if rep.total_blocks else 0.0)
            if rep.iteration_s is not None:
                fams["iter"].add_metric(lv, rep.iteration_s)
            fams["t_g"].add_metric(lv, rep.t_g)
            fams["pcq"].add_metric(lv, rep.prefix_cache_queries)
            fams["pch"].add_metric(lv, rep.prefix_cache_hits)
        yield from fams.values()


class _SchedulerCollector:
    """Scheduler counters from the report the engine thread publishes after each step
    (:meth:`laser.frontend.async_engine.AsyncEngine.counters`): never reads live engine state."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        ae = self.metrics.async_engine
        c = ae.counters() if ae is not None else {}
        m = self.metrics.model_name
        pre = CounterMetricFamily("laser:preemptions", "Preempted requests by cause (kv, slo, running_cap, ...), "
                                  "per class of the victim.", labels=["model_name", "cause", "slo_class"])
        for (cause, cls), n in sorted(c.get("preemptions", {}).items()):
            pre.add_metric([m, cause, cls], n)
        yield pre
        total = CounterMetricFamily("vllm:num_preemptions", "Preempted requests, every cause and class (vLLM's "
                                    "name; laser:preemptions splits them).", labels=["model_name"])
        total.add_metric([m], sum(c.get("preemptions", {}).values()))
        yield total
        rec = CounterMetricFamily("laser:recomputes", "Work thrown away to be recomputed, by kind (preemption: "
                                  "KV freed; icache_eviction: a paused chunk's hidden state dropped), per class.",
                                  labels=["model_name", "kind", "slo_class"])
        tok = CounterMetricFamily("laser:recomputed_tokens", "Tokens to recompute, by kind, per class.",
                                  labels=["model_name", "kind", "slo_class"])
        for (kind, cls), n in sorted(c.get("recomputes", {}).items()):
            rec.add_metric([m, kind, cls], n)
            tok.add_metric([m, kind, cls], c.get("recomputed_tokens", {}).get((kind, cls), 0))
        yield rec
        yield tok
        singles = [
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix cache queries: prompt tokens looked up "
             "at requests' first admission (tokens; vLLM's name).", c.get("prefix_cache_queries")),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix cache hits: prompt tokens found cached at "
             "requests' first admission (tokens; vLLM's name).", c.get("prefix_cache_hits")),
            (CounterMetricFamily, "laser:prefix_cache_refound_tokens", "Tokens preempted requests found again "
             "of their own in the prefix cache when readmitted (not hits).", c.get("prefix_cache_refound")),
            (CounterMetricFamily, "laser:prefix_cache_evictions", "Cached KV blocks evicted for reuse "
             "(least recently released first).", c.get("prefix_cache_evictions")),
            (CounterMetricFamily, "laser:intermediate_cache_evictions", "Paused chunks evicted from the "
             "intermediate cache (recomputed from layer 0 later).", c.get("icache_evictions", 0)),
            (CounterMetricFamily, "laser:layer_stops", "Steps stopped at a layer boundary for a more urgent "
             "arrival (Laser §6.1).", c.get("layer_stops", 0)),
            (GaugeMetricFamily, "laser:intermediate_cache_tokens", "Tokens of paused hidden states held.",
             c.get("icache_tokens", 0)),
            (GaugeMetricFamily, "laser:intermediate_cache_capacity_tokens", "Intermediate cache capacity.",
             c.get("icache_capacity", 0)),
            (GaugeMetricFamily, "laser:latency_model_calibration", "Factor the latency profile's predictions "
             "of layer calls with a prefill chunk are scaled by: measured / predicted time as the machine runs now "
             "(1 = the profile holds; --no-latency-calibration keeps it at 1).", c.get("latency_calibration")),
            (GaugeMetricFamily, "laser:latency_model_calibration_decode", "The same factor for decode layer calls "
             "and the per-step terms (memory-bound: the machine moves them apart).",
             c.get("latency_calibration_decode")),
            (GaugeMetricFamily, "laser:latency_model_timing_spread", "How far the slowest steps run over the "
             "calibrated prediction (98th / 80th percentile of measured / predicted step time) that Laser divides "
             "its planning margins by (1 with --no-jitter-margin).", c.get("latency_timing_spread")),
        ]
        for family, name, doc, value in singles:
            if value is None:  # (not reported by this engine)
                continue
            f = family(name, doc, labels=["model_name"])
            f.add_metric([m], value)
            yield f


class _VllmCollector:
    """vLLM's metric names (``vllm:num_requests_waiting``, ``vllm:time_to_first_token_seconds``,
    ...) over our series: each family of ours summed over ``slo_class`` at scrape time, same
    buckets and other labels (``model_name``, ``le``, ``finished_reason``)."""

    # (vLLM name, our collector attribute, type)
    FAMILIES = (
        ("num_requests_running", "running", "gauge"),
        ("num_requests_waiting", "waiting", "gauge"),
        ("kv_cache_usage_perc", "kv_usage", "gauge"),
        ("time_to_first_token_seconds", "ttft", "histogram"),
        ("inter_token_latency_seconds", "itl", "histogram"),
        ("e2e_request_latency_seconds", "e2e", "histogram"),
        ("prompt_tokens", "prompt_tokens", "counter"),
        ("generation_tokens", "generation_tokens", "counter"),
        ("request_success", "success", "counter"),
    )

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        for name, attr, kind in self.FAMILIES:
            ours = getattr(self.metrics, attr)
            summed: dict[tuple, float] = {}
            doc = ""
            for fam in ours.collect():
                doc = fam.documentation
                for smp in fam.samples:
                    suffix = smp.name[len(fam.name):]
                    if suffix == "_created":
                        continue
                    labels = {k: v for k, v in smp.labels.items() if k != "slo_class"}
                    key = (suffix, tuple(labels.items()))
                    summed[key] = summed.get(key, 0.0) + smp.value
            out = Metric(f"vllm:{name}", doc, kind)
            for (suffix, labels), v in summed.items():
                out.add_sample(f"vllm:{name}{suffix}", dict(labels), v)
            yield out


class _EngineThreadCollector:
    """The engine thread's time split (:class:`laser.frontend.engine_thread.EngineThreadTimes`):
    how long its steps took, how much of that the thread ran on a core (the rest it waited: for
    the GIL the event loop or the tokenizer held, or for a core), and its time between steps."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        t = getattr(self.metrics.async_engine, "times", None)
        m = self.metrics.model_name
        yield from _gc_families(m)  # every server: a cluster front end's process collects too
        if t is None:
            return
        for name, doc, value in (
            ("engine_steps", "Engine steps timed by the engine thread.", t.steps),
            ("engine_step_seconds", "Wall seconds inside the engine's steps, summed.", t.step_s),
            ("engine_step_cpu_seconds", "CPU seconds of the engine thread inside its steps, summed (with one "
             "torch thread the step's compute is on this thread).", t.step_cpu_s),
            ("engine_step_wait_seconds", "Seconds the engine thread waited inside its steps (wall - CPU: for "
             "the GIL another thread of the server held, or for a core), summed.", t.step_wait_s),
            ("engine_between_steps_seconds", "Wall seconds between two steps of a busy engine (commands, the "
             "scheduler report, handing outputs to the event loop), summed.", t.between_s),
        ):
            c = CounterMetricFamily(f"laser:{name}", doc, labels=["model_name"])
            c.add_metric([m], value)
            yield c


def _gc_families(model_name: str):
    """The server process's cyclic garbage collections by generation (:data:`laser.server.heap.
    GC_PAUSES`): how many, and their wall time (each one stops the engine thread and the event loop)."""
    n = CounterMetricFamily("laser:gc_collections", "Python cyclic garbage collections in the server process, "
                            "by generation (2: a full collection).", labels=["model_name", "generation"])
    s = CounterMetricFamily("laser:gc_pause_seconds", "Wall seconds in Python's cyclic garbage collections, by "
                            "generation, summed (the engine thread and the event loop wait meanwhile).",
                            labels=["model_name", "generation"])
    for g in GENERATIONS:
        n.add_metric([model_name, str(g)], GC_PAUSES.counts[g])
        s.add_metric([model_name, str(g)], GC_PAUSES.seconds[g])
    yield n
    yield s
