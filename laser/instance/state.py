"""What an instance tells the controller, computed from its scheduler: the report (§7.1) and
the decode ``LatencyIncrement`` (Alg. 2 lines 1-9). One implementation for every instance
kind: the simulated one (:class:`laser.sim.cluster_instance.SimClusterInstance`) and the real
one (:class:`laser.instance.worker.InstanceWorker`, in process or a Ray actor). Torch-free.
"""

from __future__ import annotations

import math

from ..core.request import SLO, Request
from ..scheduler.laser.decode import DecodeCandidate
from .messages import InstanceReport, LatencyIncrement, MigrationCandidate, RequestInfo

#: Free KV blocks kept in reserve by the decode memory check (CONTROLLER.md D3, as DistServe's 5 %).
MEMORY_RESERVE = 0.05


def build_report(instance_id: int, role: str, sched, bm, icache, now: float, busy_until: float,
                 pending: list[Request] = (), adopting: list[Request] = (), num_reserved: int = 0) -> InstanceReport:
    """The :class:`InstanceReport` of an instance whose scheduler is ``sched`` and whose KV block
    manager and intermediate cache are ``bm`` and ``icache``.

    ``pending``: requests delivered but not yet in the scheduler (they queue for prefill);
    ``adopting``: hand-offs on their way or waiting for KV blocks (their blocks count as used);
    ``num_reserved``: decode reservations (CONTROLLER.md D2). Times in seconds.
    """
    rep = sched.report(now, pending)
    free = bm.min_free() - sum(bm.blocks_needed(r.num_computed_tokens) for r in adopting)
    return InstanceReport(
        instance_id=instance_id, role=role, time=now, busy_until=busy_until, scheduler=rep,
        num_decoding=len(rep.decode_contexts) + len(adopting), num_reserved=num_reserved,
        sum_context=sum(rep.decode_contexts) + sum(r.num_tokens for r in adopting),
        free_blocks=free, total_blocks=bm.num_blocks, block_size=bm.block_size,
        icache_used=icache.used_tokens, icache_capacity=icache.capacity_tokens,
        cached_blocks=bm.summary() if role != "decode" else frozenset(), prefix_root=bm.prefix_root)


def decode_increment(instance_id: int, sched, bm, latency_model, info: RequestInfo,
                     adopting: list[Request] = (), reserved: dict[str, RequestInfo] | None = None) -> LatencyIncrement:
    """Alg. 2 lines 1-9 (:meth:`laser.scheduler.base.Scheduler.latency_increment`) over the
    decoding requests, the hand-offs on their way (``adopting``) and the reservations; inf
    ("memory") when the free KV blocks of ``bm`` (the instance's pool), less those already
    promised, cannot hold ``info``'s prompt plus its expected output and a reserve of 5 % of the
    pool (CONTROLLER.md D3). Changes nothing."""
    reserved = reserved or {}
    others = [i for i in reserved.values() if i.req_id != info.req_id]
    promised = sum(bm.blocks_needed(r.num_computed_tokens) for r in adopting)
    promised += sum(bm.blocks_needed(i.prompt_len + i.expected_output) for i in others)
    cands = [DecodeCandidate(i.req_id, i.prompt_len + 1, _slo(i.ttft, i.tbt)) for i in others]
    need = bm.blocks_needed(info.prompt_len + info.expected_output)
    used = bm.num_blocks - bm.min_free() + promised
    if bm.min_free() - promised - need < MEMORY_RESERVE * bm.num_blocks:
        n_req = len(sched.decoding()) + len(adopting) + len(cands)
        return LatencyIncrement(instance_id, info.req_id, math.inf, reason="memory",
                                num_requests=n_req, used_blocks=used)
    me = DecodeCandidate(info.req_id, info.prompt_len + 1, _slo(info.ttft, info.tbt))
    inc = sched.latency_increment(latency_model, list(adopting) + cands, me)
    n_req = len(sched.decoding()) + len(adopting) + len(cands)
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


def migration_candidate(instance_id: int, sched, bm, latency_model,
                        expected_output: dict[str, float], exclude=frozenset()) -> MigrationCandidate | None:
    """:meth:`Scheduler.migration_victim` as the controller sees it: the victim's
    :class:`RequestInfo` (context as its prompt; expected output = its class's expected output
    less what it has generated, at least one block) and the blocks it holds in ``bm`` (the
    instance's pool); None when nothing must move."""
    v = sched.migration_victim(latency_model, exclude=exclude)
    if v is None:
        return None
    r, reason = v
    left = max(bm.block_size, round(expected_output.get(r.slo.name, 0)) - r.num_output_tokens)
    info = RequestInfo(r.req_id, r.arrival_time, r.num_tokens, r.slo.ttft, r.slo.tbt, r.slo.name, left)
    return MigrationCandidate(instance_id, reason, info, bm.num_held(r.req_id, 0))
