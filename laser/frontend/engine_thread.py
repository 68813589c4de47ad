"""The engine thread of :class:`~laser.frontend.async_engine.AsyncEngine`: it owns the engine.

Its loop: run the queued commands (adds first, then aborts and anything else) -> ``engine.step()``
-> hand the step's outputs to the event loop with one ``loop.call_soon_threadsafe``; arrivals are
also added at every layer boundary (the engine's arrival hook). With nothing to run it waits on
an event and checks the allocators' integrity once. After every step it publishes the
scheduler report that admission reads. In ``laser serve`` the thread is the
:class:`~laser.core.owner_thread.OwnerThread` that built the engine (one OpenMP team).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from .admission import EngineStepError, EngineStoppedError

log = logging.getLogger("laser.frontend.async_engine")


@dataclass
class EngineThreadTimes:
    """Where the engine thread's time goes while it has work (cumulative; seconds).

    ``step_s``: wall time inside ``engine.step()``; ``step_cpu_s``: the thread's own CPU time
    in it (``time.thread_time``: with one torch thread the step's compute runs on this thread,
    so ``step_s - step_cpu_s`` is time it waited: for the GIL another thread of the process
    held, or for a core); ``between_s``: wall time between two steps of a busy engine (the
    queued commands, the scheduler report, handing the outputs to the event loop);
    ``steps``: steps timed. Written by the engine thread only; read anywhere (racy, harmless).
    """

    steps: int = 0
    step_s: float = 0.0
    step_cpu_s: float = 0.0
    between_s: float = 0.0

    @property
    def step_wait_s(self) -> float:
        """Seconds the engine thread was off a core (GIL, scheduler) inside its steps."""
        return max(0.0, self.step_s - self.step_cpu_s)


class EngineThread:
    """The engine-thread half of :class:`~laser.frontend.async_engine.AsyncEngine`, which owns
    the state these methods use (``engine``, ``_adds``, ``_cmds``, ``_wake``, ``_stop_requested``,
    ``queue_admission``) and starts :meth:`_run` in its thread; only that thread calls them."""

    def _run_queue(self, q: collections.deque) -> None:
        while q:
            fn, fut = q.popleft()
            if q is self._adds:
                self._num_adds_run += 1
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - the caller gets the exception
                fut.set_exception(e)

    def _arrivals(self) -> None:
        """Engine's arrival hook (every layer boundary): add requests that arrived. Costs one
        deque truth test when nothing arrived."""
        if self._adds:
            self._run_queue(self._adds)

    def _run_commands(self) -> None:
        # Adds first: an abort queued after its add must find the request.
        self._run_queue(self._adds)
        self._run_queue(self._cmds)

    def _run(self) -> None:
        eng = self.engine
        if hasattr(eng, "arrival_hook"):
            eng.arrival_hook = self._arrivals
        idle_checked = False
        times = self.times
        last_end = None  # perf_counter when the previous step ended (None: idle since)
        while not self._stop_requested:
            self._wake.clear()  # before reading commands: a later set() is never lost
            self._run_commands()
            if self._stop_requested:
                break
            if not eng.has_unfinished():
                if not idle_checked:
                    self._publish(0.0)
                if self.check_integrity_when_idle and not idle_checked:
                    idle_checked = True
                    try:
                        eng.check_integrity(expect_empty=True)
                    except Exception:  # noqa: BLE001
                        log.exception("integrity check failed while idle")
                last_end = None
                self._wake.wait(self._poll_idle())
                continue
            idle_checked = False
            t0, c0 = time.perf_counter(), time.thread_time()
            if last_end is not None:
                times.between_s += t0 - last_end
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - keep serving everyone we can
                log.exception("engine step failed; aborting the requests in flight")
                self.num_step_errors += 1
                self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
                last_end = None
                continue
            last_end = time.perf_counter()
            times.step_cpu_s += time.thread_time() - c0
            times.step_s += last_end - t0
            times.steps += 1
            self.num_steps += 1
            self._post_failed()
            self._publish(time.perf_counter() - t0)
            if outs:
                self._post(self._on_outputs, outs)
            elif time.perf_counter() - t0 < 1e-4:
                # Nothing was planned (e.g. waiting on memory): do not spin.
                self._wake.wait(0.001)
                last_end = None
        self._abort_everything()

    def _poll_idle(self) -> float:
        """Idle: let the engine look after itself (a cluster front end probes its instances, so
        one that died or restarted meanwhile is noticed and rejoins without a request,
        :meth:`laser.cluster.engine.ClusterEngine.poll_idle`); seconds to sleep until the next look."""
        poll = getattr(self.engine, "poll_idle", None)
        if poll is None:
            return self.idle_wait_s
        try:
            wait = min(self.idle_wait_s, poll())
        except Exception:  # noqa: BLE001 - keep serving; the next step meets the same failure
            log.exception("idle poll failed")
            wait = self.idle_wait_s
        self._post_failed()
        return wait

    def _post_failed(self) -> None:
        """Requests the engine gave up on with an error (a cluster that lost a role for good)
        end with that error, which the client sees (an SSE error event, a 5xx), not a
        truncated stream."""
        take = getattr(self.engine, "take_failed", None)
        for rid, error in take() if take is not None else ():
            self._post(self._on_failed, [rid], error)

    def _publish(self, step_s: float) -> None:
        """Engine thread: publish the scheduler's report (admission, metrics) after a step; a
        cluster front end publishes the report of the prefill instance a request would go to
        (:meth:`laser.cluster.engine.ClusterEngine.admission_report`)."""
        make = getattr(self.engine, "admission_report", None)
        try:
            now = self.engine.clock()
            rep = make(now) if make is not None else self.engine.scheduler.report(now)
        except Exception:  # noqa: BLE001 - observability must never stop serving
            if not getattr(self, "_report_failed", False):
                self._report_failed = True
                log.exception("cannot report the scheduler; admission sees no queue")
            return
        if rep is not None:
            self.queue_admission.publish(rep, self._num_adds_run, step_s)

    def _fail_all(self, error: BaseException) -> None:
        eng = self.engine
        ids = eng.request_ids()
        try:
            for rid in ids:
                eng.abort(rid)
            eng.check_integrity()
        except Exception as e:  # noqa: BLE001
            log.exception("engine state is broken; refusing new requests")
            self.dead = e
        self._post(self._on_failed, ids, error)

    def _abort_requests(self) -> None:
        eng = self.engine
        ids = eng.request_ids()
        try:
            for rid in ids:
                eng.abort(rid)
            eng.check_integrity(expect_empty=True)
        except Exception:  # noqa: BLE001
            log.exception("aborting every request left the engine inconsistent")
        self._post(self._on_aborted, ids)

    def _abort_everything(self) -> None:
        self._run_commands_cancelled()
        self._abort_requests()

    def _run_commands_cancelled(self) -> None:
        if hasattr(self.engine, "arrival_hook"):
            self.engine.arrival_hook = None
        for q in (self._adds, self._cmds):
            while q:
                _, fut = q.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineStoppedError("engine stopped"))
