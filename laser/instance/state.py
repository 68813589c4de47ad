"""What an instance tells the controller, computed from its scheduler: the report (§7.1) and
the decode ``LatencyIncrement`` (Alg. 2 lines 1-9). One implementation for every instance
kind: the simulated one (:class:`laser.sim.cluster_instance.SimClusterInstance`) and the real
one (:class:`laser.instance.worker.InstanceWorker`, in process or a Ray actor). Torch-free.
"""

from __future__ import annotations

import math

from ..core.request import SLO, Request
from ..scheduler.laser.decode import DecodeCandidate, exec_plan, level_given_up
from ..scheduler.laser.increment import latency_increment
from .messages import InstanceReport, LatencyIncrement, MigrationCandidate, PrefillQueueEntry, RequestInfo

#: Free KV blocks kept in reserve by the decode memory check (CONTROLLER.md D3, as DistServe's 5 %).
MEMORY_RESERVE = 0.05


def build_report(instance_id: int, role: str, sched, icache, now: float, busy_until: float,
                 pending: list[Request] = (), adopting: list[Request] = (), num_reserved: int = 0) -> InstanceReport:
    """The :class:`InstanceReport` of an instance whose scheduler is ``sched``.

    ``pending``: requests delivered but not yet in the scheduler (they queue for prefill);
    ``adopting``: hand-offs on their way or waiting for KV blocks (their blocks count as used);
    ``num_reserved``: decode reservations (CONTROLLER.md D2). Times in seconds.
    """
    queue = []
    for r in sorted(sched.prefilling() + list(sched.waiting) + list(pending), key=sched.queue_key):
        queue.append(PrefillQueueEntry(r.req_id, r.ttft_deadline, r.num_tokens - r.num_computed_tokens,
                                       r.num_prompt_tokens, r.demoted or r.slo.ttft is None))
    decoding = sched.decoding()
    planning = sched.report()
    bm = sched.bm
    free = bm.min_free() - sum(bm.blocks_needed(r.num_computed_tokens) for r in adopting)
    return InstanceReport(
        instance_id=instance_id, role=role, time=now, busy_until=busy_until, queue=tuple(queue),
        num_decoding=len(decoding) + len(adopting), num_reserved=num_reserved,
        sum_context=sum(r.num_tokens for r in decoding) + sum(r.num_tokens for r in adopting),
        free_blocks=free, total_blocks=bm.num_blocks, block_size=bm.block_size,
        t_g=planning.t_g, iteration_s=planning.last_iteration_s,
        icache_used=icache.used_tokens, icache_capacity=icache.capacity_tokens,
        cached_blocks=bm.summary() if role != "decode" else frozenset(), prefix_root=bm.prefix_root,
        prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits)


def decode_increment(instance_id: int, sched, latency_model, num_layers: int, info: RequestInfo,
                     adopting: list[Request] = (), reserved: dict[str, RequestInfo] | None = None) -> LatencyIncrement:
    """Alg. 2 lines 1-9 (:func:`laser.scheduler.laser.increment.latency_increment`) over the decoding
    requests, the hand-offs on their way (``adopting``) and the reservations; inf ("memory")
    when the free KV blocks, less those already promised, cannot hold ``info``'s prompt plus
    its expected output and a reserve of 5 % of the pool (CONTROLLER.md D3). Changes nothing."""
    reserved = reserved or {}
    bm = sched.bm
    decoding = sched.decoding() + list(adopting)
    others = [i for i in reserved.values() if i.req_id != info.req_id]
    promised = sum(bm.blocks_needed(r.num_computed_tokens) for r in adopting)
    promised += sum(bm.blocks_needed(i.prompt_len + i.expected_output) for i in others)
    cands = [DecodeCandidate(i.req_id, i.prompt_len + 1, _slo(i.ttft, i.tbt)) for i in others]
    need = bm.blocks_needed(info.prompt_len + info.expected_output)
    used = bm.num_blocks - bm.min_free() + promised
    n_req = len(decoding) + len(cands)
    if bm.min_free() - promised - need < MEMORY_RESERVE * bm.num_blocks:
        return LatencyIncrement(instance_id, info.req_id, math.inf, reason="memory",
                                num_requests=n_req, used_blocks=used)
    rep = sched.report()  # its Alg. 1 state: plans, iteration, the margin it plans to, its price memo
    me = DecodeCandidate(info.req_id, info.prompt_len + 1, _slo(info.ttft, info.tbt))
    inc = latency_increment(latency_model, num_layers, rep.iteration, decoding + cands, rep.plans, me,
                            rep.planning_margin, rep.decode_memo)
    return LatencyIncrement(instance_id, info.req_id, inc.value, inc.iter_before, inc.iter_after,
                            "ok" if inc.value != math.inf else "slo", n_req, used)


_SLOS: dict[tuple, SLO] = {}


def _slo(ttft: float | None, tbt: float | None) -> SLO:
    """``SLO(ttft, tbt)``, one shared (frozen) object per pair: Alg. 2 builds a candidate for every
    decode instance and reservation at every arrival."""
    slo = _SLOS.get((ttft, tbt))
    if slo is None:
        if len(_SLOS) > 4096:
            _SLOS.clear()
        slo = _SLOS[(ttft, tbt)] = SLO(ttft, tbt)
    return slo


def _gaps_still_count(r: Request) -> bool:
    """Whether moving ``r`` off an overloaded instance can still save something: it has a TBT
    target, reachable alone, and its first token met its TTFT target (else its SLO was lost from
    the start). A P99 TBT broken by one stall -- every stream on an instance that was frozen --
    does not count as lost here: each of its next gaps is still felt (the scheduler's T_g release,
    :meth:`LaserScheduler._nothing_to_keep`, counts it lost; moving it is what relieves the rest)."""
    return r.slo.tbt is not None and not r.ttft_missed and not r.tbt_infeasible


#: Decode requests tried as the T_g victim (Alg. 1 is re-run once per try), fewest blocks first.
MIGRATION_TRIES = 8


def migration_victim(sched, latency_model, num_layers: int,
                     exclude: set[str] | frozenset = frozenset()) -> tuple[Request, str] | None:
    """Decode->decode migration trigger and victim (CONTROLLER.md A8.4, D9) of a decode instance
    whose scheduler is ``sched``, between steps; None when nothing must move.

    * ``memory``: the free KV blocks of the fullest layer are fewer than the decoding requests
      need for the token after the next one (the step about to start is covered: one step of
      growth in reserve, checked between steps). Victim: the request holding the fewest blocks
      that still cover the shortfall (else the one holding the most).
    * ``slo``: T_g is finite, the last decode iteration took longer than T_g and Alg. 1's plans
      (:meth:`LaserScheduler.predict_decode`) predict an iteration over T_g; or Alg. 1 gave up
      a tighter TBT level that its own requests overload (:func:`level_given_up`; T_g is then
      the next looser target, or inf when there is none -- a backlog of one class, as after a
      thaw), and the last iteration took longer than that level. Victim: among the
      ``MIGRATION_TRIES`` requests with the fewest blocks, the first whose departure lets Alg. 1
      (:func:`exec_plan`) reach its T_g without giving a level up; when no single departure
      does but the departure of every movable request except one would, the request with the
      tightest target, fewest blocks first (the first of several moves, one per step); else
      none (moving would not help).

    Requests in ``exclude`` (already leaving) and those not at a token boundary (a layer group
    of the token in flight) are not chosen. Changes nothing.
    """
    bm = sched.bm
    rep = sched.report()
    t_g, last, memo = rep.t_g, rep.last_iteration_s, rep.decode_memo
    slo = t_g != math.inf and last is not None and last > t_g  # cheap pre-check of the T_g trigger
    # (a level given up: a request with a tighter target than T_g, reachable alone; the scan is
    # skipped while T_g holds the tightest target on the instance. T_g is inf with no target at
    # all, none reachable alone, when every request's SLO is lost (the scheduler released T_g) --
    # but also when the requests of the one class it has overload it together: that level is
    # given up, and moving some lets the rest keep their gaps)
    given_up = (not slo and last is not None
                and any(_gaps_still_count(r) and r.slo.tbt < t_g and last > r.slo.tbt for r in sched.running)
                and level_given_up(latency_model, sched.decoding(), t_g, memo))
    slo = slo or given_up
    if not slo and bm.min_free() >= len(sched.running):
        return None  # each request grows by at most one block per token: room for everyone
    decoding = [r for r in sched.decoding() if r.req_id not in exclude]
    if len(decoding) < 2:
        return None  # a lone request has nowhere better to be
    held = bm.num_held
    growth = sum(1 for r in decoding if bm.blocks_needed(r.num_tokens + 1) > held(r.req_id, 0))
    short = growth - bm.min_free()
    if short <= 0 and not (given_up or (slo and sched.predict_decode(decoding) > t_g)):
        return None
    movable = sorted((r for r in decoding if r.next_layer == 0), key=lambda r: (held(r.req_id, 0), r.req_id))
    if not movable:
        return None
    if short > 0:
        cover = [r for r in movable if held(r.req_id, 0) >= short]
        return (cover[0] if cover else movable[-1]), "memory"
    factor = sched.plan_target_factor()

    def restores(leaving: list) -> bool:  # Alg. 1 reaches its T_g, no level given up, without ``leaving``
        rest = [x for x in decoding if all(x is not r for r in leaving)]
        _, t_g2, load = exec_plan(latency_model, num_layers, rep.iteration, rest, rep.plans, factor, memo)
        return not level_given_up(latency_model, rest, t_g2, memo) and (load is None or load.predict() <= t_g2)

    for r in movable[:MIGRATION_TRIES]:
        if restores([r]):
            return r, "slo"
    leaving = movable if len(movable) < len(decoding) else movable[:-1]
    if len(leaving) > 1 and restores(leaving):  # a backlog: several must go, the first now
        return min(movable, key=lambda r: (r.slo.tbt_or_inf, held(r.req_id, 0), r.req_id)), "slo"
    return None


def migration_candidate(instance_id: int, sched, latency_model, num_layers: int,
                        expected_output: dict[str, float], exclude=frozenset()) -> MigrationCandidate | None:
    """:func:`migration_victim` as the controller sees it: the victim's :class:`RequestInfo`
    (context as its prompt; expected output = its class's expected output less what it has
    generated, at least one block) and its blocks; None when nothing must move."""
    v = migration_victim(sched, latency_model, num_layers, exclude=exclude)
    if v is None:
        return None
    r, reason = v
    bs = sched.bm.block_size
    left = max(bs, round(expected_output.get(r.slo.name, 0)) - r.num_output_tokens)
    info = RequestInfo(r.req_id, r.arrival_time, r.num_tokens, r.slo.ttft, r.slo.tbt, r.slo.name, left)
    return MigrationCandidate(instance_id, reason, info, sched.bm.num_held(r.req_id, 0))
