"""The executing step, as Laser's arrival rule sees it (PPoPP'26 §6.1): whether a request arriving
during a step stops it at the next layer boundary. A component of
:class:`~laser.scheduler.laser.scheduler.LaserScheduler` holding only the step's own state; the
decode plans and the newcomer's prices come as arguments. Torch-free.
"""

from __future__ import annotations

from ...core.plan import StepPlan, Work
from ...core.pricing import PlanCost
from ...core.request import Request
from ...latency import LatencyModel


class StepWatch:
    """The step being executed: its plan, the layer it reached, and the stop it was asked for.

    A stop pauses every in-flight prefill work at the boundary (its hidden state goes to the
    intermediate cache) so the next ``schedule`` re-plans with the newcomer in EDF position; decode
    works run on to the end of their layer groups (parking them would put the next step into their
    token gap)."""

    def __init__(self, lm: LatencyModel, num_layers: int):
        self.lm = lm
        self.num_layers = num_layers
        self.in_step = False
        self.plan = StepPlan(num_layers, [])
        self._cum: list[float] | None = []  # predicted seconds to finish layers < j of the plan
        self._spec_s = 0.0  # predicted seconds of the plan's self-speculative passes (after its layers)
        self.first = 0
        self.cur_layer = 0
        self.stop_pending = False
        self.has_prefill = False
        self.catches_up = False  # fresh prefill work catches up to a paused chunk it merges with
        self.start = 0.0  # clock at the step's start (seconds)
        self.num_stops = 0  # steps stopped at a layer boundary

    def begin(self, plan: StepPlan, decode_ids, start: float) -> None:
        """A step of ``plan`` starts at ``start`` (seconds); ``decode_ids``: the requests with decode plans."""
        self.plan = plan
        self._cum = None  # built on the first arrival during the step (remaining_from)
        self._spec_s = 0.0
        self.first = plan.first_layer if plan.works else 0
        self.cur_layer = self.first
        self.in_step = bool(plan.works)
        self.has_prefill = any(w.num_tokens > 1 or w.req_id not in decode_ids for w in plan.works)
        prefill = [w for w in plan.works if w.req_id not in decode_ids]
        self.catches_up = any(w.layer_start > 0 for w in prefill) and any(w.layer_start == 0 for w in prefill)
        self.stop_pending = False
        self.start = start

    def end(self) -> None:
        self.in_step = False

    def stop_at(self, layer: int) -> bool:
        """The executor reached boundary ``layer``: stop here if an arrival asked for it."""
        self.cur_layer = layer
        if self.stop_pending:
            self.stop_pending = False
            self.num_stops += 1
            return True
        return False

    def arrival_stops(self, req: Request, now: float, alone: float, leads: bool, decode_ids) -> bool:
        """Whether ``req``, arriving at ``now`` (its prefill alone takes ``alone`` seconds), stops the
        running step at the next layer boundary (and asks for it): (a) the step's remaining time
        exceeds the newcomer's slack (preempt; a request already hopeless even if it ran next does
        not disrupt the others), or (b) the step runs prefill work, the newcomer comes first in the
        queue (``leads``: its queue key is below every other waiting request's) and the stop pays
        (:meth:`merge_pays`): the next schedule runs the newcomer ahead of the paused chunks, alone
        where they can wait (:meth:`~.prefill.PrefillPlanner.holds_back`; the paused chunks then
        resume at their layer), or catching up to their layer and merging, its chunk sized so every
        deadline holds. (b) does not stop a step in which fresh prefill work catches up to a paused
        chunk (a stream of arrivals would otherwise keep that chunk parked one layer before its
        end, iteration after iteration, while each newcomer catches up); a paused chunk resumed
        alone may be paused again (issue 28: short chats arriving 100 ms apart waited behind the
        resumed chunk of a 2,000-token prefill, 0.4-0.7 s against 45 ms alone)."""
        if req.slo.ttft is not None and not req.demoted:
            slack = req.ttft_deadline - now - alone
            if self.remaining_from(self.cur_layer) > slack and slack > -alone:
                self.stop_pending = True
                return True
        if (self.has_prefill and leads and not self.catches_up
                and self.cur_layer < self.num_layers - 1 and self.merge_pays(alone, decode_ids)):
            self.stop_pending = True
        return self.stop_pending

    def merge_pays(self, alone: float, decode_ids) -> bool:
        """Whether stopping the running step at the next layer boundary j for a newcomer whose
        prefill alone takes ``alone`` seconds to catch up and merge (§6.1, Fig. 1b) lowers the
        summed TTFT. The newcomer gains the prefill part of the step's rest (the rest,
        :meth:`remaining_from` j, less its decode works' layers from j on, which run to their ends
        either way); each of the k paused prefill chunks loses about ``alone`` (its catch-up through
        [0, j), then its tokens in the merged layers from j on, which the paused chunks re-read).
        On a CPU a layer call costs about its tokens: a short newcomer costs the paused chunk little.
        On a GPU a layer call costs its weight read (tokens ride almost free): the stop costs the
        paused chunk about a whole iteration and saves the newcomer only the rest's prefill tokens --
        it pays only against a long chunk early in the step."""
        n = self.num_layers
        j = min(max(self.cur_layer + 1, self.first), n)
        dec, paused = [], 0
        for w in self.plan.works:
            if w.req_id in decode_ids:
                if w.layer_end > j:
                    dec.append(Work(w.req_id, w.token_start, w.num_tokens, max(w.layer_start, j), w.layer_end,
                                    w.sample, w.masked))
            elif w.layer_end > j:
                paused += 1
        prefill_rest = self.remaining_from(j) - (PlanCost(self.lm, n, dec).total if dec else 0.0)
        return prefill_rest > paused * alone

    def remaining_from(self, layer: int) -> float:
        """Predicted seconds of the executing step's layers from ``layer`` on (cumulative
        layer times, built once per step, one latency-model call per constant segment)."""
        cum = self._cum
        if cum is None:
            cum = self._cum = [0.0]
            plan = self.plan
            if plan.works:
                first = plan.first_layer
                cum.extend([0.0] * first)
                cost = PlanCost(self.lm, self.num_layers, plan.works, *(plan.speculative or ()))
                for a, b, _, _, t in cost.segs:
                    if b <= first or a >= plan.last_layer:
                        continue
                    for _ in range(max(a, first), b):
                        cum.append(cum[-1] + t)
                self._spec_s = cost.spec_seconds  # self-speculative passes: after the layer calls
        j = min(max(layer, self.first), len(cum) - 1)
        return cum[-1] - cum[j] + self._spec_s if self._spec_s else cum[-1] - cum[j]
