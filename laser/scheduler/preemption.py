"""Priority preemption: which running request gives way to which (vLLM's ``priority``
scheduling policy, with SLO classes as priorities). Torch-free.

The scheduler owns its queues and the one action that preempts (:meth:`Scheduler.preempt`:
free the KV, requeue); the functions here only choose, and are handed those queues and that
action explicitly. :class:`~laser.scheduler.base.Scheduler` calls them from its methods of the
same names, which every policy uses.

Victim order everywhere: the least strict class first (:func:`slo_rank`), among equals the one
preempted least often (no victim is hit again and again), then the latest deadline.
"""

from __future__ import annotations

from typing import Callable

from ..core.block_manager import BlockManager
from ..core.request import Request

QueueKey = Callable[[Request], tuple[float, float]]
Preempt = Callable[..., None]  # Scheduler.preempt(req, cause="kv")


def slo_rank(req: Request) -> tuple[float, float]:
    """Class strictness for priority preemption, smaller = stricter: (TTFT target, TBT target);
    best effort is (inf, inf) (seconds)."""
    return (req.slo.ttft_or_inf, req.slo.tbt_or_inf)


def victim_key(req: Request, queue_key: QueueKey) -> tuple:
    """Sort key of a victim candidate, largest preempted first: (class looseness, fewest
    preemptions so far, latest queue key)."""
    return (slo_rank(req), -req.num_preemptions, queue_key(req))


def make_room(req: Request, fits: Callable[[], bool], running: list[Request], preempt: Preempt, bm: BlockManager,
              queue_key: QueueKey, cause: str, protected: set[str] = frozenset(),
              need_blocks: int | None = None) -> bool:
    """Until ``fits()`` holds, preempt (``preempt(victim, cause)``) the least strict request of
    ``running`` (the scheduler's live list: ``preempt`` removes from it) of a strictly less
    strict class than ``req`` (:func:`slo_rank`; never one in ``protected``, the request ids
    already in this step's plan). ``fits`` may allocate (it is ``try_allocate`` for KV).
    Returns ``fits()``.

    ``need_blocks``: KV blocks per layer ``req`` needs; when even every eligible victim's blocks
    would not free that many, nobody is preempted (no preemption for nothing). Only strictly
    looser classes are victims, so two requests can never preempt each other back and forth."""
    if fits():
        return True
    rank = slo_rank(req)
    victims = [r for r in running if r is not req and r.req_id not in protected and slo_rank(r) > rank]
    if need_blocks is not None:
        held = sum(bm.num_held(r.req_id, 0) for r in victims)
        if bm.min_free() + held < need_blocks:
            return False
    while not fits():
        victims = [r for r in victims if r in running]
        if not victims:
            return False
        preempt(max(victims, key=lambda r: victim_key(r, queue_key)), cause)
    return True


def boost_stricter(waiting: list[Request], running: list[Request], max_num_seqs: int, bm: BlockManager,
                   room: Callable[..., bool]) -> bool:
    """Priority preemption before a step is planned. A request of ``waiting`` blocked by
    ``max_num_seqs`` or short of KV for its whole prompt gets room made for it by
    ``room(req, fits, cause, need_blocks=...)`` (the scheduler's :func:`make_room`; ``cause``
    ``running_cap`` or ``slo``) and is marked ``boosted`` (admitted first). Returns whether any
    request was boosted (the caller then re-sorts ``waiting``)."""
    if not waiting or not running:
        return False
    cap = max_num_seqs - sum(r.boosted for r in waiting)
    reserved = 0  # blocks per layer promised to boosted requests
    changed = False
    for req in list(waiting):
        if req.boosted or req not in waiting:
            continue
        need = bm.blocks_needed(req.num_tokens)  # its whole prompt (a partial fit can deadlock)

        def fits(need=need):
            return len(running) < cap and bm.min_free() - reserved >= need

        if fits():
            continue
        cause = "running_cap" if len(running) >= cap else "slo"
        if not room(req, fits, cause, need_blocks=need + reserved):
            continue
        req.boosted = True
        cap -= 1
        reserved += need
        changed = True
    return changed


def preempt_for_decode(needed: list[Request], running: list[Request], preempt: Preempt, bm: BlockManager,
                       try_allocate: Callable[[Request, int], bool], queue_key: QueueKey) -> list[Request]:
    """Make room for one more decode block for each of ``needed`` (in priority order), allocating
    it with ``try_allocate(req, tokens)``.

    Preempts (``preempt(victim)``, cause ``kv``) the least strict requests of ``running`` first
    (:func:`victim_key`), never one of a stricter class than the request that needs the block:
    that one is preempted itself instead. Returns the requests of ``needed`` that got their block.
    """
    ok = []
    live = set(map(id, running))  # ids of ``running``, kept in step with it below
    covers = bm.covers
    for req in needed:
        if id(req) not in live:  # preempted as a victim of an earlier one
            continue
        if covers(req.req_id, req.num_tokens):  # its block holds the new token already
            ok.append(req)
            continue
        rank = None
        while not try_allocate(req, req.num_tokens):
            rank = slo_rank(req) if rank is None else rank
            victims = [r for r in running if r is not req and slo_rank(r) >= rank]
            if not victims:
                preempt(req)
                live.discard(id(req))
                break
            victim = max(victims, key=lambda r: victim_key(r, queue_key))
            preempt(victim)
            live.discard(id(victim))
        else:
            ok.append(req)
    return [r for r in ok if id(r) in live]
