"""The scheduler interface every policy implements, and the bookkeeping they share.

A scheduler is torch-free. It owns the request queues and decides, each step, which requests run
which layers on which tokens (:class:`~laser.core.plan.StepPlan`); it allocates the KV blocks of
the works it plans and keeps the intermediate cache within capacity.

Contract (one engine step)::

    plan = sched.schedule(now)                 # allocate, decide
    result = runner.execute(plan, sched.requests_of(plan), stop_at=sched.stop_at)
    updated = sched.update(plan, result.stopped_layer, result.sampled, now)

``stop_at(j)`` is asked at layer boundaries; a policy that returns True pauses every
in-flight prefill work at layer j (its hidden states go to the intermediate cache) so the
next ``schedule`` can put more urgent work first (Laser §6.1); decode tokens run on to the
end of their layer range (:meth:`~laser.core.plan.Work.reached`). Iteration-level policies
never stop.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Callable

from ..core.block_manager import BlockManager
from ..core.config import SchedulerConfig
from ..core.depth import DepthMeans, exit_plan
from ..core.intermediate_cache import IntermediateCache
from ..core.plan import StepPlan, Work
from ..core.request import SLO_EPS, Phase, Request
from . import preemption
from .report import SchedulerReport, queue_key, take_report


class Scheduler(ABC):
    """Base class: queues, admission bookkeeping, progress update, finish/abort, preemption."""

    name = "base"

    def __init__(
        self,
        config: SchedulerConfig,
        num_layers: int,
        block_manager: BlockManager,
        icache: IntermediateCache,
        latency_model=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock  # the instance's time source (seconds); virtual in the simulator
        self.num_layers = num_layers
        self.bm = block_manager
        self.icache = icache
        self.latency_model = latency_model
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: list[Request] = []  # holds no KV; queue order by queue_key
        self.running: list[Request] = []  # admitted: holds KV (prefilling or decoding)
        self.num_preemptions = 0  # total, every cause
        # Observability (exported on /metrics): keyed by (cause or kind, SLO class name).
        self.preemptions: Counter[tuple[str, str]] = Counter()
        self.recomputes: Counter[tuple[str, str]] = Counter()
        self.recomputed_tokens: Counter[tuple[str, str]] = Counter()
        # Prefix cache (vLLM's queries / hits at first admission; re-found on readmission: not a hit)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_refound = 0
        self._prefix_version = -1  # bm.cache_version at the last refresh_prefixes
        self.step_index = 0
        self.depth_means = DepthMeans()  # dynamic depth: layers per decode token, per SLO class
        # Self-speculation's SpecShape (set_speculation), None without: Laser prices decode works by it
        self.speculation = None

    # -- queue ----------------------------------------------------------------------------
    def queue_key(self, req: Request) -> tuple[float, float]:
        """``req``'s place in the queue order: :func:`laser.scheduler.report.queue_key` (EDF or
        FCFS; boosted first; a batch job's cold request by its own deadline; best effort and
        demoted requests age at ``best_effort_deadline_s``)."""
        cfg = self.config
        return queue_key(cfg.queue_order, cfg.best_effort_deadline_s, req.arrival_time, req.slo, req.demoted,
                         req.boosted)

    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id}")
        self.requests[req.req_id] = req
        self.depth_means.seed(req)
        self.lookup_prefix(req)  # priced by what it still has to compute from the start
        self.waiting.append(req)
        self.waiting.sort(key=self.queue_key)
        self.on_arrival(req)

    def add_running(self, req: Request) -> None:
        """Adopt a request that already holds KV (decode hand-off from a prefill instance)."""
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id}")
        self.requests[req.req_id] = req
        self.depth_means.seed(req)
        self.running.append(req)
        self.on_adopt(req)

    @property
    def role(self) -> str:
        """The instance role it schedules for: ``prefill``, ``decode`` or ``mixed``."""
        return self.config.role

    @property
    def step_observer(self) -> Callable | None:
        """:meth:`observe_step` when its latency model calibrates online (the core calls it); else None."""
        return self.observe_step if hasattr(self.latency_model, "observe_step") else None

    def observe_step(self, plan: StepPlan, measured_s: float) -> None:
        """``plan`` ran to its end in ``measured_s`` s: the latency model is told that, its prediction
        (``plan.predicted``, made at planning; priced now for unpriced plans; at its warm factor for a warm
        decode step, ``plan.warm``) and the plan itself."""
        lm = self.latency_model
        lm.observe_step(lm.predict_iteration(plan), measured_s, plan)  # (the planned price, warm or not)

    def set_role(self, role: str) -> None:
        """Serve as ``role`` from the next step on (a prefill instance as mixed without decode instances)."""
        self.config = dataclasses.replace(self.config, role=role)
        self.on_role_change()

    def on_role_change(self) -> None:
        """Hook: the role changed (Laser replans its decode)."""

    def on_adopt(self, req: Request) -> None:
        """Hook: a decode-phase request joined (Laser replans)."""

    def on_arrival(self, req: Request) -> None:
        """Hook: a request arrived (Laser's slack check)."""

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_request(self, req_id: str) -> bool:
        """``req_id`` is an unfinished request here."""
        return req_id in self.requests

    def request_ids(self) -> list[str]:
        """The ids of the unfinished requests, oldest first."""
        return list(self.requests)

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request ``req_id``, or None."""
        return self.requests.get(req_id)

    def requests_of(self, plan) -> dict[str, Request]:
        """The requests of ``plan``'s works by id (what an executor reads to run the plan)."""
        return {w.req_id: self.requests[w.req_id] for w in plan.works}

    def running_requests(self) -> list[Request]:
        """The running requests (a copy, in running order)."""
        return list(self.running)

    def set_speculation(self, shape) -> None:
        """Price decode works as self-speculative by ``shape`` (a :class:`laser.core.speculation.SpecShape`;
        None: none), set with the speculating executor (:func:`laser.spec.enable_self_speculation`)."""
        self.speculation = shape

    num_waiting = property(lambda self: len(self.waiting))
    num_running = property(lambda self: len(self.running))

    # -- decisions ----------------------------------------------------------------------------
    @abstractmethod
    def schedule(self, now: float) -> StepPlan:
        """Decide the next step. Allocates KV blocks for every planned work."""

    def stop_at(self, layer: int) -> bool:
        """Pause the step's prefill work at this layer boundary? (Iteration-level: never.)"""
        return False

    # -- helpers for policies --------------------------------------------------------------------
    def full_work(self, req: Request, num_tokens: int) -> Work:
        """A work running ``num_tokens`` new tokens of ``req`` through every layer (a decode token
        that may exit early priced at its expected depth: :func:`laser.core.depth.exit_plan`)."""
        start = req.num_computed_tokens
        n = self.num_layers
        return Work(
            req.req_id, start, num_tokens, 0, n, start + num_tokens == req.num_tokens, req.masked,
            *exit_plan(req, start, num_tokens, n),
        )

    def prefill_remaining(self, req: Request) -> int:
        """Tokens of ``req`` still to prefill (:func:`prefill_left`)."""
        return prefill_left(req)

    def decoding(self) -> list[Request]:
        """Running requests in the decode phase."""
        return [r for r in self.running if r.phase == Phase.DECODE]

    def prefilling(self) -> list[Request]:
        """Running requests with prompt tokens left to prefill, in queue order."""
        return sorted((r for r in self.running if r.phase != Phase.DECODE), key=self.queue_key)

    def relieve_deadlock(self, works: list) -> None:
        """If nothing could be planned while requests hold KV, preempt the latest one."""
        if not works and self.running and not self.icache.ids():
            self.preempt(max(self.running, key=self.queue_key))

    # -- prefix cache (laser.core.block_manager) ----------------------------------------------------
    def lookup_prefix(self, req: Request) -> None:
        """Set the ``num_computed_tokens`` of ``req`` (holding no KV, no chunk in flight) to its longest
        cached prefix: whole blocks, at most ``num_tokens - 1`` tokens (the last is computed for its
        logits, as vLLM); :meth:`try_allocate` attaches them. Called right before planning a waiting
        request (blocks get evicted). Prompt-logprobs requests compute their whole prompt (vLLM v1)."""
        bm = self.bm
        if (not bm.enable_prefix_caching or req.chunk_tokens or bm.has(req.req_id)
                or req.sampling_params.prompt_logprobs is not None):
            return
        tokens = req.all_token_ids
        hashes = bm.block_hashes(req.block_hashes, tokens)
        req.num_computed_tokens = bm.cached_prefix_blocks(hashes, len(tokens) - 1) * bm.block_size

    def refresh_prefixes(self) -> None:
        """:meth:`lookup_prefix` for every waiting request, when the cache changed since the last
        refresh (policies call it at the top of ``schedule``, before pricing the queue)."""
        v = self.bm.cache_version
        if v != self._prefix_version:
            self._prefix_version = v
            for r in self.waiting:
                self.lookup_prefix(r)

    def try_allocate(self, req: Request, num_tokens: int, layers: range | None = None) -> bool:
        """Allocate KV for ``req`` up to ``num_tokens`` total tokens; False when the pool is short.

        A request not holding KV yet first attaches the cached blocks of its computed prefix
        (:meth:`lookup_prefix` set ``num_computed_tokens`` to them)."""
        bm = self.bm
        prefix = ()
        if req.num_computed_tokens and not req.chunk_tokens and not bm.has(req.req_id):
            prefix = req.block_hashes[: req.num_computed_tokens // bm.block_size]
        if not bm.can_allocate(req.req_id, num_tokens, layers, prefix):
            return False
        bm.allocate(req.req_id, num_tokens, layers, prefix)
        return True

    def admit(self, req: Request) -> None:
        """Move ``req`` from waiting to running (it starts holding KV). Counts the prefix-cache
        query and hit of its first admission (a readmission after preemption re-finds its own
        blocks: :attr:`prefix_cache_refound`, not a hit)."""
        self.waiting.remove(req)
        self.running.append(req)
        req.boosted = False
        if req.phase == Phase.WAITING:
            req.phase = Phase.PREFILL
        if self.bm.enable_prefix_caching:
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                self.prefix_cache_queries += req.num_prompt_tokens
                self.prefix_cache_hits += req.num_computed_tokens
            else:
                self.prefix_cache_refound += req.num_computed_tokens

    def count_preemption(self, cause: str, req: Request | None) -> None:
        """Count one preemption of victim ``req`` by ``cause`` (``kv``: pool short, ``slo``: a stricter
        deadline, ``running_cap``: max_num_seqs); every preemption, whatever its mechanism, once."""
        self.preemptions[(cause, req.slo.name if req is not None else "")] += 1
        self.num_preemptions += 1

    def count_recompute(self, kind: str, req: Request, tokens: int) -> None:
        """Count work thrown away for recomputation: ``kind`` ``preemption`` (KV freed) or
        ``icache_eviction`` (a paused chunk's hidden state dropped); ``tokens`` to redo."""
        if tokens > 0:
            self.recomputes[(kind, req.slo.name)] += 1
            self.recomputed_tokens[(kind, req.slo.name)] += tokens

    def preempt(self, req: Request, cause: str = "kv") -> None:
        """Recompute preemption (vLLM): free ``req``'s KV and paused state, requeue it; its output is
        kept and recomputed with the prompt when readmitted. ``cause``: :meth:`count_preemption`."""
        self.count_recompute("preemption", req, req.num_computed_tokens + req.chunk_tokens)
        was_decoding = req.phase == Phase.DECODE
        self.bm.free(req.req_id)
        self.icache.discard(req.req_id)
        req.num_computed_tokens = req.chunk_tokens = req.next_layer = 0
        req.phase = Phase.PREFILL if req.output_token_ids else Phase.WAITING
        req.num_preemptions += 1
        self.lookup_prefix(req)  # its own published blocks stay cached: it resumes from them
        if req in self.running:
            self.running.remove(req)
        self.waiting.append(req)
        self.waiting.sort(key=self.queue_key)
        self.count_preemption(cause, req)
        self.on_preempt(req, was_decoding)

    def on_preempt(self, req: Request, was_decoding: bool) -> None:
        """Hook: ``req`` was preempted (Laser drops its decode plan)."""

    # -- priority preemption (laser.scheduler.preemption chooses; preempt acts) ------------------
    def preempt_for_stricter(self) -> None:
        """Priority preemption before a step is planned (vLLM's ``priority`` policy): a waiting
        request blocked by ``max_num_seqs`` or short of KV preempts running requests of strictly
        looser SLO classes (:meth:`make_room`) and is admitted first (``boosted``;
        :func:`laser.scheduler.preemption.boost_stricter`). Policies call this at the top of
        ``schedule``; it costs one pass over the waiting queue only while something waits and the
        cap or the pool is short."""
        if preemption.boost_stricter(self.waiting, self.running, self.config.max_num_seqs, self.bm, self.make_room):
            self.waiting.sort(key=self.queue_key)

    def make_room(self, req: Request, fits: Callable[[], bool], cause: str, protected: set[str] = frozenset(),
                  need_blocks: int | None = None) -> bool:
        """:func:`laser.scheduler.preemption.make_room` over this scheduler's running requests:
        preempt looser classes than ``req`` (none in ``protected``) until ``fits()``; returns it."""
        return preemption.make_room(req, fits, self.running, self.preempt, self.bm, self.queue_key, cause, protected,
                                    need_blocks)

    def preempt_for_decode(self, needed: list[Request]) -> list[Request]:
        """One more decode block for each of ``needed`` (priority order); returns those that got it.
        From the first one short of a block on, :func:`laser.scheduler.preemption.preempt_for_decode`
        preempts victims for them (while every block fits, nobody is preempted)."""
        for i, req in enumerate(needed):
            if not (self.bm.covers(req.req_id, req.num_tokens) or self.try_allocate(req, req.num_tokens)):
                rest = preemption.preempt_for_decode(needed[i:], self.running, self.preempt, self.bm,
                                                     self.try_allocate, self.queue_key)
                live = set(map(id, self.running))  # a request that got its block may have been a victim since
                return [r for r in needed[:i] if id(r) in live] + rest
        return list(needed)

    # -- after a step ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, stopped_layer: int, sampled: dict[str, int], now: float,
               exit_layers: dict[str, int] | None = None) -> list[Request]:
        """Record progress of every work; return requests that got a new token.

        A work that reached the last layer completes its tokens; one that stopped
        earlier (``stopped_layer``, see :meth:`~laser.core.plan.Work.reached`) or ends before the
        last layer stays in flight at the layer it reached. ``exit_layers`` (req_id -> layer):
        decode tokens of dynamic-depth requests that left the model early (their K/V filled at
        every later layer: they count as complete; :meth:`laser.core.depth.DepthMeans.record`).
        """
        n = self.num_layers
        out = []
        get = self.requests.get
        bs = self.bm.block_size
        cache = self.bm.cache_blocks if self.bm.enable_prefix_caching else None
        for w in plan.works:
            req = get(w.req_id)
            if req is None:  # aborted while the step ran
                continue
            reached = w.reached(stopped_layer)
            if req.sampling_params.dynamic_depth is not None and w.num_tokens == 1 and req.output_token_ids:
                exited = exit_layers.get(w.req_id) if exit_layers else None
                if exited is not None:
                    reached = n
                    w = Work(w.req_id, w.token_start, 1, w.layer_start, n, True, w.masked)
                if reached == n:
                    self.depth_means.record(req, n if exited is None else exited)
            if reached == n:
                req.num_computed_tokens = w.context_len
                req.chunk_tokens = 0
                req.next_layer = 0
                if w.context_len // bs > w.token_start // bs and cache:
                    # a block is full at every layer now: publish it (laser.core.block_manager)
                    cache(w.req_id, self.bm.block_hashes(req.block_hashes, req.all_token_ids), w.context_len)
                if w.sample:
                    req.output_token_ids.append(sampled[w.req_id])
                    times, tbt = req.token_times, req.slo.tbt
                    if times and tbt is not None and now - times[-1] > tbt + SLO_EPS:  # (as laser.core.metrics)
                        req.num_tbt_misses += 1
                    times.append(now)
                    req.phase = Phase.DECODE
                    out.append(req)
            elif reached > w.layer_start:
                req.chunk_tokens = w.num_tokens
                req.next_layer = reached
        self.step_index += 1
        self.enforce_icache_capacity()
        return out

    def append_token(self, req: Request, token: int, now: float) -> None:
        """Record one more decoded token of ``req`` in the step :meth:`update` just recorded
        (a self-speculative step emits several; laser.spec): its input position is computed
        (its KV written by the step), the token is ``req``'s newest, produced at ``now``."""
        req.num_computed_tokens += 1
        req.output_token_ids.append(token)
        req.token_times.append(now)

    def strictness(self, req: Request) -> float:
        """Smaller = stricter. Decode-phase requests by TBT target, others by TTFT target."""
        if req.phase == Phase.DECODE:
            return req.slo.tbt_or_inf
        return req.slo.ttft_or_inf

    def enforce_icache_capacity(self) -> None:
        """Evict the least strict paused requests until the intermediate cache fits (recompute later)."""
        while self.icache.over_capacity:
            victim = max((self.requests[r] for r in self.icache.ids()), key=self.strictness)
            self.icache.evict(victim.req_id)
            self.count_recompute("icache_eviction", victim, victim.chunk_tokens)
            victim.chunk_tokens = 0
            victim.next_layer = 0

    def finish(self, req: Request, reason: str, now: float | None = None) -> None:
        """Mark finished (``reason``: stop/length/abort/handoff) and free all its state."""
        req.phase = Phase.ABORTED if reason == "abort" else Phase.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self.requests.pop(req.req_id, None)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req.req_id)
        self.icache.discard(req.req_id)
        self.on_finish(req)

    def on_finish(self, req: Request) -> None:
        """Hook for policies with per-request plans (Laser decode)."""

    def abort(self, req_id: str, now: float | None = None) -> Request | None:
        req = self.requests.get(req_id)
        if req is not None:
            self.finish(req, "abort", now)
        return req

    def check_integrity(self, expect_empty: bool = False) -> None:
        self.bm.check_integrity(expect_empty=expect_empty)
        self.icache.check_integrity(expect_empty=expect_empty)
        for r in self.running:
            if r.req_id not in self.requests:
                raise AssertionError(f"{r.req_id} running but not tracked")
        if expect_empty and self.requests:
            raise AssertionError(f"unfinished requests remain: {list(self.requests)[:10]}")

    # -- the one picture read outside the scheduler package ----------------------------------------
    def report(self, now: float | None = None, pending: list[Request] = ()) -> SchedulerReport:
        """The :class:`SchedulerReport` of this scheduler at ``now`` (default: its clock); call on
        the thread that owns it. Admission, the instance reports and the metrics read this, never
        its attributes.

        ``pending``: requests delivered to the instance but not yet added here (they queue for prefill too).
        ``counters`` holds copies of the observability state: ``preemptions`` {(cause, class): n},
        ``recomputes`` {(kind, class): n}, ``recomputed_tokens`` {(kind, class): tokens}, ``icache_tokens`` /
        ``icache_capacity`` (tokens), ``icache_evictions`` (total), ``layer_stops`` (Laser's stops at a layer
        boundary), ``latency_calibration`` / ``latency_calibration_decode`` (the factors the planning model's
        prefill / decode layer calls are scaled by; :mod:`laser.latency.calibrated`), ``latency_timing_spread``
        (the model's ``timing_spread()``), ``running`` / ``waiting`` {class: n}, ``prefix_cache_queries`` /
        ``prefix_cache_hits`` (prompt tokens looked up / found cached at first admissions),
        ``prefix_cache_refound`` (tokens preempted requests found again of their own),
        ``prefix_cache_evictions`` (cached blocks evicted)."""
        lm = self.latency_model
        icache = self.icache
        counters = {
            "preemptions": dict(self.preemptions),
            "recomputes": dict(self.recomputes),
            "recomputed_tokens": dict(self.recomputed_tokens),
            "icache_tokens": icache.used_tokens,
            "icache_capacity": icache.capacity_tokens,
            "icache_evictions": icache.num_evictions,
            # the online calibration factors of the model the scheduler plans with (1.0 without one): prefill, decode
            "latency_calibration": float(getattr(lm, "factor", 1.0)),
            "latency_calibration_decode": float(getattr(lm, "decode_factor", getattr(lm, "factor", 1.0))),
            # ... and the spread of its slow steps that divides Laser's planning margins (1.0 without one)
            "latency_timing_spread": float(lm.timing_spread() if hasattr(lm, "timing_spread") else 1.0),
            # prefix cache, tokens (vLLM's prefix_cache_queries / _hits) and blocks evicted
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_refound": self.prefix_cache_refound,
            "prefix_cache_evictions": self.bm.num_evictions,
        }
        return take_report(self.name, self.config, self.clock() if now is None else now, bool(self.requests),
                           self.running, self.waiting, pending, self.queue_key, self.planning_report(), counters)

    def planning_report(self) -> dict:
        """A policy's own :class:`SchedulerReport` fields (layer-level decode planning), by name;
        ``layer_stops``: its stops at a layer boundary. None for iteration-level policies."""
        return {}

    def decode_state(self) -> tuple:
        """Alg. 1's live state: (iteration, decode plans by id, fraction of T_g planned to, price memo,
        best-effort share); iteration-level policies: (0, {}, 1.0, None, 1.0). For
        :meth:`latency_increment` and migration (priced as the scheduler runs its iterations)."""
        return 0, {}, 1.0, None, 1.0

    def latency_increment(self, latency_model, joining: list, candidate):
        """Alg. 2 lines 1-9 (:func:`laser.scheduler.laser.increment.latency_increment`) of
        ``candidate`` (a :class:`~laser.scheduler.laser.decode.DecodeCandidate`) joining the
        decoding requests plus ``joining`` (requests or candidates on their way: hand-offs,
        reservations), priced with ``latency_model`` from this scheduler's Alg. 1 state.
        Changes nothing."""
        from .laser.increment import latency_increment

        iteration, plans, margin, memo, share = self.decode_state()
        return latency_increment(latency_model, self.num_layers, iteration, self.decoding() + list(joining), plans,
                                 candidate, margin, memo, share)

    def migration_victim(self, latency_model, exclude=frozenset()) -> tuple[Request, str] | None:
        """:func:`laser.scheduler.migration.migration_victim` of this (decode) scheduler."""
        from .migration import migration_victim

        return migration_victim(self, latency_model, self.num_layers, exclude)


def prefill_left(req: Request) -> int:
    """Tokens of ``req`` still to prefill (prompt, plus outputs after a recompute preemption; a
    chunk in flight is not counted); 0 in the decode phase."""
    if req.phase == Phase.DECODE:
        return 0
    return req.num_tokens - req.num_computed_tokens - req.chunk_tokens
