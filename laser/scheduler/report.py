"""What is read of a scheduler outside the scheduler package: :class:`SchedulerReport`, built by
:meth:`laser.scheduler.base.Scheduler.report`. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerReport:
    """What is read of a scheduler outside the scheduler package (admission, the instance
    reports, Alg. 2 increments, the server's metrics): one picture, taken by
    :meth:`Scheduler.report` on the thread that owns the scheduler.

    Attributes:
        policy: scheduler name. queue_order: ``edf`` or ``fcfs``. best_effort_deadline_s: EDF
        deadline of best effort (seconds). chunk_tokens: token budget of one iteration.
        busy: it holds unfinished requests. prefill_share: the share of T_g Laser's Alg. 1 leaves
        to prefill under deadline pressure (None for iteration-level policies). tg_margin: the
        planning margin on T_g (1.0 without one). t_g: tightest TBT target it plans decode to
        (seconds; inf: none). last_iteration_s: last measured decode iteration (None: none yet).
        iteration: Alg. 1's iteration counter (0 without layer-level decode). plans: Alg. 1's
        decode plans by request id (live; read on the owning thread). planning_margin: the
        fraction of T_g Alg. 1 plans to. decode_memo: Alg. 1's price memo (None without one).
        counters: observability copies (see :func:`laser.frontend.admission.snapshot_of`).
    """

    policy: str
    queue_order: str
    best_effort_deadline_s: float
    chunk_tokens: int
    busy: bool
    prefill_share: float | None = None
    tg_margin: float = 1.0
    t_g: float = math.inf
    last_iteration_s: float | None = None
    iteration: int = 0
    plans: dict = field(default_factory=dict, compare=False)
    planning_margin: float = 1.0
    decode_memo: object = field(default=None, compare=False)
    counters: dict = field(default_factory=dict, compare=False)
