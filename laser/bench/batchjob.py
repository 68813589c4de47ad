"""A background batch job beside the interactive mix (``laser bench --batch-requests N
--batch-window S``; issue 14 item 5).

The question: does a cold-tier batch job soak up the capacity the interactive (hot and warm)
traffic leaves without hurting its SLOs, and does it finish inside its completion window? Each
target runs the same interactive arrivals twice, back to back: alone, then with an ``N``-request
job submitted at the start with a window of ``S`` seconds. Reported per target: interactive SLO
attainment (overall and per class) both ways, the job's completion time against its window and
the latency model's prediction of its work, and the busy fraction of the machine (seconds spent
in steps / span of the run) both ways.

Job requests are summarisation prompts (:meth:`~laser.bench.workloads.WorkloadSampler.summarization`:
"summarise these documents by tomorrow morning"), drawn from their own seed.

Targets:

* engine and simulator: :class:`JobDispatcher` adds the job's requests itself, by the server's
  rule (:func:`laser.batch.estimate.may_start`: at most ``concurrency`` in flight; none while a
  hot or warm prompt waits for its first token unless the job is urgent), each with the cold
  ``batch`` SLO whose ``deadline`` is the job's start-by time (the EDF key of
  :meth:`laser.scheduler.base.Scheduler.queue_key`). On the simulator this is deterministic;
* a server (``--base-url``): :class:`ClientJob` submits the job through the official ``openai``
  client's Files and Batches API (``files.create`` / ``batches.create`` / ``batches.retrieve`` /
  ``files.content``), so the server's own :class:`~laser.batch.manager.BatchManager` schedules it.
  Polling survives the server going away (e.g. killed and restarted with the same
  ``--data-dir``). The busy fraction is not observable from the client there.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from laser.batch.estimate import (cold_key, is_urgent, job_concurrency, job_seconds, may_start, progress_share,
                                  request_seconds)
from laser.bench.workloads import WorkloadRequest
from laser.core.request import SLO

DEFAULT_CONCURRENCY = 8  # the server's --batch-concurrency default
DEFAULT_MAX_WAITING = 256  # the server's --max-waiting default
GIVE_UP_FACTOR = 2.0  # a job still running at this many windows is abandoned (reported unfinished)


@dataclass
class JobResult:
    """Outcome of one batch job run. Times in seconds from the job's submission."""

    requests: int
    completed: int
    failed: int
    window_s: float
    completion_s: float | None  # when its last request finished; None when not every one did
    predicted_work_s: float | None  # latency model: the job's work with the whole machine
    finish_times_s: list[float] = field(default_factory=list, repr=False)
    status: str | None = None  # the Batch API status (client mode)

    @property
    def met(self) -> bool:
        return self.completion_s is not None and self.completion_s <= self.window_s

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("finish_times_s")
        d["met_window"] = self.met
        return d

    def format(self) -> str:
        pred = f", predicted work {self.predicted_work_s:.1f} s" if self.predicted_work_s is not None else ""
        if self.completion_s is None:
            return (f"job {self.completed}/{self.requests} done ({self.failed} failed), not finished; window "
                    f"{self.window_s:g} s{pred}" + (f"; status {self.status}" if self.status else ""))
        return (f"job {self.completed}/{self.requests} done in {self.completion_s:.1f} s of a {self.window_s:g} s "
                f"window ({'met' if self.met else 'MISSED'}){pred}")


class JobDispatcher:
    """Runs a batch job's requests on an engine or a simulated instance, by the server's rule.

    Torch-free. The caller :meth:`attach`-es it to a scheduler and calls :meth:`dispatch` before
    every step; it starts requests while :func:`laser.batch.estimate.may_start` allows, each under
    the cold SLO ``SLO(name="batch", tier="cold", deadline=start_by)`` where ``start_by`` is the
    job's deadline minus 1.1 x its remaining predicted work (:func:`laser.batch.estimate.start_by`,
    the same key :class:`laser.batch.manager.BatchManager` gives its lines).

    Args:
        requests: the job's requests (their ``arrival_time`` is ignored: all are submitted at once).
        window_s: completion window (seconds from :meth:`attach`).
        latency_model: prices each request (:func:`laser.batch.estimate.request_seconds`).
        concurrency: requests of the job in flight at most.
        max_waiting: the bounded queue of the server; none starts while half of it is full.
        hot_ttft_s: the loosest hot TTFT target (seconds): an urgent job's requests queue behind
            hot prompts already waiting (:func:`laser.batch.estimate.cold_key`).
    Raises ValueError for an empty job or a window <= 0.
    """

    def __init__(self, requests: Sequence[WorkloadRequest], window_s: float, latency_model,
                 concurrency: int = DEFAULT_CONCURRENCY, max_waiting: int = DEFAULT_MAX_WAITING,
                 hot_ttft_s: float = 0.0):
        if not requests:
            raise ValueError("a batch job needs at least one request")
        if not window_s > 0:
            raise ValueError(f"batch window must be > 0 s, got {window_s}")
        self.requests = list(requests)
        self.window_s = float(window_s)
        self.concurrency, self.max_waiting, self.hot_ttft = concurrency, max_waiting, hot_ttft_s
        self.lm = latency_model
        self.cost = [request_seconds(latency_model, wr.prompt_len, wr.output_len, concurrency)
                     for wr in self.requests]
        self.predicted_work_s = job_seconds(latency_model, [(w.prompt_len, w.output_len) for w in self.requests],
                                            concurrency)
        self._add = None

    def attach(self, add: Callable, scheduler, clock: Callable[[], float], label: str) -> None:
        """Start the job now: ``add(req_id, workload_request, slo, now) -> Request`` enqueues one
        request on the instance whose ``scheduler`` and ``clock`` (seconds) are given."""
        self._add, self.scheduler, self.clock, self.label = add, scheduler, clock, label
        self.t0 = clock()
        self.deadline = self.t0 + self.window_s
        self.pending = collections.deque(range(len(self.requests)))
        self.inflight: dict[int, object] = {}
        self.finish: dict[int, float] = {}
        self.failed = 0
        self._remaining = sum(self.cost)
        self._done_work = 0.0
        self.started: dict[int, float] = {}  # request -> start (seconds from t0)
        self._latency: list[float] = []  # start to finish of finished requests (s)
        self.urgent_since: float | None = None  # when the job first became urgent (seconds from t0)

    # -- driving ---------------------------------------------------------------------------------------
    def urgent(self, now: float) -> bool:
        """:func:`laser.batch.estimate.is_urgent` at the share of the machine the job has had."""
        share = progress_share(self._done_work, now - self.t0, self.window_s)
        return is_urgent(now, self.deadline, self._remaining, share)

    def _given_up(self, now: float) -> bool:
        return now > self.t0 + GIVE_UP_FACTOR * self.window_s

    def _collect(self, now: float) -> None:
        for i, r in list(self.inflight.items()):
            if r.is_finished:
                del self.inflight[i]
                self._remaining -= self.cost[i]
                self._done_work += self.cost[i]
                if r.finish_reason == "abort":
                    self.failed += 1
                else:
                    self.finish[i] = (r.finish_time if r.finish_time is not None else now) - self.t0
                    self._latency.append(self.finish[i] - self.started[i])

    def has_work(self) -> bool:
        """Requests left to start or still running (False once the job is abandoned)."""
        now = self.clock()
        self._collect(now)
        return not self._given_up(now) and bool(self.pending or self.inflight)

    def dispatch(self) -> None:
        """Start as many of the job's requests as the cold tier's rule allows now."""
        now = self.clock()
        self._collect(now)
        if not self.pending or self._given_up(now):
            return
        urgent = self.urgent_since is not None or self.urgent(now)  # latched: see BatchManager._urgent
        if urgent and self.urgent_since is None:
            self.urgent_since = now - self.t0
        live = [self.scheduler.get_request(rid) for rid in self.scheduler.request_ids()]
        interactive = any(r.slo.tier in ("hot", "warm") and not r.token_times for r in live)
        queued = sum(1 for r in live if not r.token_times)
        lat = sum(self._latency) / len(self._latency) if self._latency else None
        conc = job_concurrency(self.concurrency, urgent, len(self.pending) + len(self.inflight), lat,
                               self.deadline - now)
        cold_queued = sum(1 for r in self.inflight.values() if not r.token_times)
        while self.pending and may_start(urgent=urgent, interactive_waiting=interactive, queued=queued,
                                         max_waiting=self.max_waiting, inflight=len(self.inflight),
                                         concurrency=conc, cold_queued=cold_queued):
            i = self.pending.popleft()
            self.started[i] = now - self.t0
            slo = SLO(name="batch", tier="cold",
                      deadline=cold_key(now, self.deadline, self._remaining, urgent, self.hot_ttft))
            self.inflight[i] = self._add(f"{self.label}-job-{i}", self.requests[i], slo, now)
            queued += 1
            cold_queued += 1

    def abort_unfinished(self, abort: Callable[[str], object]) -> None:
        """Abort the job's requests still running (the run is over); they count as not done."""
        self._collect(self.clock())
        for i, r in list(self.inflight.items()):
            abort(r.req_id)
        self._collect(self.clock())

    def result(self) -> JobResult:
        done = len(self.finish)
        n = len(self.requests)
        return JobResult(n, done, self.failed + len(self.pending), self.window_s,
                         max(self.finish.values()) if done == n else None, self.predicted_work_s,
                         sorted(self.finish.values()))


def batch_job_requests(tokenizer, n: int, seed: int, length_scale: float = 1.0,
                       max_model_len: int | None = None) -> list[WorkloadRequest]:
    """``n`` summarisation requests (class ``batch``) for the job, from their own seed."""
    from laser.bench.workloads import WorkloadSampler

    if n < 1:
        raise ValueError(f"--batch-requests must be >= 1, got {n}")
    sampler = WorkloadSampler(tokenizer, seed + 1_000_003, length_scale, max_model_len)
    return [dataclasses.replace(sampler.summarization(), slo_class="batch", source=f"batch:{i}") for i in range(n)]


# ------------------------------------------------------------------------------------------ client


class ClientJob:
    """The job through a server's OpenAI Batch API with the official ``openai`` client, on a thread.

    :meth:`start` uploads the JSONL (``files.create``, purpose ``batch``) and creates the batch
    (``batches.create``, ``completion_window`` = ``completion_window`` as given, e.g. ``"10m"``, or by
    default the window in seconds, e.g. ``"600s"``) before
    returning; the thread then polls ``batches.retrieve`` every ``poll_s`` until the batch ends
    (connection errors are retried: the server may be restarting) or ``GIVE_UP_FACTOR`` windows pass;
    :meth:`join` counts the output file's records and returns the :class:`JobResult`.
    """

    def __init__(self, base_url: str, api_key: str | None, model: str, endpoint: str,
                 requests: Sequence[WorkloadRequest], window_s: float, poll_s: float = 1.0,
                 completion_window: str | None = None):
        self.base_url, self.api_key, self.model, self.endpoint = base_url.rstrip("/"), api_key, model, endpoint
        self.requests, self.window_s, self.poll_s = list(requests), float(window_s), poll_s
        self.completion_window = completion_window or f"{self.window_s:g}s"
        self._result: JobResult | None = None
        self._error: BaseException | None = None
        self.batch_id: str | None = None

    def _body(self, wr: WorkloadRequest) -> dict:
        body = {"model": self.model, "max_tokens": wr.output_len, "temperature": 0.0, "ignore_eos": True}
        if self.endpoint.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": wr.prompt}]
        else:
            body["prompt"] = wr.prompt
        return body

    def start(self) -> None:
        import openai

        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "EMPTY", max_retries=5)
        lines = [json.dumps({"custom_id": f"job-{i}", "method": "POST", "url": self.endpoint,
                             "body": self._body(wr)}) for i, wr in enumerate(self.requests)]
        f = self.client.files.create(file=("batch_job.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        self.t0 = time.monotonic()
        b = self.client.batches.create(input_file_id=f.id, endpoint=self.endpoint,
                                       completion_window=self.completion_window)
        self.batch_id = b.id
        laser = (b.model_extra or {}).get("laser") or {}
        self.predicted_work_s = laser.get("predicted_work_s")
        self._thread = threading.Thread(target=self._poll, name="laser-bench-batch", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import openai

        try:
            b, seen_done = None, None
            while time.monotonic() - self.t0 < GIVE_UP_FACTOR * self.window_s:
                try:
                    b = self.client.batches.retrieve(self.batch_id)
                except openai.APIConnectionError:
                    time.sleep(self.poll_s)
                    continue
                if b.status in ("completed", "failed", "expired", "cancelled"):
                    seen_done = time.monotonic() - self.t0
                    break
                time.sleep(self.poll_s)
            self._result = self._summarize(b, seen_done)
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self._error = e

    def _summarize(self, b, seen_done: float | None) -> JobResult:
        n = len(self.requests)
        ok = 0
        if b is not None and b.output_file_id:
            text = self.client.files.content(b.output_file_id).text
            ids = [json.loads(ln)["custom_id"] for ln in text.splitlines() if ln.strip()]
            if len(ids) != len(set(ids)):
                raise RuntimeError(f"batch {self.batch_id}: duplicated custom_ids in the output file")
            ok = len(ids)
        completion = None
        if b is not None and b.status == "completed" and ok == n:
            # the server's own timestamps (whole seconds) when it has them, else when the poll saw it
            completion = float(b.completed_at - b.created_at) if b.completed_at else seen_done
        counts = b.request_counts if b is not None else None
        failed = counts.failed if counts is not None else n - ok
        return JobResult(n, ok, failed, self.window_s, completion, self.predicted_work_s,
                         status=None if b is None else b.status)

    def join(self) -> JobResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


# -------------------------------------------------------------------------------------------- run


def hot_ttft(slos) -> float:
    """The loosest TTFT target of the hot classes of ``slos`` (0 when none)."""
    return max((c.ttft for c in slos.classes.values() if c.tier == "hot" and c.ttft is not None), default=0.0)


def _class_att(summary) -> dict:
    return {c: s.attainment for c, s in sorted(summary.per_class.items())}


def _fmt_run(name: str, summary, busy: float | None) -> str:
    per = ", ".join(f"{c} {a:.1%}" for c, a in _class_att(summary).items() if a is not None)
    b = f"; busy {busy:.0%}" if busy is not None else ""
    return f"  {name:<16} interactive attainment {summary.overall.attainment or 0.0:.1%} ({per}){b}"


def run_pair(target, workload: Sequence[WorkloadRequest], slos, job_requests: Sequence[WorkloadRequest],
             window_s: float, latency_model, timeout_s: float | None, concurrency: int = DEFAULT_CONCURRENCY,
             repeats: int = 1) -> dict:
    """``target`` on ``workload`` alone, then with the job (``repeats`` times, alternating, so a
    noisy machine shifts both alike); returns the json of both runs and the job. Raises
    ValueError for a target that cannot run a job (disaggregated)."""
    from laser.core.metrics import summarize

    runs: dict[str, list] = {"alone": [], "with_job": []}
    jobs = []
    job_timeout = None if timeout_s is None else max(timeout_s, GIVE_UP_FACTOR * window_s + 5.0)
    for _ in range(repeats):
        out = target.run(workload, slos, timeout_s=timeout_s)
        runs["alone"].append((summarize(out.records, out.duration), out.busy_fraction))
        if target.kind == "client":
            job = ClientJob(target.base_url, target.api_key, target.resolve_model(), target.endpoint, job_requests,
                            window_s)
            job.start()
            out = target.run(workload, slos, timeout_s=timeout_s)
            res = job.join()
        else:
            disp = JobDispatcher(job_requests, window_s, latency_model, concurrency, hot_ttft_s=hot_ttft(slos))
            out = target.run(workload, slos, timeout_s=job_timeout, background=disp)
            res = disp.result()
        runs["with_job"].append((summarize(out.records, out.duration), out.busy_fraction))
        jobs.append(res)
    res = {"label": target.label, "kind": target.kind, "simulated": target.simulated, "runs": []}
    for k in range(repeats):
        res["runs"].append({
            "alone": {"attainment": runs["alone"][k][0].overall.attainment,
                      "per_class": _class_att(runs["alone"][k][0]), "busy_fraction": runs["alone"][k][1],
                      "summary": runs["alone"][k][0].to_dict()},
            "with_job": {"attainment": runs["with_job"][k][0].overall.attainment,
                         "per_class": _class_att(runs["with_job"][k][0]), "busy_fraction": runs["with_job"][k][1],
                         "summary": runs["with_job"][k][0].to_dict()},
            "job": jobs[k].to_json()})
        print(f"[{target.label}] run {k + 1}/{repeats}")
        print(_fmt_run("alone", runs["alone"][k][0], runs["alone"][k][1]))
        print(_fmt_run("with batch job", runs["with_job"][k][0], runs["with_job"][k][1]))
        print(f"  {'':<16} {jobs[k].format()}")
    return res


def bench_batch_job(args, bench, lm, tokenizer, max_len, tag: str = "") -> int:
    """``laser bench --batch-requests N --batch-window S``: every target alone and with the job at
    ``--request-rate``; prints the comparison and writes ``--json``."""
    from laser.bench import report

    if args.disaggregated:
        raise ValueError("--batch-requests runs the job on a single (mixed) engine; drop --disaggregated")
    job_reqs = batch_job_requests(tokenizer, args.batch_requests, args.seed, args.length_scale, max_len)
    wl = bench.workload_at(args.request_rate)
    timeout = None
    if bench.probe_timeout_s is not None:
        timeout = max((w.arrival_time for w in wl), default=0.0) + bench.probe_timeout_s
    price = lm if lm is not None else None
    pred = job_seconds(price, [(w.prompt_len, w.output_len) for w in job_reqs], args.batch_concurrency) \
        if price is not None else None
    print(f"batch job: {len(job_reqs)} summarisation requests (mean prompt "
          f"{sum(w.prompt_len for w in job_reqs) / len(job_reqs):.0f} tokens, mean output "
          f"{sum(w.output_len for w in job_reqs) / len(job_reqs):.0f}), window {args.batch_window:g} s, "
          f"concurrency {args.batch_concurrency}"
          + (f"; predicted work with the whole machine {pred:.1f} s" if pred is not None else "") + tag)
    out = {"benchmark": "laser bench (batch job)", "simulated": bench.targets and next(
        iter(bench.targets.values())).simulated, "rate_rps": args.request_rate,
        "interactive_requests": len(wl), "batch_requests": len(job_reqs), "batch_window_s": args.batch_window,
        "batch_concurrency": args.batch_concurrency, "predicted_job_work_s": pred, "targets": {}}
    for label, target in bench.targets.items():
        out["targets"][label] = run_pair(target, wl, bench.slos, job_reqs, args.batch_window,
                                         getattr(target, "lm", None) or lm, timeout, args.batch_concurrency,
                                         args.batch_repeats)
    if args.json:
        report.write_json(report.sanitize(out), args.json)
        print(f"results written to {args.json}")
    return 0
