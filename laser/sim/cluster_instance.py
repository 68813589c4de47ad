"""A simulated instance of a cluster: :class:`~laser.sim.SimInstance` behind the
controller's :class:`~laser.instance.Instance` interface.

Torch-free. The real scheduler of the instance's policy runs on a latency model (the
virtual clock). The cluster simulator drives it in two halves per step: :meth:`begin`
schedules at the step's start (so reports and increments between start and end see the
state a real instance would have mid-step) and :meth:`complete` executes the plan layer by
layer when the global clock reaches its predicted end, releasing the requests delivered
meanwhile at the layer boundary after their delivery time (Laser's §6.1 stop can then
end the step early; the instance then runs on from its own, earlier, clock).

Deliveries carry their delivery time: a prefill-side request joins the EDF queue; a
decode-side request arrives with its KV (``num_computed_tokens`` tokens at every layer)
and joins decoding once the KV pool holds it (as ``Engine.accept_handoff``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

from ..core.config import SchedulerConfig
from ..instance.core import Handoff
from ..instance.interface import ROLES, Instance
from ..instance.messages import InstanceReport, LatencyIncrement, MigrationCandidate, RequestInfo
from ..instance.state import build_report, decode_increment, migration_candidate
from ..core.request import Request
from .instance import SimInstance


@dataclass
class Output:
    """What a step produced: a request that finished here (``kind`` "finished") or left
    for decode (``kind`` "handoff", with its prefill start time for the KV-transfer model)."""

    kind: str
    req: Request
    time: float
    prefill_start: float = 0.0
    handoff: Handoff | None = None  # kind "handoff": what the decode instance adopts


class _Node(SimInstance):
    """SimInstance releasing deliveries at their delivery time (not the request's arrival): a
    request joins the EDF queue; a :class:`~laser.instance.core.Handoff` joins the adopt queue
    (:attr:`adopts`, adopted by the core's :meth:`~laser.instance.core.InstanceCore.adopt` in
    order once the KV pool holds it)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.deliveries: list[tuple[float, int, Request]] = []  # heap by delivery time
        self._seq = itertools.count()

    def deliver(self, item: Request | Handoff, at: float) -> None:
        if isinstance(item, Handoff):
            self.adopts.deliver(item, at)
        else:
            heapq.heappush(self.deliveries, (at, next(self._seq), item))

    def _release(self) -> None:
        t = self.clock.t
        while self.deliveries and self.deliveries[0][0] <= t:
            self.add_request(heapq.heappop(self.deliveries)[2])
        self.adopts.adopt_ready(self.adopt, t)

    def next_release(self) -> float:
        """Delivery time of the next request or hand-off not yet released (inf when none)."""
        return min(self.deliveries[0][0] if self.deliveries else math.inf, self.adopts.next_due())

    def adopting(self) -> list[Request]:
        """Hand-offs on their way here or waiting for KV blocks (their prefill-side requests)."""
        return self.adopts.requests()

    def queued(self) -> list[Request]:
        """Requests delivered later to this instance's prefill queue."""
        return [d[2] for d in self.deliveries]


class SimClusterInstance(Instance):
    """One simulated instance (``role`` prefill | decode | mixed) running ``policy``.

    Args:
        instance_id: unique id. policy: scheduler name. latency_model: the clock and the
        planning model. num_blocks / block_size: KV pool per layer. icache_tokens:
        intermediate cache (paper: 16,384 prefill, 2,048 decode). node: host index (KV
        transfer is intra-node when P and D share it). config: scheduler knobs.
        enable_prefix_caching: model the prefix cache (off by default: dummy token ids).
    """

    def __init__(self, instance_id: int, role: str, policy: str, latency_model, num_blocks: int,
                 block_size: int = 16, icache_tokens: int = 16384, node: int = 0,
                 config: SchedulerConfig | None = None, enable_prefix_caching: bool = False):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        cfg = SchedulerConfig(**{**(config or SchedulerConfig()).__dict__, "policy": policy, "role": role})
        self.instance_id, self.role, self.policy, self.node = instance_id, role, policy, node
        self.latency_model = latency_model
        self.num_layers = latency_model.num_layers
        self.sim = _Node(policy, self.num_layers, latency_model, cfg, num_blocks=num_blocks,
                         block_size=block_size, icache_tokens=icache_tokens,
                         enable_prefix_caching=enable_prefix_caching)
        self.plan = None  # the step in flight
        self.plan_end = 0.0
        self.reserved: dict[str, RequestInfo] = {}
        self.prefill_start: dict[str, float] = {}
        self._done = 0  # index into sim.finished already reported
        self.steps_begun = 0
        self.migrated_out = 0
        # Bumped by every method below that changes what a report says (the scheduler's queues
        # and KV pool, the deliveries, the reservations, the step in flight): ``report`` answers
        # from its last report while the version and the clock are unchanged.
        self._version = 0
        self._report: tuple[tuple[int, float], InstanceReport] | None = None

    # -- Instance interface --------------------------------------------------------------
    @property
    def scheduler(self):
        return self.sim.scheduler

    @property
    def clock(self) -> float:
        return self.sim.clock.t

    def add_request(self, req: Request | Handoff, at: float) -> None:
        """Deliver a request (prefill side) or a hand-off with its KV (decode side) at ``at``."""
        rid = req.request.req_id if isinstance(req, Handoff) else req.req_id
        self._version += 1
        self.reserved.pop(rid, None)
        self.sim.deliver(req, at)

    def abort(self, req_id: str, at: float) -> bool:
        self._version += 1
        self.reserved.pop(req_id, None)
        before = len(self.sim.deliveries)
        self.sim.deliveries = [d for d in self.sim.deliveries if d[2].req_id != req_id]
        heapq.heapify(self.sim.deliveries)
        dropped = self.sim.adopts.drop(req_id) or before != len(self.sim.deliveries)
        return self.scheduler.abort(req_id, at) is not None or dropped

    def reserve(self, info: RequestInfo) -> None:
        self._version += 1
        self.reserved[info.req_id] = info

    def release(self, req_id: str) -> None:
        self._version += 1
        self.reserved.pop(req_id, None)

    def report(self) -> InstanceReport:
        """The instance's :class:`InstanceReport` (:func:`build_report`); the same (frozen) object
        again while nothing it reads changed (every arrival asks every prefill instance)."""
        key = (self._version, self.clock)
        if self._report is not None and self._report[0] == key:
            return self._report[1]
        busy_until = self.plan_end if self.plan is not None else self.clock
        rep = build_report(self.instance_id, self.role, self.scheduler, self.sim.bm, self.sim.icache, self.clock,
                           busy_until, self.sim.queued(), self.sim.adopting(), len(self.reserved))
        self._report = (key, rep)
        return rep

    def latency_increment(self, info: RequestInfo) -> LatencyIncrement:
        """Alg. 2 lines 1-9 (:func:`laser.instance.state.decode_increment`) over the decoding
        requests, the hand-offs on their way and the reservations."""
        return decode_increment(self.instance_id, self.scheduler, self.sim.bm, self.latency_model, info,
                                self.sim.adopting(), self.reserved)

    def migration_candidate(self, expected_output: dict[str, float]) -> MigrationCandidate | None:
        """Decode role, between steps (:func:`laser.instance.state.migration_candidate`)."""
        if self.role != "decode" or self.plan is not None:
            return None
        return migration_candidate(self.instance_id, self.scheduler, self.sim.bm, self.latency_model, expected_output)

    def migrate_out(self, req_id: str) -> Handoff:
        """Export a decoding request for another decode instance, between steps: its KV leaves
        with it (freed here) and it continues there from its last token (the core's
        :meth:`~laser.instance.core.InstanceCore.export`). Raises KeyError if it is not decoding here."""
        if self.plan is not None:
            raise RuntimeError(f"instance {self.instance_id}: migrate_out during a step")
        req = self.scheduler.get_request(req_id)
        if req is None or req not in self.scheduler.decoding():
            raise KeyError(f"{req_id} is not decoding on instance {self.instance_id}")
        self.migrated_out += 1
        self._version += 1
        return self.sim.export(req, self.clock)

    # -- driven by the cluster simulator ------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self.sim.adopts.num_waiting() > 0

    def next_delivery(self) -> float:
        return self.sim.next_release()

    def begin(self, now: float) -> float | None:
        """Start the next step at ``max(own clock, now)``; its predicted end (s), or None when
        idle (nothing runnable until a delivery)."""
        if self.plan is not None:
            raise RuntimeError(f"instance {self.instance_id}: a step is already in flight")
        sim = self.sim
        self._version += 1
        sim.clock.t = max(sim.clock.t, now)
        sim._release()
        if not self.has_work():
            return None
        plan = sim.begin_step()
        if not plan:
            return None
        t = sim.clock.t
        for w in plan.works:
            if w.layer_start == 0 and w.token_start == 0 and w.req_id not in self.prefill_start:
                self.prefill_start[w.req_id] = t
        self.plan = plan
        self.plan_start = t
        self.plan_end = t + self.latency_model.predict_iteration(plan)
        self.steps_begun += 1
        return self.plan_end

    def complete(self) -> list[Output]:
        """Execute the step in flight (deliveries up to now are known); what it produced."""
        plan, self.plan = self.plan, None
        self._version += 1
        sim = self.sim
        sim.clock.t = self.plan_start
        sim.finish_step(plan)
        t = sim.clock.t
        out = [Output("finished", r, r.finish_time) for r in sim.finished[self._done:]]
        self._done = len(sim.finished)
        for h in sim.handoffs:  # prefill role: the core handed these off after their first token
            out.append(Output("handoff", h.request, h.time, self.prefill_start.get(h.request.req_id, t), h))
        sim.handoffs.clear()
        for o in out:
            self.prefill_start.pop(o.req.req_id, None)
        return out

    def check_integrity(self, expect_empty: bool = False) -> None:
        self.scheduler.check_integrity(expect_empty=expect_empty)
        if expect_empty and (self.sim.deliveries or self.sim.adopts or self.reserved):
            raise AssertionError(f"instance {self.instance_id}: deliveries or reservations remain")
