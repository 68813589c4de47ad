"""Queue-aware TTFT prediction for admission control (torch-free).

A new request's first token comes after (1) the rest of the step the engine is running,
(2) the prefill of every queued or prefilling request ahead of it in the scheduler's queue
order (EDF: an earlier ``arrival + TTFT target``), and (3) its own prefill — each prefill
stretched by the share of the machine that decoding takes meanwhile (the requests decoding
now, plus each request ahead once its prefill is done). That is :func:`predict_ttft`.

Thread-safety: the engine thread owns the scheduler's ``Request`` objects, so the server
never reads them. After every step the engine thread publishes a :class:`SchedulerSnapshot`
(immutable, built by :func:`snapshot_of`); the server predicts from the latest snapshot plus
the requests it admitted since (not yet in any snapshot), so a burst of arrivals is decided
without waiting for an engine step and each arrival sees the ones admitted before it.
:class:`QueueAwareAdmission` keeps that bookkeeping; a cluster controller can reuse both.

Sources: the work-ahead estimate follows the EDF feasibility test of deadline scheduling;
the decode share mirrors how each policy mixes decode with prefill (vLLM v0: prefill first,
Sarathi-Serve: decode tokens in every chunked iteration, Laser §6.2: decode groups planned
against T_g = the strictest TBT target, leaving up to ``prefill_share`` of it to prefill when a
queued deadline needs it).
Prefill runs in chunks of the token budget (whole prompts for vLLM), as the policies do.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field, replace

from ..core.request import SLO

#: Decoding never takes more than this share in the prediction (the schedulers keep room for prefill).
MAX_DECODE_SHARE = 0.9


@dataclass(frozen=True)
class QueueEntry:
    """A request that still has prompt tokens to prefill (waiting or prefilling).

    ``key``: its scheduler queue key (EDF: (arrival + TTFT target, arrival)); ``prefill_tokens``:
    tokens left to prefill; ``context_len``: its context once prefilled (its decode context);
    ``tbt``: its TBT target in seconds (None: best effort); ``slo_class``: class name.
    """

    key: tuple[float, float]
    prefill_tokens: int
    context_len: int
    tbt: float | None = None
    slo_class: str = ""


@dataclass(frozen=True)
class SchedulerSnapshot:
    """What the engine thread publishes after a step (immutable; safe to read from any thread).

    Attributes:
        time: engine clock (seconds) when taken. busy: the engine had unfinished requests
        (its next step started right after). last_step_s: wall time of the step just done
        (seconds; the estimate of the step in progress). queue: :class:`QueueEntry` of every
        waiting/prefilling request, in queue order. decode_contexts / decode_tbts: context
        length (tokens) and TBT target (seconds, None = best effort) of each decoding request.
        policy: scheduler name. queue_order: ``edf`` or ``fcfs``. best_effort_deadline_s:
        EDF deadline of best effort. prefill_share: the share of T_g Laser's Alg. 1 leaves to prefill under deadline pressure (None
        for iteration-level policies). tg_margin: Laser's planning margin on T_g.
        chunk_tokens: token budget of one iteration (``max_num_batched_tokens``).
        num_adds: add commands the engine thread had run (see :class:`QueueAwareAdmission`).
        counters: observability counters (see :func:`snapshot_of`).
    """

    time: float
    busy: bool = False
    last_step_s: float = 0.0
    queue: tuple[QueueEntry, ...] = ()
    decode_contexts: tuple[int, ...] = ()
    decode_tbts: tuple[float | None, ...] = ()
    policy: str = "sarathi"
    queue_order: str = "edf"
    best_effort_deadline_s: float = 30.0
    prefill_share: float | None = None
    tg_margin: float = 1.0
    chunk_tokens: int = 512
    num_adds: int = 0
    counters: dict = field(default_factory=dict, compare=False)

    def queue_key(self, arrival: float, ttft: float | None) -> tuple[float, float]:
        """The scheduler's queue key of a request (same rule as ``Scheduler.queue_key``)."""
        if self.queue_order == "fcfs":
            return (arrival, 0.0)
        return (arrival + (ttft if ttft is not None else self.best_effort_deadline_s), arrival)

    def step_remaining(self, now: float) -> float:
        """Seconds left of the step in progress (estimated by the last step's duration)."""
        if not self.busy:
            return 0.0
        return max(0.0, self.time + self.last_step_s - now)


def snapshot_of(sched, now: float, num_adds: int = 0, last_step_s: float = 0.0) -> SchedulerSnapshot:
    """Build the snapshot of a scheduler (call on the thread that owns it).

    ``counters`` holds copies of the observability state: ``preemptions`` {(cause, class): n},
    ``recomputes`` {(kind, class): n}, ``recomputed_tokens`` {(kind, class): tokens},
    ``icache_tokens`` / ``icache_capacity`` (tokens), ``icache_evictions`` (total),
    ``layer_stops`` (Laser's stops at a layer boundary), ``latency_calibration`` (the factor the
    planning model's predictions are scaled by; :mod:`laser.latency.calibrated`),
    ``latency_timing_spread`` (the model's ``timing_spread()``), ``running`` /
    ``waiting`` {class: n}, ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens
    looked up / found cached at first admissions), ``prefix_cache_refound`` (tokens preempted
    requests found again of their own), ``prefix_cache_evictions`` (cached blocks evicted).
    """
    from ..core.request import Phase

    queue, dec_ctx, dec_tbt = [], [], []
    running: dict[str, int] = collections.Counter()
    waiting: dict[str, int] = collections.Counter()
    for r in sched.running:
        running[r.slo.name] += 1
        if r.phase == Phase.DECODE:
            dec_ctx.append(r.num_tokens)
            dec_tbt.append(r.slo.tbt)
    for r in sched.waiting:
        waiting[r.slo.name] += 1
    for r in sorted([r for r in sched.running if r.phase != Phase.DECODE] + list(sched.waiting), key=sched.queue_key):
        left = r.num_tokens - r.num_computed_tokens
        if left > 0:
            queue.append(QueueEntry(sched.queue_key(r), left, r.num_tokens, r.slo.tbt, r.slo.name))
    rep = sched.report()
    counters = dict(rep.counters, running=dict(running), waiting=dict(waiting))
    return SchedulerSnapshot(
        time=now, busy=rep.busy, last_step_s=last_step_s, queue=tuple(queue),
        decode_contexts=tuple(dec_ctx), decode_tbts=tuple(dec_tbt), policy=rep.policy,
        queue_order=rep.queue_order, best_effort_deadline_s=rep.best_effort_deadline_s,
        prefill_share=rep.prefill_share, tg_margin=rep.tg_margin, chunk_tokens=rep.chunk_tokens,
        num_adds=num_adds, counters=counters,
    )


def decode_share(snapshot: SchedulerSnapshot, latency_model, contexts: list[int], tbts: list[float | None]) -> float:
    """Share (0..MAX_DECODE_SHARE) of the machine that decoding ``contexts`` takes while prefill waits.

    vLLM (prefill first): 0. Laser: one decode iteration per T_g (the strictest TBT target,
    times its planning margin), capped to leave ``prefill_share``; no finite target: 0 (the
    whole prefill joins one iteration). Sarathi (and others): every iteration runs the decode
    tokens plus a prefill chunk of the rest of the token budget; the decode tokens cost their
    marginal time in that hybrid batch.
    """
    if not contexts or snapshot.policy == "vllm":
        return 0.0
    c = latency_model.predict_decode_iteration(contexts)
    if snapshot.prefill_share is not None:
        t_g = min((t for t in tbts if t is not None), default=math.inf)
        if t_g == math.inf:
            return 0.0
        share = min(c / (t_g * snapshot.tg_margin), 1.0 - snapshot.prefill_share)
    else:
        # hybrid batches: the decode tokens ride in the chunk's layer calls, so they cost only
        # their marginal time (the per-layer overhead is paid by the chunk anyway)
        k = max(1, snapshot.chunk_tokens - len(contexts))
        lt = latency_model.layer_time
        marginal = latency_model.num_layers * (lt((k,) + (1,) * len(contexts), (k,) + tuple(contexts))
                                               - lt((k,), (k,))) + latency_model.head_time(len(contexts))
        marginal = min(max(marginal, 0.0), c)
        share = marginal / (marginal + latency_model.predict_prefill(k))
    return min(share, MAX_DECODE_SHARE)


def prefill_seconds(snapshot: SchedulerSnapshot, latency_model, tokens: int, context_start: int = 0) -> float:
    """Predicted time (seconds) to prefill ``tokens`` after ``context_start`` cached tokens as the
    policy runs it: whole prompts for vLLM, chunks of at most ``chunk_tokens`` otherwise (each
    chunk pays the per-layer overhead again)."""
    if snapshot.policy == "vllm":
        return latency_model.predict_prefill(tokens, context_start=context_start)
    step = max(1, snapshot.chunk_tokens)
    t, done = 0.0, 0
    while done < tokens:
        k = min(step, tokens - done)
        t += latency_model.predict_prefill(k, context_start=context_start + done)
        done += k
    return t


def predict_ttft(snapshot: SchedulerSnapshot, request: QueueEntry, latency_model, now: float,
                 arrival: float | None = None) -> float:
    """Predicted TTFT (seconds, from ``arrival``; default ``now``) of a new ``request``.

    The rest of the running step, then every queue entry whose key is not larger than
    ``request.key`` (its EDF position; equal keys were queued first) and then ``request`` itself, each prefill taking
    :func:`prefill_seconds` divided by (1 - :func:`decode_share` at that point):
    a request ahead starts decoding once its prefill is done.

    Args:
        snapshot: the latest snapshot, with any admitted-but-unpublished requests merged
            into ``queue`` (see :meth:`QueueAwareAdmission.view`).
        request: the candidate (``prefill_tokens`` = its prompt length).
        latency_model: any :class:`~laser.latency.LatencyModel` (read only).
    """
    t = (now - arrival if arrival is not None else 0.0) + snapshot.step_remaining(now)
    contexts = list(snapshot.decode_contexts)
    tbts = list(snapshot.decode_tbts)
    ahead = [e for e in snapshot.queue if e.key <= request.key]  # equal keys: queued earlier
    for e in ahead + [request]:
        work = prefill_seconds(snapshot, latency_model, e.prefill_tokens, e.context_len - e.prefill_tokens)
        t += work / (1.0 - decode_share(snapshot, latency_model, contexts, tbts))
        contexts.append(e.context_len)
        tbts.append(e.tbt)
    return t


class QueueAwareAdmission:
    """The server side of admission: the latest snapshot plus the requests admitted since.

    Every submitted request gets a sequence number in submission order (1, 2, ...); the
    engine thread runs adds in that order and counts them, so a snapshot with ``num_adds = k`` already
    holds (or has finished) the first ``k``. Single-threaded use (the event loop), except
    :meth:`publish`, which only swaps a reference.
    """

    def __init__(self, latency_model):
        self.latency_model = latency_model
        self.snapshot: SchedulerSnapshot | None = None
        self._pending: collections.deque[tuple[int, QueueEntry]] = collections.deque()

    def publish(self, snapshot: SchedulerSnapshot) -> None:
        """Install a new snapshot (any thread)."""
        self.snapshot = snapshot

    def view(self, now: float) -> SchedulerSnapshot:
        """The latest snapshot with the admitted requests it does not hold yet in its queue."""
        snap = self.snapshot or SchedulerSnapshot(time=now)
        while self._pending and self._pending[0][0] <= snap.num_adds:
            self._pending.popleft()
        if not self._pending:
            return snap
        queue = sorted(snap.queue + tuple(e for _, e in self._pending), key=lambda e: e.key)
        return replace(snap, queue=tuple(queue))

    def entry(self, prompt_len: int, arrival: float, ttft: float | None, tbt: float | None,
              slo_class: str = "", now: float | None = None, cached: int = 0) -> QueueEntry:
        """The queue entry of a new request (keyed like the scheduler will key it); ``cached``:
        its prompt tokens in the prefix cache, not to be prefilled."""
        snap = self.snapshot or SchedulerSnapshot(time=arrival if now is None else now)
        return QueueEntry(snap.queue_key(arrival, ttft), prompt_len - cached, prompt_len, tbt, slo_class)

    def predict(self, entry: QueueEntry, now: float, arrival: float | None = None,
                view: SchedulerSnapshot | None = None) -> float:
        """:func:`predict_ttft` of ``entry`` against ``view`` (default :meth:`view`)."""
        return predict_ttft(view or self.view(now), entry, self.latency_model, now, arrival)

    @staticmethod
    def with_entry(view: SchedulerSnapshot, entry: QueueEntry) -> SchedulerSnapshot:
        """``view`` with ``entry`` queued too (after the entries with the same key)."""
        queue = list(view.queue)
        i = len(queue)
        while i and queue[i - 1].key > entry.key:
            i -= 1
        queue.insert(i, entry)
        return replace(view, queue=tuple(queue))

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
    """The predicted TTFT — behind the work queued ahead of the request — misses its target (HTTP 429)."""

    def __init__(self, predicted_ttft: float, slo: SLO, num_ahead: int = 0):
        self.predicted_ttft = predicted_ttft
        self.slo = slo
        self.num_ahead = num_ahead
        where = "even if the request ran next" if num_ahead == 0 else f"behind {num_ahead} requests queued ahead of it"
        super().__init__(
            f"slo_class {slo.name!r} cannot be met: predicted time to first token "
            f"{predicted_ttft * 1e3:.1f} ms > target {slo.ttft * 1e3:.1f} ms {where}"
        )


@dataclass(frozen=True)
class Admission:
    """What admission control decided for one request."""

    slo: SLO  # the SLO the request is served under
    requested: SLO  # the SLO the client asked for
    predicted_ttft: float | None  # seconds, behind the queue ahead (None: no latency model)
    demoted: bool  # served under another class than ``requested`` (see ``demoted_to``)
    entry: QueueEntry | None = None  # its place in the queue, for the next admissions
    # the tier it was demoted to: "warm" (a demotable hot request under predicted pressure) or
    # "best_effort" (``requested`` infeasible, ``on_infeasible == "demote"``) or "cold" (a Batch API
    # line whose body names another class: served in the batch tier); None if not demoted
    demoted_to: str | None = None

    @property
    def slack(self) -> float | None:
        """Requested TTFT target minus predicted TTFT (None when either is unknown)."""
        if self.predicted_ttft is None or self.requested.ttft is None:
            return None
        return self.requested.ttft - self.predicted_ttft
