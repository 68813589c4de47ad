"""The steps of the instances, seen from the cluster front end: which instance has work, the
step in flight on each, how long one may run before its instance counts as stalled, and the
report each instance sent with its last answer (CONTROLLER.md A9, D10).

An instance is stepped while it has work: from when it is given some (:meth:`StepTracker.mark_busy`)
until a step that started after that reports it idle. A prefill step may be a long prompt's
chunk (``step_timeout_s``); a decode step is one iteration, so a decode instance counts as
stalled sooner (``stall_timeout_s``, or ``STALL_FACTOR`` times its slowest recent step).
The role of vLLM v1's engine-core client that keeps one ``step`` call in flight per engine
core; here there is one per instance. Torch-free.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from .handles import Call
from .state import ClusterState

#: A decode step may run this many times the instance's slowest recent step before it counts as stalled.
STALL_FACTOR = 10.0
#: Per answered step, the remembered slowest step time decays by this factor (a slow spell is forgotten).
STALL_DECAY = 0.9


class StepTracker:
    """The steps in flight on ``state``'s instances and what their answers said.

    Args:
        state: the cluster's table (its ``handles`` are stepped).
        step_timeout_s: a step longer than this marks its instance dead (a stall).
        stall_timeout_s: a decode instance's step counts as stalled after this, or
            ``STALL_FACTOR`` times its slowest recent step if longer (at most ``step_timeout_s``;
            None: ``step_timeout_s``).

    ``monotonic`` is the timer of the steps in flight (seconds; tests put a fake one here) and
    ``last_reports`` maps an instance id to the :class:`~laser.instance.messages.InstanceReport`
    of its last answered step (the ``/metrics`` gauges, cluster admission).
    """

    def __init__(self, state: ClusterState, step_timeout_s: float, stall_timeout_s: float | None):
        self.state = state
        self.step_timeout_s = step_timeout_s
        self.stall_timeout_s = step_timeout_s if stall_timeout_s is None else min(stall_timeout_s, step_timeout_s)
        self.monotonic = time.monotonic
        self.last_reports: dict = {}  # instance id -> its InstanceReport after its last step
        self._in_flight: dict[int, Call] = {}  # instance id -> its step in flight
        self._busy: set[int] = set()  # instances with work (as of their last step)
        self._work_sent: collections.Counter = collections.Counter()  # instance id -> work given so far
        self._step_gen: dict[int, int] = {}  # instance id -> _work_sent when its step in flight started
        self._step_s: dict[int, float] = {}  # decode instance id -> its slowest recent step (decaying), s

    def mark_busy(self, iid: int) -> None:
        """``iid`` was given work: step it until a step that started after this reports it idle
        (a step already in flight may answer "idle" without having seen the new work)."""
        self._busy.add(iid)
        self._work_sent[iid] += 1

    def start(self) -> None:
        """Send a step to every live instance with work and no step in flight; the handle learns
        by when it must answer (a synchronous call never waits past that)."""
        for iid in list(self._busy):
            h = self.state.handles[iid]
            if h.alive and iid not in self._in_flight:
                self._in_flight[iid] = call = h.submit("step", h.epoch)
                call.started = self.monotonic()
                h.answer_by, h.step_future = call.started + self.deadline(iid), call.future
                self._step_gen[iid] = self._work_sent[iid]

    def futures(self) -> list:
        """The futures of the steps in flight."""
        return [c.future for c in self._in_flight.values()]

    def in_flight(self) -> list[tuple[int, Call]]:
        """The steps in flight, prefill (and mixed) instances' first: a decode answer may carry a
        direct hand-off whose first token is in a prefill answer."""
        return sorted(self._in_flight.items(), key=lambda kv: self.state.handles[kv[0]].role == "decode")

    def is_in_flight(self, iid: int, call: Call | None = None) -> bool:
        """A step of ``iid`` is in flight (``call``: that one; it is no longer once its instance failed)."""
        return iid in self._in_flight if call is None else self._in_flight.get(iid) is call

    def collect(self, iid: int, call: Call) -> dict[str, Any]:
        """The answer of ``iid``'s finished step ``call``, which is no longer in flight. Raises
        :class:`~.handles.InstanceFailure` when it failed."""
        del self._in_flight[iid]
        call.handle.answer_by = call.handle.step_future = None
        return call.handle.result(call)

    def answered(self, iid: int, seconds: float, busy: bool, report, direct_pending) -> None:
        """``iid``'s step answered after ``seconds`` (send -> answer read) with ``report``;
        it is idle when the step says so (``busy`` false), it was given nothing since the step
        started and ``direct_pending()`` (a hand-off on its way to it) is false."""
        self._step_s[iid] = max(seconds, STALL_DECAY * self._step_s.get(iid, 0.0))
        if self.state.handles[iid].role == "decode":  # frozen between two steps: caught as in one
            self.state.handles[iid].idle_answer_s = self.deadline(iid)
        if not busy and self._step_gen.get(iid) == self._work_sent[iid] and not direct_pending():
            self._busy.discard(iid)  # idle, given nothing since this step started, nothing on its way
        self.last_reports[iid] = report

    def deadline(self, iid: int) -> float:
        """Seconds a step of ``iid`` may run before the instance counts as stalled (a frozen or
        hung process): ``step_timeout_s`` (a prefill step may be a long prompt's chunk); a decode
        step is one iteration: ``stall_timeout_s``, or ``STALL_FACTOR`` x its slowest recent step."""
        if self.state.handles[iid].role != "decode":
            return self.step_timeout_s
        return min(self.step_timeout_s, max(self.stall_timeout_s, STALL_FACTOR * self._step_s.get(iid, 0.0)))

    def drop_report(self, iid: int) -> None:
        """``iid`` was fenced: its last report no longer counts (the ``/metrics`` gauges)."""
        self.last_reports.pop(iid, None)

    def forget(self, iid: int) -> None:
        """``iid`` was marked dead: no step of it is in flight any more, nor due."""
        self._in_flight.pop(iid, None)
        self._step_gen.pop(iid, None)
        self._busy.discard(iid)

    def forget_calls(self) -> None:
        """The instances' node is gone: forget every step and report of them (:mod:`.node`)."""
        for state in (self._in_flight, self._step_gen, self.last_reports):
            state.clear()
        self._busy.clear()

    def describe(self) -> str:
        """The busy instances and those with a step in flight (diagnostics)."""
        return f"busy {sorted(self._busy)} steps {sorted(self._in_flight)}"
