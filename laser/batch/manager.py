"""Runs OpenAI Batch API jobs in the cold tier, durably (issue 14).

A job's lines go through the server's own ``/v1/chat/completions`` or ``/v1/completions``
handler in-process (``httpx.ASGITransport``): the same validation, admission and response
bodies as an HTTP client gets, so an output line's ``response.body`` is exactly what the
endpoint would have answered and a bad body gets the same 4xx in the error file.

Scheduling (kept out of the torch-free schedulers except for one queue key):

* each line runs under the ``batch`` (cold) class with ``slo.deadline`` = its job's start-by
  time, ``deadline - 1.1 x predicted remaining work`` (:mod:`laser.batch.estimate`): the EDF key
  :meth:`laser.scheduler.base.Scheduler.queue_key` orders it by. Far from the deadline it sorts
  behind hot, warm and best-effort work; as the slack runs out it overtakes them;
* the runner keeps at most ``concurrency`` lines in flight, starts none while the engine's
  waiting queue is half full, and starts none while hot or warm prompts wait for a first token
  unless the job is urgent (its remaining work at the share of the machine it has been getting
  would miss its deadline; :func:`laser.batch.estimate.is_urgent`) -- cold work fills the
  capacity that hot and warm targets leave. An urgent job's lines get the key
  :func:`laser.batch.estimate.cold_key` (ahead of warm and best-effort work).

Durability: :class:`laser.store.BatchStore`; after a restart the jobs that were in progress
resume with their unfinished lines (a line in flight at the crash runs again; its result was
never committed).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx
from prometheus_client import Counter, Gauge

from ..core.request import SLO
from ..store import BatchStore, UnknownCursorError
from .estimate import (cold_key, is_urgent, job_concurrency, job_seconds, may_start, parse_window, progress_share,
                       request_seconds, start_by)
from .jobs import ENDPOINTS, error_record, max_tokens_of, parse_lines, prompt_of

log = logging.getLogger(__name__)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
DONE = ("completed", "failed", "expired", "cancelled")
RETRY_STATUS = (429, 499, 503)  # transient: the line stays pending and runs again
# error-file code and message of a line a job ended without running, by the job's final status
UNRUN = {
    "expired": ("batch_expired", "this request could not be executed before the completion window expired"),
    "cancelled": ("batch_cancelled", "this request was not executed: the batch was cancelled"),
    "failed": ("batch_failed", "this request was not executed: the batch failed"),
    "completed": ("batch_failed", "this request was not executed"),  # not reached: a completed job ran every line
}


class BatchError(Exception):
    """A Batch API request the server refuses (HTTP ``status``, OpenAI error ``code``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


@dataclass
class _Job:
    id: str
    endpoint: str
    deadline: float  # wall clock (time.time()), seconds
    pending: collections.deque = field(default_factory=collections.deque)  # rows not started
    inflight: dict = field(default_factory=dict)  # line -> asyncio.Task
    cost: dict = field(default_factory=dict)  # line -> predicted seconds (pending and in flight)
    started: float = field(default_factory=time.time)  # this process's start on the job
    done_work_s: float = 0.0
    cancelling: bool = False
    urgent: bool = False  # behind its deadline at the share it got: priority until it ends
    latency_s: list = field(default_factory=list)  # start to finish of its finished lines (s)

    @property
    def remaining_work_s(self) -> float:
        return sum(self.cost.values())


class BatchManager:
    """Owns the Batch API state of one app: the store, the jobs in progress and their metrics.

    Args:
        store: where files, jobs and results live.
        async_engine: the engine the lines run on (its latency model prices the work).
        generation: the app's :class:`laser.server.generation.Generation` (one-use cold SLO tokens).
        app: the ASGI app whose endpoints run the lines.
        registry: prometheus registry for the per-job gauges.
        concurrency: lines in flight at most, over all jobs.
        accept_infeasible: accept (with a warning) a job predicted to miss its window.
        api_key: sent to the app when it requires one.
    """

    def __init__(self, store: BatchStore, async_engine, generation, app, registry, model_name: str,
                 concurrency: int = 8, accept_infeasible: bool = False, api_key: str | None = None):
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {concurrency}")
        self.store, self.ae, self.gen = store, async_engine, generation
        self.concurrency = concurrency
        self.accept_infeasible = accept_infeasible
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://laser-batch",
                                        timeout=None)
        self.jobs: dict[str, _Job] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._retry_at = 0.0
        m, lbl = model_name, ["model_name", "batch_id"]
        self.model_name = m
        self.g_requests = Gauge("laser:batch_requests", "Lines of a batch job by state.", lbl + ["state"],
                                registry=registry)
        self.g_finish = Gauge("laser:batch_predicted_finish_timestamp_seconds",
                              "Predicted completion time of a batch job (unix seconds).", lbl, registry=registry)
        self.g_deadline = Gauge("laser:batch_deadline_timestamp_seconds",
                                "Deadline of a batch job: created_at + completion_window (unix seconds).", lbl,
                                registry=registry)
        self.g_met = Gauge("laser:batch_deadline_met", "1 if a finished batch job met its deadline, else 0.", lbl,
                           registry=registry)
        self.c_jobs = Counter("laser:batch_jobs", "Batch jobs ended, by outcome (met_deadline, missed_deadline, "
                              "expired, cancelled).", ["model_name", "outcome"], registry=registry)

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume the jobs a previous process left unfinished, then start dispatching."""
        self._wake = asyncio.Event()
        for obj in self.store.batches_with_status(*ACTIVE):
            if obj["status"] == "in_progress":
                self._load(obj)
            elif obj["status"] == "cancelling":
                self._finalize(obj["id"], "cancelled")
            else:  # validating (rows are inserted with the job: nothing ran) or finalizing
                self._finalize(obj["id"], "completed" if obj["status"] == "finalizing" else "failed")
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Cancel the lines in flight (they stay pending in the store) and the dispatcher; close
        the store (another server may then take its data directory)."""
        tasks = [t for j in self.jobs.values() for t in j.inflight.values()]
        if self._task is not None:
            tasks.append(self._task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()
        self.store.close()

    def _load(self, obj: dict) -> _Job:
        ext = obj.get("laser") or {}
        job = _Job(obj["id"], obj["endpoint"], float(ext.get("deadline", obj["expires_at"])))
        for r in self.store.pending(obj["id"]):
            row = dict(r)
            job.pending.append(row)
            job.cost[row["line"]] = self._cost(row)
        self.jobs[job.id] = job
        self.g_deadline.labels(self.model_name, job.id).set(job.deadline)
        self._update_gauges(job)
        return job

    def _cost(self, row: dict) -> float:
        return request_seconds(self.ae.engine.latency_model, row["prompt_tokens"] or 1, row["max_tokens"] or 1,
                               self.concurrency)

    # -- API --------------------------------------------------------------------------------------------
    def batch_object(self, bid: str) -> dict:
        """The OpenAI ``batch`` object (``request_counts`` from the store). Raises BatchError 404."""
        obj = self.store.batch(bid)
        if obj is None:
            raise BatchError(404, f"no batch with id {bid!r}", "batch_not_found", "batch_id")
        obj["request_counts"] = self.store.counts(bid)
        job = self.jobs.get(bid)
        if job is not None:
            obj.setdefault("laser", {})["predicted_finish_at"] = self.predicted_finish(job)
        return obj

    async def create(self, input_file_id: str, endpoint: str, completion_window, metadata: dict | None = None,
                     accept_infeasible: bool | None = None) -> dict:
        """Validate and start a job; returns its batch object.

        Raises BatchError: 404 unknown file; 400 wrong purpose, unsupported endpoint, bad window, or
        (unless accepted) a window the whole machine cannot meet, with the predicted completion time.
        """
        if endpoint not in ENDPOINTS:
            raise BatchError(400, f"endpoint {endpoint!r} is not supported; supported: {', '.join(ENDPOINTS)}",
                             "unsupported_endpoint", "endpoint")
        try:
            window_s = parse_window(completion_window)
        except ValueError as e:
            raise BatchError(400, str(e), "invalid_completion_window", "completion_window") from None
        f = self.store.file_object(input_file_id) if isinstance(input_file_id, str) else None
        if f is None:
            raise BatchError(404, f"no file with id {input_file_id!r}", "file_not_found", "input_file_id")
        if f["purpose"] != "batch":
            raise BatchError(400, f"file {input_file_id!r} has purpose {f['purpose']!r}; a batch needs a file "
                                  "uploaded with purpose 'batch'", "invalid_file_purpose", "input_file_id")
        if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16
                                         and all(isinstance(v, str) for v in metadata.values())):
            raise BatchError(400, "metadata must be an object of at most 16 string values", "invalid_value", "metadata")
        rows = parse_lines(self.store.file_bytes(input_file_id), endpoint)
        for row in rows:
            if row["state"] != "pending":
                continue
            body = json.loads(row["body"])
            p = prompt_of(body, endpoint)
            try:
                n = len(await self.ae.encode(p)) if p is not None else 1
            except Exception:  # noqa: BLE001 - the endpoint will say what is wrong; estimate by bytes
                n = max(1, len(row["body"]) // 4)
            row["prompt_tokens"] = n
            row["max_tokens"] = max_tokens_of(body, endpoint, n, self.ae.max_model_len)
        now = time.time()
        lm = self.ae.engine.latency_model
        work = job_seconds(lm, [(r["prompt_tokens"], r["max_tokens"]) for r in rows if r["state"] == "pending"],
                           self.concurrency)
        accept = self.accept_infeasible if accept_infeasible is None else accept_infeasible
        warning = None
        if work > window_s:
            msg = (f"the batch cannot finish within completion_window {completion_window!r} ({window_s:.0f} s): "
                   f"the latency model predicts {work:.1f} s of work with the whole machine (completion at "
                   f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(now + work))})")
            if not accept:
                raise BatchError(400, msg + "; use a longer window, or accept_infeasible=true to run it anyway",
                                 "window_infeasible", "completion_window",
                                 headers={"x-laser-predicted-completion-s": f"{work:.3f}"})
            warning = msg
        bid = f"batch_{uuid.uuid4().hex}"
        created = int(now)
        obj = {
            "id": bid, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": completion_window, "status": "in_progress", "output_file_id": None,
            "error_file_id": None, "created_at": created, "in_progress_at": created,
            "expires_at": int(now + window_s), "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None, "metadata": metadata,
            "laser": {"deadline": now + window_s, "window_s": window_s, "predicted_work_s": work,
                      "predicted_finish_at": now + work, "warning": warning},
        }
        self.store.create_batch(obj, rows)
        self._load(obj)
        self._wake.set()
        return self.batch_object(bid)

    def list(self, after: str | None, limit: int) -> dict:
        """OpenAI's batch list, newest first: at most ``limit`` (1-100) batches after the batch
        ``after``. Raises BatchError: 400 a limit out of range or an unknown ``after``."""
        if not 1 <= limit <= 100:
            raise BatchError(400, f"limit must be between 1 and 100, got {limit}", "invalid_value", "limit")
        try:
            objs, more = self.store.list_batches(after, limit)
        except UnknownCursorError as e:
            raise BatchError(400, e.message, "invalid_value", "after") from None
        for o in objs:
            o["request_counts"] = self.store.counts(o["id"])
        return {"object": "list", "data": objs, "first_id": objs[0]["id"] if objs else None,
                "last_id": objs[-1]["id"] if objs else None, "has_more": more}

    def cancel(self, bid: str) -> dict:
        """Cancel a job: lines in flight are aborted, the rest never run; once the aborted lines
        are back, every line not completed is recorded as failed (``batch_cancelled``, in the error
        file) and the job is ``cancelled``. Cancelling a job already ``cancelling`` or
        ``cancelled`` answers the job as it is (a retried cancel is not an error).

        Raises BatchError: 404 unknown batch; 400 a job that ended otherwise (completed, failed,
        expired)."""
        obj = self.batch_object(bid)
        if obj["status"] in ("cancelling", "cancelled"):
            return obj
        if obj["status"] in DONE:
            raise BatchError(400, f"batch {bid!r} is {obj['status']}; only a batch in progress can be cancelled",
                             "batch_not_cancellable", "batch_id")
        self.store.update_batch(bid, status="cancelling", cancelling_at=int(time.time()))
        job = self.jobs.get(bid)
        if job is not None:
            job.cancelling = True
            job.pending.clear()
            for t in job.inflight.values():
                t.cancel()
        self._wake.set()
        return self.batch_object(bid)

    # -- dispatch ---------------------------------------------------------------------------------------
    def predicted_finish(self, job: _Job) -> float:
        """Now plus the remaining work at the rate the job has been getting (whole machine at first)."""
        now = time.time()
        return now + job.remaining_work_s / max(self._share(job, now), 1e-3)

    def _share(self, job: _Job, now: float) -> float:
        return progress_share(job.done_work_s, now - job.started, job.deadline - job.started)

    def _urgent(self, job: _Job, now: float) -> bool:
        """Latched: once behind, a job keeps its priority until it ends (the share it gets with
        priority would otherwise make it look on time again, and it would fall back and forth)."""
        if not job.urgent:
            job.urgent = is_urgent(now, job.deadline, job.remaining_work_s, self._share(job, now))
        return job.urgent

    def _start_by(self, job: _Job) -> float:
        return start_by(job.deadline, job.remaining_work_s)

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                self._dispatch()
            except Exception:  # noqa: BLE001 - a bug here must not stop later jobs
                log.exception("batch dispatch failed")
            try:
                await asyncio.wait_for(self._wake.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    def _dispatch(self) -> None:
        now = time.time()
        inflight = sum(len(j.inflight) for j in self.jobs.values())
        busy = self.ae.queued_interactive_tokens() > 0
        for job in sorted(self.jobs.values(), key=self._start_by):
            if job.cancelling:
                if not job.inflight:
                    self._finalize(job.id, "cancelled")
                continue
            if now >= job.deadline:
                self._expire(job)
                continue
            if not job.pending and not job.inflight:
                self._finalize(job.id, "completed")
                continue
            urgent = self._urgent(job, now)
            cold_started = 0  # started this turn: not yet streams of the engine
            lat = sum(job.latency_s) / len(job.latency_s) if job.latency_s else None
            conc = job_concurrency(self.concurrency, urgent, len(job.pending) + len(job.inflight), lat,
                                   job.deadline - now)
            while job.pending and now >= self._retry_at and may_start(
                    urgent=urgent, interactive_waiting=busy, queued=self.ae.num_queued,
                    max_waiting=self.ae.max_waiting, inflight=inflight, concurrency=conc,
                    cold_queued=self.ae.queued_of_tier("cold") + cold_started):
                row = job.pending.popleft()
                cold_started += 1
                job.inflight[row["line"]] = asyncio.ensure_future(self._run_line(job, row))
                inflight += 1
            self._update_gauges(job)

    async def _run_line(self, job: _Job, row: dict) -> None:
        line = row["line"]
        t_start = time.time()
        base = self.ae.slo_classes.classes.get("batch") or SLO(name="batch", tier="cold")
        now = time.time()
        hot = [c.ttft for c in self.ae.slo_classes.classes.values() if c.tier == "hot" and c.ttft is not None]
        key_wall = cold_key(now, job.deadline, job.remaining_work_s, self._urgent(job, now), max(hot, default=0.0))
        key = self.ae.engine.clock() + (key_wall - now)  # engine clock
        token = uuid.uuid4().hex
        self.gen.batch_slos[token] = dataclasses.replace(base, deadline=key)
        from ..server.fields import BATCH_SLO_HEADER

        try:
            r = await self.client.post(job.endpoint, content=row["body"],
                                       headers={**self.headers, BATCH_SLO_HEADER: token,
                                                "content-type": "application/json"})
        except asyncio.CancelledError:
            job.inflight.pop(line, None)
            if not job.cancelling:
                job.pending.appendleft(row)
            raise
        except Exception as e:  # noqa: BLE001 - one line's failure is its own error record
            log.exception("batch line failed")
            self._record(job, row, "failed", error_record(row["custom_id"], "internal_error", str(e)))
            return
        finally:
            self.gen.batch_slos.pop(token, None)
            self._wake.set()
        if r.status_code in RETRY_STATUS and not job.cancelling:
            job.inflight.pop(line, None)
            job.pending.appendleft(row)
            self._retry_at = time.time() + 0.5
            return
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text, "type": "internal_error", "param": None, "code": None}}
        record = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row["custom_id"],
                  "response": {"status_code": r.status_code, "request_id": r.headers.get("x-request-id"),
                               "body": body}, "error": None}
        job.latency_s.append(time.time() - t_start)
        self._record(job, row, "completed" if r.status_code == 200 else "failed", record)

    def _record(self, job: _Job, row: dict, state: str, record: dict) -> None:
        line = row["line"]
        job.inflight.pop(line, None)
        self.store.finish_request(job.id, line, state, record)
        job.done_work_s += job.cost.pop(line, 0.0)
        self._update_gauges(job)

    def _expire(self, job: _Job) -> None:
        for t in job.inflight.values():
            t.cancel()
        job.cancelling = True  # in-flight lines are not put back
        job.pending.clear()
        self._finalize(job.id, "expired")

    def _finalize(self, bid: str, status: str) -> None:
        """Write the output and error files from the stored results and close the job. A line
        still pending (never run, or aborted in flight) is first recorded as failed with the code
        of how the job ended (``batch_expired``, ``batch_cancelled``, ``batch_failed``), as OpenAI
        lists the unrun requests of an expired batch in its error file: every line is counted
        once, in ``completed`` or ``failed``."""
        now = int(time.time())
        for row in self.store.pending(bid):
            self.store.finish_request(bid, row["line"], "failed", error_record(row["custom_id"], *UNRUN[status]))
        obj = self.store.batch(bid)
        if status in ("completed", "failed"):
            obj = self.store.update_batch(bid, status="finalizing", finalizing_at=now)
        out_id = err_id = None
        done = "\n".join(self.store.records(bid, "completed"))
        if done:
            out_id = self.store.add_file("batch_output", f"{bid}_output.jsonl", (done + "\n").encode())["id"]
        errs = "\n".join(self.store.records(bid, "failed"))
        if errs:
            err_id = self.store.add_file("batch_output", f"{bid}_error.jsonl", (errs + "\n").encode())["id"]
        at = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
              "cancelled": "cancelled_at"}[status]
        obj = self.store.update_batch(bid, status=status, output_file_id=out_id, error_file_id=err_id, **{at: now})
        job = self.jobs.pop(bid, None)
        deadline = (obj.get("laser") or {}).get("deadline", obj["expires_at"])
        if status == "completed":
            met = time.time() <= deadline
            self.c_jobs.labels(self.model_name, "met_deadline" if met else "missed_deadline").inc()
            self.g_met.labels(self.model_name, bid).set(1.0 if met else 0.0)
        else:
            self.c_jobs.labels(self.model_name, status).inc()
            if status == "expired":
                self.g_met.labels(self.model_name, bid).set(0.0)
        if job is not None:
            self._update_gauges(job)

    def _update_gauges(self, job: _Job) -> None:
        counts = self.store.counts(job.id)
        pending = counts["total"] - counts["completed"] - counts["failed"]
        for state, n in (("pending", pending), ("completed", counts["completed"]), ("failed", counts["failed"])):
            self.g_requests.labels(self.model_name, job.id, state).set(n)
        self.g_finish.labels(self.model_name, job.id).set(self.predicted_finish(job) if job.id in self.jobs else
                                                          time.time())
