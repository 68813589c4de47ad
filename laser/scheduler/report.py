"""What is read of a scheduler outside the scheduler package: :class:`SchedulerReport`, taken by
:func:`take_report` (for :meth:`laser.scheduler.base.Scheduler.report`), its :class:`QueueEntry`
rows, and the queue ordering rule :func:`queue_key` that the scheduler sorts by and admission
keys new requests by. Torch-free."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from ..core.config import SchedulerConfig
from ..core.request import SLO, Phase, Request


def yields_prefill(slo: SLO, demoted: bool = False, boosted: bool = False) -> bool:
    """Whether a prompt with target ``slo`` goes behind those with a deadline of their own in
    Laser's prefill order (:func:`~laser.scheduler.laser.triage.triage`): no TTFT target (best
    effort, or ``demoted`` from its target) and no batch-job deadline, and not ``boosted``. Such
    prompts age at ``best_effort_deadline_s`` among themselves; issue 28 item 3: past that aging
    deadline one sorted ahead of every new chat. Admission's TTFT predictor (:mod:`.ttft`) orders
    a Laser queue by the same rule."""
    return slo.deadline is None and (slo.ttft is None or demoted) and not boosted


def prefill_yields(r) -> bool:
    """:func:`yields_prefill` of request ``r`` (its SLO, ``demoted`` and ``boosted`` flags)."""
    return yields_prefill(r.slo, r.demoted, r.boosted)


def queue_key(queue_order: str, best_effort_deadline_s: float, arrival: float, slo: SLO,
              demoted: bool = False, boosted: bool = False) -> tuple[float, float]:
    """The scheduler's queue order key of a request (smaller first; the one rule the scheduler
    sorts its queues by and admission places a new request by).

    * ``boosted`` (room was made for it by priority preemption): ``(-inf, arrival)``, admitted first.
    * FCFS: ``(arrival, 0)``.
    * EDF, a cold request of a batch job (``slo.deadline`` set: the latest time its job can start
      it and still finish in its window, :func:`laser.batch.estimate.start_by`): ``(slo.deadline,
      arrival)``. Far from the deadline that key sorts behind hot, warm and best-effort work; it
      overtakes them as the job's slack runs out.
    * EDF otherwise: ``(arrival + TTFT target, arrival)``; best effort (no target) and ``demoted``
      requests age at ``best_effort_deadline_s``.

    Seconds. Source: earliest deadline first (Laser §6.1); the boosted case is vLLM's
    ``priority`` policy admitting the request it preempted for.
    """
    if boosted:
        return (-math.inf, arrival)
    if queue_order == "fcfs":
        return (arrival, 0.0)
    if slo.deadline is not None:
        return (slo.deadline, arrival)
    ttft = slo.ttft if slo.ttft is not None and not demoted else best_effort_deadline_s
    return (arrival + ttft, arrival)


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A request with prompt tokens left to prefill (waiting, prefilling, or delivered to the
    instance and not yet in its scheduler), as a :class:`SchedulerReport` lists it.

    ``key``: its :func:`queue_key`; ``prefill_tokens``: tokens left to prefill (a chunk in flight
    counts); ``context_len``: its context once prefilled (tokens); ``tbt``: its TBT target
    (seconds, None: best effort); ``slo_class``: its class name; ``req_id``; ``deadline``: arrival
    + TTFT target (seconds; inf without one); ``prompt_len``: its prompt (tokens; 0: its
    ``context_len``); ``best_effort``: it goes behind the prompts with a deadline of their own in
    Laser's prefill order (:func:`yields_prefill`: no TTFT target or demoted, no batch-job
    deadline, not boosted).
    """

    key: tuple[float, float]
    prefill_tokens: int
    context_len: int
    tbt: float | None = None
    slo_class: str = ""
    req_id: str = ""
    deadline: float = math.inf
    prompt_len: int = 0
    best_effort: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Its prompt length (tokens): ``prompt_len``, or ``context_len`` when not given."""
        return self.prompt_len or self.context_len


@dataclass(frozen=True)
class SchedulerReport:
    """The one picture of a scheduler read outside the scheduler package (admission in process
    and on a cluster, the controller through the instance reports, the server's metrics), taken
    by :meth:`Scheduler.report` on the thread that owns the scheduler. Immutable and picklable.

    Attributes:
        policy: scheduler name. role: the instance role it schedules for (``prefill``,
        ``decode`` or ``mixed``). queue_order: ``edf`` or ``fcfs``. best_effort_deadline_s: EDF
        deadline of best effort (seconds). chunk_tokens: token budget of one iteration.
        busy: it holds unfinished requests. time: its clock when taken (seconds).
        queue: every request with prompt tokens left to prefill, in queue order
        (:class:`QueueEntry`). decode_contexts / decode_tbts: context length (tokens) and TBT
        target (seconds, None: best effort) of each decoding request. prefill_share: the share
        of T_g Laser's Alg. 1 leaves to prefill under deadline pressure (None for
        iteration-level policies). tg_margin: the planning margin on T_g (1.0 without one).
        t_g: tightest TBT target it plans decode to (seconds; inf: none). last_iteration_s: last
        measured decode iteration (None: none yet). counters: observability copies (see
        :meth:`Scheduler.report`).
    """

    policy: str = "sarathi"
    role: str = "mixed"
    queue_order: str = "edf"
    best_effort_deadline_s: float = 30.0
    chunk_tokens: int = 512
    busy: bool = False
    time: float = 0.0
    queue: tuple[QueueEntry, ...] = ()
    decode_contexts: tuple[int, ...] = ()
    decode_tbts: tuple[float | None, ...] = ()
    prefill_share: float | None = None
    tg_margin: float = 1.0
    t_g: float = math.inf
    last_iteration_s: float | None = None
    counters: dict = field(default_factory=dict, compare=False)

    def queue_key(self, arrival: float, slo: SLO, demoted: bool = False) -> tuple[float, float]:
        """:func:`queue_key` of a new request under this scheduler's order (never boosted: only
        the scheduler boosts, when it preempts for a queued request)."""
        return queue_key(self.queue_order, self.best_effort_deadline_s, arrival, slo, demoted)

    def entry(self, prompt_len: int, arrival: float, slo: SLO, demoted: bool = False, cached: int = 0,
              req_id: str = "") -> QueueEntry:
        """The :class:`QueueEntry` a new request would have here (``cached``: its prompt tokens
        in the prefix cache, not to be prefilled); keyed as the scheduler will key it."""
        return QueueEntry(self.queue_key(arrival, slo, demoted), prompt_len - cached, prompt_len, slo.tbt, slo.name,
                          req_id, math.inf if slo.ttft is None else arrival + slo.ttft, prompt_len,
                          yields_prefill(slo, demoted))

    def with_entries(self, entries) -> "SchedulerReport":
        """This report with ``entries`` queued too, each after the entries with an equal key."""
        queue = list(self.queue)
        for e in entries:
            i = len(queue)
            while i and queue[i - 1].key > e.key:
                i -= 1
            queue.insert(i, e)
        return replace(self, queue=tuple(queue))

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens left to prefill over the queue (tokens)."""
        return sum(e.prefill_tokens for e in self.queue)


def take_report(policy: str, config: SchedulerConfig, time: float, busy: bool, running: Iterable[Request],
                waiting: Iterable[Request], pending: Iterable[Request],
                key: Callable[[Request], tuple[float, float]], planning: dict, counters: dict) -> SchedulerReport:
    """The :class:`SchedulerReport` of a scheduler (policy ``policy``, config ``config``) at
    ``time`` (seconds) from its queues: ``running`` (holding KV, prefilling or decoding),
    ``waiting`` and ``pending`` (delivered to the instance, not yet added), ordered by ``key``
    (its queue key); ``planning``: the policy's own report fields (``layer_stops`` is moved into
    the counters); ``counters``: its observability copies, to which ``running`` / ``waiting``
    {class: n} and ``layer_stops`` are added."""
    queue, dec_ctx, dec_tbt, prefilling = [], [], [], []
    by_class: Counter[str] = Counter()
    for r in running:
        by_class[r.slo.name] += 1
        if r.phase == Phase.DECODE:
            dec_ctx.append(r.num_tokens)
            dec_tbt.append(r.slo.tbt)
        else:
            prefilling.append(r)
    waiting = list(waiting)
    for r in sorted(prefilling + waiting + list(pending), key=key):
        queue.append(QueueEntry(key(r), r.num_tokens - r.num_computed_tokens, r.num_tokens, r.slo.tbt,
                                r.slo.name, r.req_id, r.ttft_deadline, r.num_prompt_tokens,
                                prefill_yields(r)))
    planning = dict(planning)
    counters = {**counters, "layer_stops": planning.pop("layer_stops", 0), "running": dict(by_class),
                "waiting": dict(Counter(r.slo.name for r in waiting))}
    return SchedulerReport(policy=policy, role=config.role, queue_order=config.queue_order,
                           best_effort_deadline_s=config.best_effort_deadline_s,
                           chunk_tokens=config.max_num_batched_tokens, busy=busy, time=time, queue=tuple(queue),
                           decode_contexts=tuple(dec_ctx), decode_tbts=tuple(dec_tbt), counters=counters,
                           **planning)
