"""The controller's handle on a real instance, wherever it runs: in this process
(:class:`LocalHandle`) or as a Ray actor (:class:`laser.cluster.ray_actors.RayHandle`).

A handle implements the controller's :class:`~laser.instance.Instance` interface by calling
the instance's :class:`~laser.instance.worker.InstanceWorker` methods with a timeout, and
gives the cluster front end asynchronous calls (:meth:`InstanceHandle.submit`) for the step
loop and the KV hand-off. Any failure to answer -- the process died, or a call missed its
timeout (CONTROLLER.md A9, D10) -- raises :class:`InstanceFailure`; the front end then marks
the instance dead. Errors the instance raised itself (bad input) pass through unchanged.
Torch-free; only :mod:`laser.cluster.ray_actors` imports Ray.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from ..instance.interface import Instance
from ..instance.messages import InstanceReport, LatencyIncrement, RequestInfo
from ..core.request import Request


class InstanceFailure(RuntimeError):
    """The instance died or missed a call's timeout (``instance_id``, ``timed_out``)."""

    def __init__(self, instance_id: int, message: str, timed_out: bool = False):
        super().__init__(f"instance {instance_id}: {message}")
        self.instance_id = instance_id
        self.timed_out = timed_out


class Call:
    """An asynchronous call: ``future`` (a :class:`concurrent.futures.Future` of the result);
    ``ref`` (the Ray object reference, None in process) can be passed as an argument of
    another handle's call, so the result moves between instances without the front end."""

    __slots__ = ("future", "ref", "handle", "method", "started")

    def __init__(self, future: concurrent.futures.Future, ref: Any, handle: "InstanceHandle", method: str,
                 started: float):
        self.future, self.ref, self.handle, self.method, self.started = future, ref, handle, method, started


class InstanceHandle(Instance):
    """Base of the handles: the :class:`Instance` interface over :meth:`call`.

    Args:
        describe: the instance's :meth:`InstanceWorker.describe` (id, role, latency model,
            layers, context limit, KV pool size).
        call_timeout_s: timeout of every synchronous call (seconds).
    """

    def __init__(self, describe: dict, call_timeout_s: float):
        self.instance_id = describe["instance_id"]
        self.role = describe["role"]
        self.latency_model = describe["latency_model"]
        self.num_layers = describe["num_layers"]
        self.describe = describe
        self.call_timeout_s = call_timeout_s
        self.alive = True
        self.restarts_left = 0  # times its host may restart it after a death (Ray ``max_restarts``)
        # The front end's fencing token: raised each time the instance is marked dead; steps and
        # adoptions carry it, and the instance refuses those of an older epoch once it is fenced.
        self.epoch = 0
        # ``time.monotonic()`` by which the step in flight must answer (None: no step in flight); a
        # synchronous call never waits past it: an instance that misses it is stalled anyway.
        self.answer_by: float | None = None
        # The step call in flight (None: none), so that a step that has answered -- its result not
        # collected yet because the front end was held by another call -- does not cut a call's
        # timeout: the instance is not stalled.
        self.step_future: concurrent.futures.Future | None = None
        # With no step in flight, an answer is due within this many seconds (None: the call
        # timeout): a decode instance that is idle answers at once, so one silent for its stall
        # deadline is frozen -- whether it froze inside a step or between two.
        self.idle_answer_s: float | None = None

    def timeout_for(self, timeout: float | None = None) -> float:
        """A synchronous call's timeout (s): ``timeout`` (default ``call_timeout_s``), cut to what
        is left until :attr:`answer_by` (or to :attr:`idle_answer_s` with no step in flight) -- a
        call to a frozen instance must not hold the front end past the moment its stall is
        detected."""
        t = self.call_timeout_s if timeout is None else timeout
        if self.answer_by is not None:
            if self.step_future is None or not self.step_future.done():
                t = min(t, max(0.0, self.answer_by - time.monotonic()))
        elif self.idle_answer_s is not None:
            t = min(t, self.idle_answer_s)
        return t

    def call(self, method: str, *args, timeout: float | None = None):
        """``method(*args)`` on the instance; its result. Raises InstanceFailure (dead or no
        answer within ``timeout``, default ``call_timeout_s``) or what the method raised."""
        raise NotImplementedError

    def submit(self, method: str, *args) -> Call:
        """Start ``method(*args)`` (a :class:`Call` argument is replaced by its result)."""
        raise NotImplementedError

    def result(self, call: Call, timeout: float | None = 0.0):
        """The finished ``call``'s result, mapping a lost instance -- or no answer within
        ``timeout`` seconds (``timed_out``) -- to InstanceFailure."""
        try:
            return call.future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            raise InstanceFailure(self.instance_id, f"no answer to {call.method} within {timeout:.3g} s",
                                  timed_out=True) from e

    def kill(self, restart: bool = False) -> None:
        """End the instance's process (tests, chaos drills); ``restart``: let its host start it
        again (when it has restarts left), so it can rejoin. In process: mark it unusable."""
        raise NotImplementedError

    def kv_sink(self):
        """A picklable :class:`~laser.instance.kv_stream.KVSink` into this instance: a prefill
        instance streams a request's layers and hands the request to it directly, and it
        confirms to the prefill instance through the prefill instance's own."""
        raise NotImplementedError

    # -- Instance interface ----------------------------------------------------------------------------
    def add_request(self, req: Request, at: float = 0.0) -> None:
        self.call("add_request", req)

    def abort(self, req_id: str, at: float = 0.0) -> bool:
        return self.call("abort", req_id)

    def report(self) -> InstanceReport:
        return self.call("report")

    def latency_increment(self, info: RequestInfo) -> LatencyIncrement:
        return self.call("latency_increment", info)

    def reserve(self, info: RequestInfo) -> None:
        self.call("reserve", info)

    def release(self, req_id: str) -> None:
        self.call("release", req_id)

    def migration_candidate(self, expected_output: dict[str, float]):
        return self.call("migration_candidate", expected_output)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.instance_id}, {self.role}, {'alive' if self.alive else 'dead'})"


class LocalHandle(InstanceHandle):
    """An :class:`~laser.instance.worker.InstanceWorker` in this process: calls run at once on
    the caller's thread (timeouts cannot apply; a killed one raises InstanceFailure).
    ``restart``: builds a fresh worker (what Ray does for an actor with restarts left), so
    :meth:`kill` ``(restart=True)`` can stand in for a restarted actor in tests."""

    def __init__(self, worker, call_timeout_s: float = 5.0, restart=None):
        super().__init__(worker.describe(), call_timeout_s)
        self.worker = worker
        self._killed = False
        self._restart = restart
        self._restarting = False

    def call(self, method: str, *args, timeout: float | None = None):
        if self._killed:
            if self._restarting:  # as a Ray actor: the call in flight fails, the next reaches the new process
                self._killed = self._restarting = False
                self.worker = self._restart()
            raise InstanceFailure(self.instance_id, "killed")
        return getattr(self.worker, method)(*args)

    def submit(self, method: str, *args) -> Call:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            args = tuple(a.handle.result(a) if isinstance(a, Call) else a for a in args)
            fut.set_result(self.call(method, *args))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
        return Call(fut, None, self, method, time.monotonic())

    def kill(self, restart: bool = False) -> None:
        self._killed = True
        self._restarting = restart and self._restart is not None

    def kv_sink(self) -> "LocalKVSink":
        return LocalKVSink(self)


class LocalKVSink:
    """A :class:`~laser.instance.kv_stream.KVSink` into an in-process instance (its handle's
    worker): a killed one receives nothing, as a dead actor does (the front end's next call to it
    finds it dead)."""

    def __init__(self, handle: LocalHandle):
        self.handle = handle

    def _call(self, method: str, *args) -> None:
        if not self.handle._killed:
            getattr(self.handle.worker, method)(*args)

    def send(self, req_id, key, layer, k, v) -> None:
        self._call("receive_kv_layer", req_id, key, layer, k, v)

    def adopt(self, sent, attempt, epoch, reply) -> None:
        self._call("adopt", sent, attempt, epoch, reply)

    def confirm(self, req_id, attempt=None) -> None:
        self._call("confirm", req_id, attempt)
