"""Queue-aware admission control (torch-free).

A new request's predicted TTFT is the one TTFT predictor's (:mod:`laser.scheduler.ttft`) over
the instance's queue: the rest of the step the engine is running, the prefill of every request
ahead of it in the scheduler's queue order (:func:`laser.scheduler.report.queue_key`), and its own.

Thread-safety: the engine thread owns the scheduler's ``Request`` objects, so the server
never reads them. After every step the engine thread publishes the scheduler's
:class:`~laser.scheduler.report.SchedulerReport` (immutable, :meth:`Scheduler.report`); the
server predicts from the latest report plus the requests it admitted since (not yet in any
report), so a burst of arrivals is decided without waiting for an engine step and each arrival
sees the ones admitted before it. :class:`QueueAwareAdmission` keeps that bookkeeping, in
process and on a cluster (where the front end publishes the report of the prefill instance a
request would be routed to).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace

from ..core.request import SLO
from ..latency.base import frontend_ttft
from ..scheduler.report import QueueEntry, SchedulerReport
from ..scheduler.ttft import predict_ttft


class QueueAwareAdmission:
    """The server side of admission: the latest published report plus the requests admitted since.

    Every submitted request gets a sequence number in submission order (1, 2, ...); the
    engine thread runs adds in that order and counts them, so a report published with
    ``num_adds = k`` already holds (or has finished) the first ``k``. Single-threaded use (the
    event loop), except :meth:`publish`, which only swaps a reference.

    ``model``: the queue-time model of :func:`laser.scheduler.ttft.predict_ttft` (None: the one
    of the report's policy, :func:`laser.scheduler.ttft.model_for`).
    """

    def __init__(self, latency_model, model: str | None = None):
        self.latency_model = latency_model
        self.model = model
        # (report, adds the engine thread had run, its last step's duration in seconds)
        self._published: tuple[SchedulerReport, int, float] | None = None
        self._pending: collections.deque[tuple[int, QueueEntry]] = collections.deque()

    def publish(self, report: SchedulerReport, num_adds: int = 0, last_step_s: float = 0.0) -> None:
        """Install a new report (any thread), taken after ``num_adds`` add commands had run and a
        step of ``last_step_s`` seconds (the estimate of the step in progress when busy)."""
        self._published = (report, num_adds, last_step_s)

    @property
    def report(self) -> SchedulerReport | None:
        """The latest published report (None before the first)."""
        p = self._published
        return p[0] if p is not None else None

    def view(self, now: float) -> SchedulerReport:
        """The latest report with the admitted requests it does not hold yet in its queue."""
        p = self._published
        rep, num_adds = (p[0], p[1]) if p is not None else (SchedulerReport(time=now), 0)
        while self._pending and self._pending[0][0] <= num_adds:
            self._pending.popleft()
        if not self._pending:
            return rep
        return rep.with_entries(e for _, e in self._pending)

    def start(self, now: float) -> float:
        """When the instance starts on its queue: ``now`` plus what is left of the step in
        progress (estimated by the last step's duration)."""
        p = self._published
        if p is None or not p[0].busy:
            return now
        return now + max(0.0, p[0].time + p[2] - now)

    def entry(self, prompt_len: int, arrival: float, slo: SLO, cached: int = 0) -> QueueEntry:
        """The queue entry of a new request (keyed like the scheduler will key it:
        :meth:`SchedulerReport.entry`); ``cached``: its prompt tokens in the prefix cache, not to
        be prefilled."""
        rep = self.report or SchedulerReport(time=arrival)
        return rep.entry(prompt_len, arrival, slo, cached=cached)

    def predict(self, entry: QueueEntry, now: float, arrival: float | None = None,
                view: SchedulerReport | None = None) -> float:
        """Predicted TTFT (seconds, from ``arrival``; default ``now``) of ``entry`` queued on
        ``view`` (default :meth:`view`): :func:`laser.scheduler.ttft.predict_ttft`, plus what the
        HTTP front end adds to a served TTFT (the model's measured ``frontend_ttft_s``; admission
        runs behind the server only)."""
        return predict_ttft(view or self.view(now), entry, self.latency_model, self.start(now),
                            now if arrival is None else arrival, self.model) + self.frontend_s()

    def frontend_s(self) -> float:
        """The latency model's ``frontend_ttft_s`` (seconds; 0.0 without a model or a measurement)."""
        return frontend_ttft(self.latency_model)

    def decide(self, prompt_len: int, slo: SLO, arrival: float, now: float, view: SchedulerReport,
               on_infeasible: str, slo_classes, cached: int = 0) -> tuple["Admission", SchedulerReport]:
        """Admission of one prompt of ``prompt_len`` tokens (``cached`` of them in the prefix
        cache) asking for ``slo``, arriving at ``arrival`` (engine clock; ``now``: the clock now),
        queued on ``view`` (:meth:`view`, with the prompts admitted before it in this call). The
        predicted TTFT (:meth:`predict`) decides: within the target, or no target or no latency
        model -> served as asked; over it -> by ``on_infeasible``: ``demote`` (served as the
        strictest hot or warm class whose target its prediction there meets,
        :meth:`SLOClasses.looser_than`, else as ``best_effort``; InvalidRequestError when the
        classes have none); otherwise as its warm class when it is demotable
        (``slo_classes.demotion_target``, a :class:`~laser.core.slo.SLOClasses`; issue 14), else
        ``queue`` (served as asked) or ``reject`` (raises :class:`SLOInfeasibleError` with the
        prediction, the requests ahead and the prediction on an idle instance, which tells a
        target no retry can meet). Returns (the :class:`Admission`, ``view`` with it queued). The
        one rule of in-process admission (:meth:`AsyncEngine.admit`) and of the benchmarks that
        replay the server's admission (``benchmarks/slo_pressure.py``)."""
        entry = self.entry(prompt_len, arrival, slo, cached=cached)
        pred = None
        if slo.ttft is not None and self.latency_model is not None:
            pred = self.predict(entry, now, arrival, view)
        if pred is not None and pred > slo.ttft:
            if on_infeasible == "demote":
                served, entry = self._demotion(prompt_len, slo, arrival, now, view, slo_classes, cached)
                return Admission(served, slo, pred, True, entry, served.tier), self.with_entry(view, entry)
            warm = slo_classes.demotion_target(slo)
            if warm is not None:  # pressure: the target is missed behind the queue ahead -> served as warm
                entry = self.entry(prompt_len, arrival, warm, cached=cached)
                return Admission(warm, slo, pred, True, entry, "warm"), self.with_entry(view, entry)
            if on_infeasible == "reject":
                idle = replace(view, queue=(), decode_contexts=(), decode_tbts=(), busy=False)
                alone = predict_ttft(idle, entry, self.latency_model, now, now, self.model) + self.frontend_s()
                raise SLOInfeasibleError(pred, slo, sum(e.key <= entry.key for e in view.queue), alone)
        # (the next prompt of the call queues behind it)
        return Admission(slo, slo, pred, False, entry), self.with_entry(view, entry)

    def _demotion(self, prompt_len: int, slo: SLO, arrival: float, now: float, view: SchedulerReport,
                  slo_classes, cached: int) -> tuple[SLO, QueueEntry]:
        """(the SLO, its queue entry) ``--on-infeasible demote`` serves a request of ``slo`` as,
        whose target is predicted missed: the strictest looser class whose target the prediction
        queued as that class meets, else ``best_effort``."""
        for c in slo_classes.looser_than(slo):
            entry = self.entry(prompt_len, arrival, c, cached=cached)
            if self.predict(entry, now, arrival, view) <= c.ttft:
                return c, entry
        best_effort = slo_classes.get("best_effort")
        return best_effort, self.entry(prompt_len, arrival, best_effort, cached=cached)

    @staticmethod
    def with_entry(view: SchedulerReport, entry: QueueEntry) -> SchedulerReport:
        """``view`` with ``entry`` queued too (after the entries with the same key)."""
        return view.with_entries((entry,))

    def admitted(self, seq: int, entry: QueueEntry) -> None:
        """Record a request submitted as the engine's ``seq``-th add (1-based, increasing)."""
        self._pending.append((seq, entry))


# -- what admission control answers (raised / returned by laser.frontend.async_engine.AsyncEngine.admit) --------


class QueueFullError(Exception):
    """The bounded waiting queue is full (HTTP 429)."""


class EngineStoppedError(Exception):
    """The engine is draining, stopped, or dead (HTTP 503)."""


class EngineUnavailableError(Exception):
    """The engine cannot serve right now but may soon (a cluster that lost every instance of a
    role it needs, while one may come back): HTTP 503 with ``Retry-After: retry_after_s``
    (seconds), never a 500."""

    retry_after_s: float = 5.0


class EngineStepError(Exception):
    """``engine.step()`` raised; the requests in flight were aborted (HTTP 500)."""


class SLOInfeasibleError(Exception):
    """The predicted TTFT — behind the work queued ahead of the request — misses its target.

    ``alone_ttft``: the prediction (seconds) on an idle instance, arriving now (None: not
    predicted). When it misses the target too (:attr:`never`), no retry can succeed (HTTP 400);
    else the queue is to blame and a retry may (HTTP 429 with ``Retry-After``)."""

    def __init__(self, predicted_ttft: float, slo: SLO, num_ahead: int = 0, alone_ttft: float | None = None):
        self.predicted_ttft = predicted_ttft
        self.slo = slo
        self.num_ahead = num_ahead
        self.alone_ttft = alone_ttft
        if self.never:
            where = (f"and {alone_ttft * 1e3:.1f} ms even on an idle instance: this server cannot meet the "
                     f"target for this prompt (ask for a longer ttft target or another slo_class)")
        elif num_ahead == 0:
            where = "even if the request ran next"
        else:
            where = f"behind {num_ahead} requests queued ahead of it"
        super().__init__(
            f"slo_class {slo.name!r} cannot be met: predicted time to first token "
            f"{predicted_ttft * 1e3:.1f} ms > target {slo.ttft * 1e3:.1f} ms {where}"
        )

    @property
    def never(self) -> bool:
        """The target is missed even on an idle instance: retrying cannot help."""
        return self.alone_ttft is not None and self.alone_ttft > self.slo.ttft


@dataclass(frozen=True)
class Admission:
    """What admission control decided for one request."""

    slo: SLO  # the SLO the request is served under
    requested: SLO  # the SLO the client asked for
    predicted_ttft: float | None  # seconds, behind the queue ahead (None: no latency model)
    demoted: bool  # served under another class than ``requested`` (see ``demoted_to``)
    entry: QueueEntry | None = None  # its place in the queue, for the next admissions
    # the tier it was demoted to: "warm" (a demotable hot request under predicted pressure) or, with
    # ``on_infeasible == "demote"`` and ``requested`` infeasible, the tier of the class it is served
    # as ("hot", "warm" or "best_effort") or "cold" (a Batch API
    # line whose body names another class: served in the batch tier); None if not demoted
    demoted_to: str | None = None

    @property
    def slack(self) -> float | None:
        """Requested TTFT target minus predicted TTFT (None when either is unknown)."""
        if self.predicted_ttft is None or self.requested.ttft is None:
            return None
        return self.requested.ttft - self.predicted_ttft
