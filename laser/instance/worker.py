"""The body of a real instance behind the controller: one :class:`ModelInstance` (model, KV
pool, scheduler, :class:`~laser.instance.core.InstanceCore`), token ids in, token events out.

It has no tokenizer, detokenizer or stop strings: the front end
(:class:`laser.cluster.engine.ClusterEngine`) keeps those. It runs in the front-end process
(:class:`laser.cluster.handles.LocalHandle`) or as a Ray actor
(:mod:`laser.cluster.ray_actors`), where several calls may arrive while a step runs:

* ``step`` runs one scheduling step and holds the instance's lock for it;
* the controller's questions and arrivals (``add_request``, ``report``,
  ``latency_increment``, ``reserve``, ``release``) and the hand-off's prefill side
  (``take_handoff``, ``confirm``: they touch only the outbox, which a step fills after it ends)
  are queued and run by the stepping thread at the next layer boundary (the core's
  ``arrival_hook``), so they answer within one layer call -- a hand-off never waits for the
  next request's long prefill step, and neither do the decode tokens after it;
* state changes that must not happen mid-step (``abort``, ``adopt``) run between steps.

As an actor (``own_thread``) the model is built on a thread of its own, which runs every step and
every queued command -- all of the instance's torch work, one OpenMP team; the actor's threads
only queue and wait, and calls that touch no instance state (``ping``, ``fence_epoch``,
``receive_kv_layer``, ``describe``) answer on them at once.

The prefill -> decode hand-off (CONTROLLER.md A8, C3), instance to instance
(:mod:`laser.instance.handoff` keeps its state): the decode instance is chosen when the request
is routed and comes with it (``add_request(req, route)``). The prefill instance streams the
request's K/V there layer by layer while its final chunk runs (the decode side's
:class:`~laser.instance.kv_stream.InboundKV` writes each layer into blocks it allocates); after
the first token it keeps the exported request in its outbox and hands it over itself
(``route.peer.adopt``: without the KV when it was streamed); the decode instance adopts it
(in order, when its KV fits), calls the sender's ``confirm`` -- the prefill instance drops its
copy only then, so a decode instance that dies mid-transfer costs a re-send, not a re-prefill
-- and reports the adoption in its next step answer, which is how the front end learns it.
A request without a route (no decode instance chosen at routing, the chosen one died, a
decode -> decode migration) is pulled by the front end: ``adopt(take_handoff(id, dst))``, then
``confirm``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
import uuid

from ..core.block_manager import OutOfBlocksError
from ..core.request import Request
from ..model.structured import GrammarBackend
from .core import Handoff
from .handoff import AdoptQueue, DirectRoute, Outbox
from .kv_stream import InboundKV
from .messages import InstanceReport, LatencyIncrement, RequestInfo
from .model_instance import ModelInstance
from .state import build_report, decode_increment, migration_candidate


#: Seconds a step with nothing to run waits for a hand-off or a streamed layer to arrive.
IDLE_STEP_WAIT_S = 0.002
#: Seconds an idle instance's integrity check waits for the confirms of its direct hand-offs.
CONFIRM_WAIT_S = 1.0


class InstanceWorker:
    """One instance (``role`` prefill | decode | mixed) over a real model.

    Args:
        instance_id: unique id in the cluster. role: the instance role.
        engine_kwargs: :class:`ModelInstance` arguments (model path, policy, dtype, cache,
            scheduler config, latency_profile, seed, max_model_len, extra_eos_ids, speculative,
            exits); the scheduler config's role is set to ``role`` (a prefill instance does not
            speculate: it makes no decode token).
        threads: torch intra-op threads of this instance (None: torch's default).
        own_thread: build the model on a thread of its own (:class:`~laser.core.owner_thread.OwnerThread`)
            that then runs all of this instance's torch work -- every step and every queued
            command; the calling threads only queue and wait. For an instance actor, whose calls
            arrive on several threads: torch work on a thread other than the builder's starts a
            second OpenMP team, and with 2 threads on 2 busy cores a batch-1 decode step took ~4x
            as long (docs/benchmarks.md, issue 26). False (in process): built on the caller's
            thread and run on the threads that call it, as the front end that owns them does.
    """

    def __init__(self, instance_id: int, role: str, engine_kwargs: dict, threads: int | None = None,
                 own_thread: bool = False):
        from ..core.config import SchedulerConfig
        from ..core.owner_thread import OwnerThread

        kw = dict(engine_kwargs)
        sched = kw.pop("scheduler", None) or SchedulerConfig(policy=kw.get("policy", "laser"))
        kw["scheduler"] = dataclasses.replace(sched, role=role)
        if role == "prefill":  # self-speculation drafts decode tokens: a prefill instance makes one
            kw.pop("speculative", None)
        self.instance_id = instance_id
        self.role = role
        self.boot_id = uuid.uuid4().hex  # a new process (an actor its host restarted) has a new one

        def build() -> ModelInstance:
            import torch

            if threads:
                torch.set_num_threads(threads)
            self.owner_ident = threading.get_ident()  # the thread that built the model (and steps it)
            return ModelInstance(**kw)

        self._owner = OwnerThread(build, name=f"laser-instance-{instance_id}") if own_thread else None
        self.mi = self._owner.engine() if own_thread else build()
        self._bm = self.mi.kv_cache.block_manager  # this instance's KV pool (its scheduler allocates in it)
        self.core = self.mi.core
        # structured output's masks: the tokenizer (and llguidance's form of it) is loaded when the
        # first structured request arrives; a request's matcher follows its tokens, so a hand-off
        # or a re-prefill carries nothing more (laser.model.structured)
        self.grammars = self.mi.runner.sampler.grammars = GrammarBackend(
            self.mi.model_path, self.mi.model_config.vocab_size, self.core.eos_ids)
        self.latency_model = self.mi.latency_model
        self.num_layers = self.mi.model_config.num_layers
        self.reserved: dict[str, RequestInfo] = {}
        self.outbox = Outbox()  # prefill side: exported, kept until the decode instance confirms
        self.inbound = InboundKV(self.mi.kv_cache, self.num_layers)  # decode side: streamed layers
        # decode side: adopted in order when the KV fits; its fences refuse a hand-off of an attempt
        # given up on (abort) and a step or hand-off of an epoch older than the front end's (reset)
        self.adopts = AdoptQueue()
        self._lock = threading.Lock()
        self._at_boundary: collections.deque = collections.deque()
        self._between: collections.deque = collections.deque()
        self._stall_s = 0.0
        self._busy_until = 0.0
        # decode side: direct hand-offs taken since the last step answer, (req id, attempt,
        # adopt's answer or None, the refusal or None): the front end learns the outcome from them
        self._adoptions: list[tuple] = []
        self._wake = threading.Event()  # set by an arriving hand-off or layer (an idle step waits for one)
        self.core.arrival_hook = self._drain_boundary

    def describe(self) -> dict:
        """Static facts the front end and the controller need (picklable)."""
        bm = self._bm
        return dict(instance_id=self.instance_id, role=self.role, latency_model=self.latency_model,
                    num_layers=self.num_layers, max_model_len=self.mi.max_model_len,
                    total_blocks=bm.num_blocks, block_size=bm.block_size, policy=self.core.scheduler.report().policy,
                    boot_id=self.boot_id, serves_exits=self.mi.serves_exits)

    # -- command plumbing --------------------------------------------------------------------------
    def _drain(self, q: collections.deque) -> None:
        while q:
            fn, fut = q.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets it
                fut.set_exception(e)

    def _drain_boundary(self) -> None:
        if self._at_boundary:
            self._drain(self._at_boundary)
        self.inbound.drain()

    def _drain_commands(self) -> None:
        self._drain(self._at_boundary)
        self._drain(self._between)

    def _call(self, fn, at_boundary: bool):
        """Run ``fn`` on this instance's state: by the stepping thread at its next layer boundary
        (``at_boundary``) or after its step, else at once when no step runs -- on the owner thread
        (``own_thread``), else on this thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        (self._at_boundary if at_boundary else self._between).append((fn, fut))
        if self._owner is not None:  # a step in flight drains it first; else this job does
            if threading.get_ident() == self._owner.thread.ident:
                self._drain_commands()
            else:
                self._owner.submit(self._drain_commands)
            return fut.result()
        while not fut.done():
            if self._lock.acquire(timeout=0.002):
                try:
                    self._drain_commands()
                finally:
                    self._lock.release()
        return fut.result()

    # -- the Instance interface (controller side) --------------------------------------------------------
    def add_request(self, req: Request, route: DirectRoute | None = None) -> None:
        """Queue ``req`` for prefill (a recovered request carries its output so far and is
        re-prefilled: prompt + output). ``route``: the decode instance chosen for it -- with a
        ``stream_key``, send each layer of its final prefill chunk there (``route.peer.send``) as
        soon as it is written; after its first token hand it there directly
        (``route.peer.adopt``, see :meth:`step`). A copy of an earlier attempt still kept in the
        outbox (its decode instance died before any confirm arrived) is dropped with its route, so
        a late confirm of that attempt cannot take the new attempt's. Raises ValueError on a
        duplicate id."""
        def add():
            self.reserved.pop(req.req_id, None)
            self.core.add_request(req)
            self.outbox.drop(req.req_id)
            if req.sampling_params.structured_output is not None:
                self.grammars.prepare()
            if route is not None:
                rid, peer, key = req.req_id, route.peer, route.stream_key
                self.outbox.route(rid, route)
                if key is not None:
                    self.mi.runner.kv_streams[rid] = lambda layer, k, v: peer.send(rid, key, layer, k, v)
        return self._call(add, True)

    def abort(self, req_id: str, fence: int | None = None) -> bool:
        """Drop the request (queued, running, waiting for blocks, in the outbox, or reserved).
        ``fence``: the front end re-prefills it as attempt ``fence``; a hand-off of an earlier
        attempt that reaches :meth:`adopt` later (it waited for its sender) is refused."""
        def abort():
            found = self.reserved.pop(req_id, None) is not None
            found |= self.outbox.drop(req_id)
            found |= self.inbound.drop(req_id)
            found |= self.adopts.drop(req_id, fence)
            return self.core.abort(req_id) is not None or found
        return self._call(abort, False)

    def report(self) -> InstanceReport:
        return self._call(self._report, True)

    def _report(self) -> InstanceReport:
        now = self.core.clock()
        return build_report(self.instance_id, self.role, self.core.scheduler, self._bm, self.mi.icache, now,
                            max(now, self._busy_until), (), self.adopts.requests(),
                            len(self.reserved))

    def latency_increment(self, info: RequestInfo) -> LatencyIncrement:
        return self._call(lambda: decode_increment(self.instance_id, self.core.scheduler, self._bm,
                                                   self.latency_model, info, self.adopts.requests(),
                                                   self.reserved), True)

    def reserve(self, info: RequestInfo) -> None:
        self._call(lambda: self.reserved.__setitem__(info.req_id, info), True)

    def release(self, req_id: str) -> None:
        """Cancel ``req_id``'s reservation here (a KV stream it expects stays: the controller may
        pick this instance again at the hand-off; :meth:`abort` drops both)."""
        self._call(lambda: self.reserved.pop(req_id, None), True)

    # -- decode -> decode migration (CONTROLLER.md A8.4, D9) --------------------------------------------------
    def migration_candidate(self, expected_output: dict[str, float]):
        """Decode role, between steps: the request that must leave (KV memory or T_g broke;
        :func:`laser.instance.state.migration_candidate`), None when none must."""
        if self.role != "decode":
            return None
        return self._call(lambda: migration_candidate(self.instance_id, self.core.scheduler, self._bm,
                                                      self.latency_model, expected_output), False)

    def migrate_out(self, req_id: str) -> None:
        """Decode role, between steps: export a decoding request (its KV, freed here) into the outbox; :meth:`take_handoff` / ``adopt`` / :meth:`confirm` move it
        like a hand-off and it continues there from its last token. Raises KeyError if it is not
        decoding here."""
        def out():
            sched = self.core.scheduler
            req = sched.get_request(req_id)
            if req is None or req not in sched.decoding():
                raise KeyError(f"{req_id} is not decoding on instance {self.instance_id}")
            self.outbox.put(self.core.export(req, self.core.clock()))
        self._call(out, False)

    # -- per-layer KV streaming (decode side) -------------------------------------------------------------
    def expect_kv(self, req_id: str, key) -> None:
        """Accept the layers of stream ``(req_id, key)`` (sent before its hand-off)."""
        self._call(lambda: self.inbound.expect(req_id, key), True)

    def receive_kv_layer(self, req_id: str, key, layer: int, k, v) -> None:
        """One streamed layer (K, V ``[T, kv_heads, head_dim]``, tensors or arrays). Answers at
        once from any thread; the stepping thread writes it at its next layer boundary."""
        self.inbound.receive(req_id, key, layer, k, v)
        self._wake.set()

    # -- hand-off ----------------------------------------------------------------------------------------
    def take_handoff(self, req_id: str, dst: int | None = None) -> tuple[Handoff, float]:
        """Prefill side: the exported request (kept until :meth:`confirm`) and the wall time
        (``time.time()``, s) it was sent; without its KV (``kv=None``) when every layer was
        already streamed to instance ``dst``. Raises KeyError when it is not in the outbox."""
        return self._call(lambda: (self.outbox.take(req_id, dst), time.time()), True)

    def confirm(self, req_id: str, attempt: int | None = None) -> None:
        """Prefill side: the decode instance holds ``req_id``'s KV; drop the exported copy
        (``attempt``: a direct hand-off's, see :meth:`Outbox.confirm`)."""
        self._call(lambda: self.outbox.confirm(req_id, attempt), True)

    def adopt(self, sent: tuple[Handoff, float], attempt: int = 0, epoch: int | None = None, reply=None) -> dict:
        """Decode side: continue a request prefilled elsewhere (``sent``: from :meth:`take_handoff`,
        or sent directly by the prefill instance, see :meth:`step`). Waits in order for KV blocks
        when the pool is full.
        A hand-off without KV (streamed) takes its layers from :attr:`inbound` and waits until
        all have arrived. Returns ``{"bytes": KV bytes, "seconds": send -> adopt (wall clock),
        "after_prefill_s": prefill end -> adopt (the shared host clock), "layers", "streamed"}``;
        the two times count until the request runs here, or until it queues for blocks or for
        streamed layers still on their way. ``attempt``: the front end's attempt number of the
        request (re-prefills count up); ``epoch``: the front end's epoch of this instance when it
        sent the hand-off. Raises KeyError for a stream this instance does not expect (aborted), a
        stale attempt (fenced by :meth:`abort`) or a stale epoch (fenced by :meth:`reset`).

        ``reply``: a direct hand-off (nobody waits for this answer): the sender's channel, whose
        ``confirm`` is called once the request is held here; the answer or the refusal goes to the
        front end in the next :meth:`step` answer (``"adopted"``) and this returns the answer, or
        None when refused (it raises nothing)."""
        h, sent_at = sent
        rid = h.request.req_id

        def adopt():
            self.adopts.fences.check(rid, attempt, epoch)
            self.reserved.pop(rid, None)
            streamed = h.kv is None
            if streamed:
                self.inbound.drain()
                nbytes = sum(k.nbytes + v.nbytes for k, v in self.inbound.streams[rid].pieces.values())
            else:
                nbytes = sum(k.nbytes + v.nbytes for k, v in h.kv)
            if h.request.sampling_params.structured_output is not None:
                self.grammars.prepare()
            self.adopts.deliver(h, attempt=attempt, epoch=epoch)
            self.adopts.adopt_ready(self._adopt_one)
            return {"bytes": nbytes, "seconds": time.time() - sent_at, "after_prefill_s": self.core.clock() - h.time,
                    "layers": self.num_layers, "streamed": streamed}
        if reply is None:
            return self._call(adopt, False)
        try:
            m = self._call(lambda: self._log_adoption(rid, attempt, adopt), False)
        except KeyError:
            return None  # (logged for the front end)
        finally:
            self._wake.set()
        reply.confirm(rid, attempt)  # (outside this instance's lock: in process the sender's step called this)
        return m

    def _log_adoption(self, rid: str, attempt: int, adopt) -> dict:
        """Run ``adopt`` and record its answer or refusal for the front end (:meth:`step`)."""
        try:
            m = adopt()
        except KeyError as e:
            self._adoptions.append((rid, attempt, None, str(e)))
            raise
        self._adoptions.append((rid, attempt, m, None))
        return m

    def _adopt_one(self, h: Handoff) -> Request | None:
        """Adopt ``h`` now (the queue's ``adopt``): None while its streamed layers have not all
        arrived; raises OutOfBlocksError (nothing kept) when its KV does not fit."""
        rid = h.request.req_id
        if h.kv is None:
            if not self.inbound.complete(rid):
                return None
            h = dataclasses.replace(h, kv=self.inbound.kv_for_adopt(rid))
        try:
            req = self.core.adopt(h)
        except OutOfBlocksError:
            self.inbound.import_failed(rid)
            raise
        self.inbound.adopted(rid)
        return req

    # -- the loop ----------------------------------------------------------------------------------------
    def step(self, epoch: int | None = None) -> dict:
        """One scheduling step. Returns ``{"events": [(req_id, token, finish_reason,
        handed_off, cached prompt tokens, the token's TokenLogprob or None, the complete prompt
        logprobs or None, dynamic-depth totals or None), one per token (a self-speculative step
        gives a request several): see :meth:`~laser.instance.core.TokenEvent.wire`], "adopted": direct hand-offs
        taken since the last answer (``(req_id, attempt, adopt's answer or None, refusal or None)``,
        see :meth:`adopt`), "busy": more work left, "step_s": seconds, "report": the instance's
        :class:`InstanceReport` after it (the front end's per-instance gauges)}``. Handed-off requests
        wait in the outbox (for :meth:`take_handoff`, or :meth:`confirm`); one with a route
        (:meth:`add_request`) is sent to its decode instance after the step, by this call.
        ``epoch``: the front end's epoch of this instance when it asked; a step of an older epoch
        (asked before the instance was fenced by :meth:`reset`) runs nothing and answers no events, not busy, ``"fenced": True``.
        With nothing to run, it first waits up to ``IDLE_STEP_WAIT_S`` for a hand-off or layer to
        arrive (the front end steps a decode instance a hand-off is on its way to)."""
        if self.adopts.fences.stale_epoch(epoch):
            return {"events": [], "adopted": [], "busy": False, "step_s": 0.0, "report": None, "fenced": True}
        if not self.has_work():
            self._wake.wait(IDLE_STEP_WAIT_S)
        self._wake.clear()
        res, sends = self._step() if self._owner is None else self._owner.call(self._step)
        for route, h in sends:  # straight to the decode instances chosen at routing (not under the lock)
            route.peer.adopt((h, time.time()), route.attempt, route.epoch, route.reply)
        return res

    def _step(self) -> tuple[dict, list]:
        """:meth:`step`'s body (on the owner thread, if any): its answer and the direct hand-offs
        to send."""
        with self._lock:
            return self._step_locked()

    def _step_locked(self) -> tuple[dict, list]:
        if self._stall_s:
            stall, self._stall_s = self._stall_s, 0.0
            time.sleep(stall)
        self._drain_commands()
        self.inbound.drain()
        self.adopts.adopt_ready(self._adopt_one)
        t0 = time.perf_counter()
        events = []
        if self.core.has_unfinished():
            # the report's busy_until: the step runs about as long as the last one
            self._busy_until = self.core.clock() + (self.core.scheduler.report().last_iteration_s or 0.0)
            for ev in self.core.step():
                events.extend(ev.wire())
                if ev.finish_reason is not None:
                    self.outbox.finished(ev.request.req_id)
            sends = [s for s in map(self.outbox.direct, self.core.handoffs) if s is not None]
            self.core.handoffs.clear()
        else:
            sends = []
        self._busy_until = 0.0
        self._drain_commands()
        adopted, self._adoptions = self._adoptions, []
        return {"events": events, "adopted": adopted, "busy": self.has_work(),
                "step_s": time.perf_counter() - t0, "report": self._report()}, sends

    def has_work(self) -> bool:
        return self.core.has_unfinished() or bool(self.adopts)

    def check_integrity(self, expect_empty: bool = False) -> None:
        """The core's check; when ``expect_empty`` also no outbox, waiting hand-off or reservation
        (a direct hand-off's ``confirm`` still on its way from the decode instance is waited for,
        up to ``CONFIRM_WAIT_S``). Raises AssertionError."""
        end = time.monotonic() + CONFIRM_WAIT_S
        while expect_empty and self.outbox and time.monotonic() < end:
            time.sleep(0.002)

        def check():
            self.core.check_integrity(expect_empty=expect_empty)
            out = self.outbox
            if expect_empty and (out or self.adopts or self.reserved or self.inbound.pending() or out.streamed_to):
                raise AssertionError(f"instance {self.instance_id}: outbox {sorted(out)}, "
                                     f"waiting {len(self.adopts)}, reserved {sorted(self.reserved)}, "
                                     f"streams in {sorted(self.inbound.streams)}, out {sorted(out.streamed_to)}")
        return self._call(check, False)

    def reset(self, epoch: int | None = None) -> int:
        """Drop every request and everything held for one (queued, running, outbox, reservations,
        streams): the instance rejoins a cluster empty after it was marked dead (a restarted
        actor is empty already; one that only missed a timeout is not). ``epoch``: the front
        end's new epoch of this instance (its fencing token, raised when it marked the instance
        dead): a step or adoption sent under an older one and run after this is refused, so a
        frozen instance that wakes holds nothing of the requests that moved away. Returns how
        many requests it dropped."""
        def reset():
            rids = (set(self.core.request_ids()) | set(self.outbox) | set(self.reserved)
                    | set(self.inbound.streams) | self.adopts.ids())
            for rid in rids:
                self.reserved.pop(rid, None)
                self.inbound.drop(rid)
                self.core.abort(rid)
            self.outbox.clear()
            self.adopts.reset(epoch)
            self._adoptions.clear()
            return len(rids)
        return self._call(reset, False)

    def inject_stall(self, seconds: float) -> None:
        """Fault injection (tests, chaos drills): the next step sleeps ``seconds`` holding the
        instance, so it answers nothing meanwhile -- a straggler the controller must detect."""
        self._stall_s = float(seconds)

    def fence_epoch(self) -> int:
        """Answers at once: this instance's epoch (its fencing token, see :meth:`reset`)."""
        return self.adopts.fences.epoch

    def ping(self) -> str:
        """This process's boot id (:meth:`describe`): the front end tells a restarted instance
        (empty, a new id) from one that only answered late."""
        return self.boot_id

    def set_role(self, role: str) -> list[str]:
        """Between steps: serve as ``role`` from now on. A prefill instance whose cluster lost
        every decode instance serves as ``mixed`` (its requests decode here, no hand-off) and
        back as ``prefill`` once a decode instance returns: then each request decoding here
        is exported into the outbox (its KV and sampler state, as :meth:`migrate_out`) and its
        id returned, for the front end to hand off; requests still prefilling hand off after
        their first token as usual. Raises ConfigError for an unknown role."""
        def switch():
            sched = self.core.scheduler
            sched.set_role(role)
            self.role = role
            if role != "prefill":
                return []
            now = self.core.clock()
            moved = [r for r in sched.decoding()]
            for r in moved:
                self.outbox.put(self.core.export(r, now))
            return [r.req_id for r in moved]
        return self._call(switch, False)

