"""The thread that owns an engine: it builds it and runs all of its torch work (one OpenMP team).

Why: each thread that runs OpenMP parallel regions keeps its own team of worker threads
(libgomp). An engine built (weights packed, kernels measured, latency profile taken) on one
thread and stepped on another leaves two teams, more OpenMP threads than cores on a machine
whose cores are all in use, and libgomp then lets idle workers sleep after ~100 spins instead of
~3 ms (its "throttled" spin count, ``GOMP_SPINCOUNT``), so every parallel region wakes them
through the kernel. Measured on a 2-vCPU AMD EPYC (AVX512-BF16), 2 torch threads, bf16 SmolLM2
at batch 1: 7.8-8.2 ms a step on the thread that built the engine, 31-34 ms on another one;
with 1 thread 9.5-10.5 ms either way (docs/benchmarks.md, issue 26). Used by ``laser serve``
(:class:`~laser.frontend.async_engine.AsyncEngine` steps its engine here) and by every Ray
instance actor (:class:`~laser.instance.worker.InstanceWorker` with ``own_thread``, whose
actor takes calls on several threads).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable


class OwnerThread:
    """A thread that builds the engine, then runs what it is given: jobs, or one loop for good.

    ``build()`` runs on the new thread at once; :meth:`engine` waits for it and returns the engine
    (re-raising what ``build`` raised). Afterwards the thread runs, in submission order, the jobs
    of :meth:`submit` / :meth:`call` (an instance actor's steps and commands) until :meth:`close`,
    or until :meth:`run` hands it a ``target`` that runs until it returns (the
    :class:`~laser.frontend.async_engine.AsyncEngine` loop); the thread then ends. The thread is a
    daemon: one never closed dies with the process (it holds the engine until then).
    """

    def __init__(self, build: Callable[[], Any], name: str = "laser-engine"):
        self._built = threading.Event()
        self._engine: Any = None
        self._error: BaseException | None = None
        # (fn, Future) jobs; (target, None): run target and end; None: end
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, args=(build,), name=name, daemon=True)
        self.thread.start()

    def _main(self, build: Callable[[], Any]) -> None:
        try:
            self._engine = build()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller of engine()
            self._error = e
            return
        finally:
            self._built.set()
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if fut is None:
                fn()
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- the caller gets it
                fut.set_exception(e)

    def engine(self) -> Any:
        """The engine ``build()`` returned (waits for it). Raises what ``build`` raised."""
        self._built.wait()
        if self._error is not None:
            raise self._error
        return self._engine

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on this thread after the jobs before it; its future. Waits for the build
        and raises what ``build`` raised."""
        self.engine()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on this thread (at once when called from it); its result or exception."""
        if threading.get_ident() == self.thread.ident:
            return fn()
        return self.submit(fn).result()

    def run(self, target: Callable[[], None]) -> threading.Thread:
        """Run ``target`` on this thread once the engine is built and the jobs before it are
        done; the thread ends when it returns. Returns the thread."""
        self._jobs.put((target, None))
        return self.thread

    def close(self) -> None:
        """End the thread after the jobs already submitted (it drops its engine)."""
        self._jobs.put(None)
