"""Benchmark target for any OpenAI-compatible server (``laser bench --base-url``), timed client-side."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time

from laser.bench.client_timing import ChunkTokenTimer, sse_data
from laser.bench.runner import MissCounter, RunOutput, Target, _request_bar, _slo_for, _summary_duration
from laser.bench.workloads import WorkloadRequest
from laser.core.metrics import RequestRecord
from laser.core.request import SLO
from laser.core.slo import SLOClasses

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _niceness(inc: int):
    """Run the body with the calling thread's niceness raised by ``inc`` (Linux ``nice(2)``: per
    thread), then lower it back; lowering needs privilege (``CAP_SYS_NICE``), so without it the
    thread stays at the raised niceness and a warning says so. ``inc`` 0: nothing changes."""
    if not inc:
        yield
        return
    old = os.getpriority(os.PRIO_PROCESS, 0)
    os.nice(inc)
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, old)
        except PermissionError:
            log.warning("the benchmark client stays at niceness %d (lowering it back needs privilege)", old + inc)


@contextlib.contextmanager
def _cpus(cpus: str | None):
    """Run the body with the calling thread on CPU list ``cpus`` (``0-3,6``; threads it starts inherit
    the mask), then restore its mask. None: nothing changes."""
    if not cpus:
        yield
        return
    from laser.core.cpu_bind import parse_cpu_list

    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, parse_cpu_list(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


class ClientTarget(Target):
    """An OpenAI-compatible server at ``base_url``, timed client-side (streaming SSE).

    ``endpoint``: ``/v1/completions`` (prompt text) or ``/v1/chat/completions`` (the prompt
    as one user message). ``model``: the served model name (default: the first of
    ``/v1/models``). ``max_concurrency``: at most this many requests in flight.
    ``return_token_ids``: ask for per-chunk token ids (vLLM's extension; Laser serves it) to
    time every token exactly; servers that ignore it are timed from the usage totals
    (:class:`~laser.bench.client_timing.ChunkTokenTimer`). ``nice``: raise the client's niceness
    by this much while a run sends (Linux: the sending thread only; 0: unchanged) -- on a host the
    client shares with the server, a client at ``nice 10`` approximates one on another machine.
    ``cpus``: a CPU list (``0-3,6``) the sending thread runs on while a run sends (None: unchanged),
    e.g. a served engine's front-end CPUs (``--cpu-bind``) to keep the client off the engine's.
    After each :meth:`run`, ``cpu_s`` is the CPU seconds the client's thread spent on it and
    ``sent`` the requests it sent (the client's own cost per request: ``cpu_s / sent``).
    """

    kind = "client"

    def __init__(self, base_url: str, model: str | None = None, endpoint: str = "/v1/completions",
                 api_key: str | None = None, max_concurrency: int | None = None, label: str | None = None,
                 extra_body: dict | None = None, return_token_ids: bool = True, nice: int = 0,
                 cpus: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.nice, self.cpus = nice, cpus
        self.cpu_s: float | None = None
        self.sent = 0
        self.return_token_ids = return_token_ids
        self.endpoint = endpoint
        self.model = model
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.label = label or "server"
        self.extra_body = dict(extra_body or {})
        self.errors: list[str] = []

    def describe(self) -> dict:
        return {**super().describe(), "base_url": self.base_url, "endpoint": self.endpoint, "model": self.model}

    def _headers(self, slo: SLO) -> dict:
        h = {"x-slo-class": slo.name}
        if slo.ttft is not None:
            h["x-slo-ttft-ms"] = f"{slo.ttft * 1e3:.6g}"
        if slo.tbt is not None:
            h["x-slo-tbt-ms"] = f"{slo.tbt * 1e3:.6g}"
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _body(self, wr: WorkloadRequest, slo: SLO) -> dict:
        body = {"model": self.model, "max_tokens": wr.output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "slo_class": slo.name}
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.endpoint.rstrip("/").endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": wr.prompt}]
        else:
            body["prompt"] = wr.prompt
        body.update(self.extra_body)
        return body

    def resolve_model(self) -> str:
        import httpx

        if self.model is None:
            h = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            url = self.base_url + "/v1/models"
            try:
                r = httpx.get(url, headers=h, timeout=30)
            except httpx.HTTPError as e:
                raise ValueError(f"cannot reach the server at {url}: {type(e).__name__}: {e}") from None
            if r.status_code != 200:
                raise ValueError(f"GET {url} answered HTTP {r.status_code}: {r.text[:300]}")
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def _one(self, client, i: int, wr: WorkloadRequest, slo: SLO, t0: float, rec: RequestRecord, sem, bar):
        await asyncio.sleep(max(0.0, t0 + wr.arrival_time - time.monotonic()))
        async with sem:
            rec.arrival_time = time.monotonic()
            self.sent += 1
            try:
                async with client.stream("POST", self.base_url + self.endpoint, json=self._body(wr, slo),
                                         headers=self._headers(slo)) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")[:300]
                        self.errors.append(f"HTTP {resp.status_code}: {text}")
                        return
                    timer = ChunkTokenTimer()
                    async for data, now in sse_data(resp.aiter_bytes(), time.monotonic):
                        if data == b"[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            self.errors.append(str(obj["error"])[:300])
                            return
                        timer.feed(obj, now)
                        if not rec.token_times and timer.first is not None:
                            rec.token_times.append(timer.first)  # live: the early-stop check reads the TTFT
                    rec.token_times[:] = timer.token_times()
                    rec.finished = timer.finish_reason is not None and bool(rec.token_times)
            except Exception as e:  # noqa: BLE001 - any transport failure is a failed request
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                if bar is not None:
                    bar.update(1)

    async def _run(self, requests, slos, timeout_s, progress, stop_below=None) -> tuple[list[RequestRecord], bool]:
        import httpx

        t0 = time.monotonic() + 0.05
        records = []
        for i, wr in enumerate(requests):
            slo = _slo_for(slos, wr.slo_class)
            records.append(RequestRecord(f"{self.label}-{i}", slo.name, slo.ttft, slo.tbt, t0 + wr.arrival_time, [],
                                         wr.prompt_len, wr.output_len, False))
        sem = asyncio.Semaphore(self.max_concurrency or len(requests) or 1)
        bar = _request_bar(len(requests), self.label, progress)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
                tasks = [asyncio.create_task(self._one(client, i, wr, _slo_for(slos, wr.slo_class), t0, records[i],
                                                       sem, bar))
                         for i, wr in enumerate(requests)]
                misses = MissCounter(len(requests), stop_below)
                end = math.inf if timeout_s is None else time.monotonic() + timeout_s
                pending = set(tasks)
                stopped = False
                # the early-stop check polls every 0.1 s; without one, a single wait (each wait hooks
                # every pending task: polling 120 of them cost the client ~8 ms of CPU a request)
                poll = 0.1 if stop_below is not None else math.inf
                while pending:
                    wait = min(poll, max(0.0, end - time.monotonic()))
                    _, pending = await asyncio.wait(pending, timeout=None if wait == math.inf else wait)
                    if not pending or time.monotonic() >= end:
                        break
                    started = [r for r, w in zip(records, requests) if time.monotonic() >= t0 + w.arrival_time]
                    if misses.decided(started, time.monotonic()):
                        stopped = True
                        break
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
        finally:
            if bar is not None:
                bar.close()
        return records, stopped

    def run(self, requests, slos, timeout_s=None, progress=False, stop_below=None) -> RunOutput:
        """Send ``requests`` at their arrival times; failed requests count as unfinished, and
        their number and first distinct errors (HTTP status and body) are logged as a warning.
        Raises ValueError when the server cannot be reached (see :meth:`resolve_model`)."""
        self.resolve_model()
        requests = list(requests)
        seen = len(self.errors)
        t_start = time.perf_counter()
        self.sent, cpu0 = 0, time.thread_time()
        with _niceness(self.nice), _cpus(self.cpus):
            records, stopped = asyncio.run(self._run(requests, slos, timeout_s, progress, stop_below))
        self.cpu_s = time.thread_time() - cpu0
        failed = self.errors[seen:]
        if failed:
            first = list(dict.fromkeys(failed))[:3]
            log.warning("[%s] %d of %d requests failed (%s%s): %s", self.label, len(failed), len(requests),
                        self.base_url, self.endpoint, " | ".join(first))
        return RunOutput(records, _summary_duration(records), time.perf_counter() - t_start, stopped)

    def warmup(self) -> None:
        """One short request. Raises ValueError with the server's answer when it fails (a wrong
        ``--endpoint`` or ``--served-model-name``, a missing ``--api-key``)."""
        wr = WorkloadRequest("best_effort", "Warm up the server with a short prompt, please.", 12, 4, 0.0)
        seen = len(self.errors)
        self.run([wr], SLOClasses({}), timeout_s=120)
        if len(self.errors) > seen:
            raise ValueError(f"the warm-up request to {self.base_url}{self.endpoint} (model {self.model!r}) failed: "
                             f"{self.errors[seen]}")


