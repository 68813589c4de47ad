"""``laser``: the paper's global controller (PPoPP'26 §7).

Prefill selection (§7.1): for each prefill instance, simulate its EDF queue with the
request inserted (:func:`laser.scheduler.ttft.finish_times`) from its last report; an instance is
feasible when every deadline that held without the newcomer still holds; take the
feasible instance with the largest minimum slack (ties, such as +inf when nothing has a TTFT
target: the fewest queued prefill tokens), else the one with the fewest queued
prefill tokens, where the request is served best effort (queued after every request with
a deadline, so the admitted ones keep theirs).

Decode assignment (§7.2.1, Alg. 2), at arrival so the KV can stream during prefill
(CONTROLLER.md D1): every decode instance answers ``LatencyIncrement``; groups are
visited nearest TBT first and the first group with a finite increment gets the request on
its smallest-increment instance (ties: fewer requests); if every answer is inf, the
least-loaded instance (fewest KV blocks in use) takes it best effort. The chosen instance
keeps a reservation (D2). At the hand-off the choice is re-checked and re-run if it
became inf. Groups (§7.2.2): :class:`~laser.controller.groups.GroupManager`.

Decode->decode migration (§8, CONTROLLER.md A8.4, D9): between its steps a decode instance
whose KV memory or T_g broke names the request that should leave
(:func:`laser.scheduler.migration.migration_victim`); Alg. 2 over the other decode instances
picks its destination, which must answer a finite increment (else it stays: moving it
would break another instance).
"""

from __future__ import annotations

import math

from ..core.request import SLO
from ..instance.messages import InstanceReport, MigrationCandidate, RequestInfo
from ..scheduler.ttft import finish_times
from .base import Controller, Route, prefill_load_key, register
from .groups import GroupManager


def prefill_slack(rep: InstanceReport, lm, num_layers: int, info: RequestInfo, now: float, cached: int = 0) -> float:
    """min over queued requests of (deadline − predicted prefill finish) with ``info`` inserted
    (``cached`` of its prompt tokens already in the instance's prefix cache: only the rest is
    priced), over the requests whose deadline held without it (and ``info`` itself); negative
    when one of them would miss; +inf when none has a deadline. Finishes from the one TTFT
    predictor (:func:`laser.scheduler.ttft.finish_times`: a prefill instance's queue drains as one
    merged batch growing in queue order), starting at the end of the executing step
    (``busy_until``)."""
    start = max(now, rep.busy_until)
    sched = rep.scheduler
    before = {e.req_id: f <= e.deadline for e, f in finish_times(sched, lm, start, num_layers=num_layers)}
    newcomer = sched.entry(info.prompt_len, info.arrival_time, SLO(info.ttft, info.tbt, info.slo_name),
                           cached=cached, req_id=info.req_id)
    slack = math.inf
    for e, f in finish_times(sched, lm, start, newcomer, num_layers=num_layers):
        if math.isinf(e.deadline) or not before.get(e.req_id, True):
            continue
        slack = min(slack, e.deadline - f)
    return slack


class Increments:
    """Alg. 2's ``LatencyIncrement(r, d)`` of each decode instance ``d`` in ``instances``, asked
    when first looked up (``incs[instance_id]``) and kept: the nearest group that has a finite
    answer decides, so the instances of the groups after it are never asked (the same choice as
    asking every instance first; an instance's answer changes nothing). ``id in incs``: whether
    the instance is eligible; :meth:`values`: every answer (asks the rest; the fallback)."""

    def __init__(self, instances: list, info: RequestInfo):
        self._instances = {d.instance_id: d for d in instances}
        self._info = info
        self._answers: dict[int, object] = {}

    def __contains__(self, instance_id: int) -> bool:
        return instance_id in self._instances

    def __bool__(self) -> bool:
        return bool(self._instances)

    def __getitem__(self, instance_id: int):
        a = self._answers.get(instance_id)
        if a is None:
            a = self._answers[instance_id] = self._instances[instance_id].latency_increment(self._info)
        return a

    def values(self) -> list:
        return [self[i] for i in self._instances]


@register
class LaserController(Controller):
    """The Laser controller. Options: ``window_s`` (λ EWMA, 30 s), ``interval_s`` (group
    re-size period, 10 s), ``tbt_targets`` (groups to create up front, seconds).

    Ablation options (PPoPP'26 Fig. 8/9; the defaults are Laser): ``prefill_policy`` /
    ``decode_policy``, the scheduler of the prefill / decode instances (``"sarathi"`` on
    prefill instances = iteration-level chunked prefill with EDF, Fig. 8's baseline;
    ``"vllm"`` = whole-prompt prefill batches, or one-token decode iterations through every
    layer, Fig. 9's iteration-level decode); ``decode_assignment``: ``"alg2"`` (groups and
    increments) or ``"least_loaded"`` (always Alg. 2's fallback: fewest KV blocks in use
    including those promised, then fewest requests; Fig. 9 without group assignment). Prefill
    selection, the hand-off re-check and migration stay Laser's. Raises ValueError for an
    unknown policy or assignment. The simulator honours the per-role policies
    (:meth:`policy_for`); the real cluster front end runs ``instance_policy`` everywhere.
    """

    name = "laser"
    disaggregated = True
    instance_policy = "laser"
    DECODE_ASSIGNMENTS = ("alg2", "least_loaded")

    def __init__(self, window_s: float = 30.0, interval_s: float = 10.0, tbt_targets: tuple = (),
                 prefill_policy: str = "laser", decode_policy: str = "laser", decode_assignment: str = "alg2"):
        super().__init__()
        from ..scheduler import get_policy

        get_policy(prefill_policy), get_policy(decode_policy)  # ValueError listing the known names
        if decode_assignment not in self.DECODE_ASSIGNMENTS:
            raise ValueError(f"decode_assignment must be one of {self.DECODE_ASSIGNMENTS}, got {decode_assignment!r}")
        self.window_s, self.interval_s, self.tbt_targets = window_s, interval_s, tuple(tbt_targets)
        self.prefill_policy, self.decode_policy = prefill_policy, decode_policy
        self.decode_assignment = decode_assignment
        self.groups: GroupManager | None = None
        self.num_demoted = 0
        self.num_fallback_decode = 0
        self.num_reassigned = 0
        self.num_migrated: dict[str, int] = {}  # reason (memory | slo) -> migrations
        self.num_routed_cached_tokens = 0  # prompt tokens routed to an instance caching them

    def policy_for(self, role: str) -> str:
        return {"prefill": self.prefill_policy, "decode": self.decode_policy}.get(role, self.instance_policy)

    def attach(self, instances) -> None:
        super().attach(instances)
        d = self.decode[0]
        rep = d.report()
        self.groups = GroupManager([i.instance_id for i in self.decode], d.latency_model, rep.total_blocks,
                                   rep.block_size, list(self.tbt_targets), self.window_s, self.interval_s)

    # -- prefill (§7.1) -------------------------------------------------------------------------
    def select_prefill(self, info: RequestInfo, now: float) -> tuple[int, bool]:
        """(instance id, demoted): of the feasible instances (every deadline that held there
        still holds with the request, priced by the prompt tokens the instance's prefix cache
        does not hold: :meth:`InstanceReport.cached_prefix_tokens`), the one holding the longest
        cached prefix, then the largest slack, then the fewest pending prefill tokens; else the
        one with the fewest pending prefill tokens (demoted to best effort). A hit on an instance
        whose queue would break a deadline is not taken (cache-aware routing, issue 29; SGLang's
        router prefers the worker with the longest prefix match unless load is imbalanced).

        Equal slacks -- every instance's is +inf when no queued request and not ``info`` has a TTFT
        target -- go to the instance with the fewest pending prefill tokens (its report counts
        the requests just sent there): a burst of best-effort requests spreads over the prefill
        instances instead of all landing on the first one (issue 28: 19 vs 0 of 24)."""
        best, best_key = None, None
        fallback, fb_key = None, None
        for p in self.prefill:
            rep = p.report()
            cached = rep.cached_prefix_tokens(info)
            s = prefill_slack(rep, p.latency_model, p.num_layers, info, now, cached)
            load = prefill_load_key(rep)
            if s >= 0 and (best_key is None or (-cached, -s, load) < best_key):
                best, best_key = p.instance_id, (-cached, -s, load)
            if fb_key is None or load < fb_key:
                fallback, fb_key = p.instance_id, load
        if best is not None:
            self.num_routed_cached_tokens += -best_key[0]
            return best, False
        self.num_demoted += info.ttft is not None
        return fallback, info.ttft is not None

    # -- decode (§7.2, Alg. 2) ------------------------------------------------------------------
    def assign_decode(self, info: RequestInfo, exclude: tuple[int, ...] = ()) -> int:
        """Algorithm 2 ``DecodeAssignment``: nearest group with a finite increment, its
        smallest increment; all inf -> least-loaded (KV blocks in use, then requests)."""
        incs = Increments([d for d in self.decode if d.instance_id not in exclude], info)
        if not incs:
            raise RuntimeError("no decode instance to assign to")
        best = self._nearest_group_best(info, incs) if self.decode_assignment == "alg2" else None
        if best is not None:
            return best
        self.num_fallback_decode += 1
        return min(incs.values(), key=lambda x: (x.used_blocks, x.num_requests, x.instance_id)).instance_id

    def _nearest_group_best(self, info: RequestInfo, incs: "Increments") -> int | None:
        """Alg. 2 lines 10-15: the smallest finite increment of the nearest group that has one
        (only the groups visited ask their instances)."""
        for g in self.groups.ordered(info.tbt_or_inf):
            cands = [incs[i] for i in g.members if i in incs and incs[i].feasible]
            if cands:
                return min(cands, key=lambda x: (x.value, x.num_requests, x.instance_id)).instance_id
        return None

    def route(self, info: RequestInfo, now: float) -> Route:
        self.decisions += 1
        self.groups.observe(info.tbt_or_inf, info.prompt_len + 0.5 * info.expected_output, now)
        p, demoted = self.select_prefill(info, now)
        d = self.assign_decode(info)
        self.instances[d].reserve(info)
        return Route(p, d, demoted)

    def at_handoff(self, info: RequestInfo, chosen: int | None, now: float) -> int:
        """Re-check the decode instance chosen at arrival (D1); re-run Alg. 2 if it now answers inf.
        Asked at every hand-off by the cluster simulator only; on a real cluster the prefill
        instance hands off to the chosen instance directly and this runs only as the fall-back
        (see :meth:`Controller.at_handoff`)."""
        if chosen is not None and self.instances[chosen].latency_increment(info).feasible:
            return chosen
        if chosen is not None:
            self.instances[chosen].release(info.req_id)
        d = self.assign_decode(info)
        if d != chosen:
            self.num_reassigned += 1
        return d

    def plan_migration(self, src, now: float) -> tuple[MigrationCandidate, int] | None:
        """D9: ``src``'s victim, to the instance Alg. 2 picks among the others (finite
        increments only); the destination keeps a reservation until the KV arrives."""
        cand = src.migration_candidate(self.mean_output)
        if cand is None:
            return None
        incs = Increments([d for d in self.decode if d is not src], cand.info)
        dst = self._nearest_group_best(cand.info, incs)
        if dst is None:
            return None
        self.instances[dst].reserve(cand.info)
        self.num_migrated[cand.reason] = self.num_migrated.get(cand.reason, 0) + 1
        return cand, dst

    def on_finish(self, slo_name: str, output_tokens: int, now: float, tbt: float = math.inf) -> None:
        super().on_finish(slo_name, output_tokens, now)
        self.groups.set_output(tbt, self.mean_output[slo_name])

