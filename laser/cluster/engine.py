"""The front end of a cluster: many instances behind the global controller, one engine to a server.

:class:`ClusterEngine` has the methods :class:`~laser.frontend.async_engine.AsyncEngine` calls on an
:class:`~laser.frontend.engine.Engine` (``add_request``, ``abort``, ``step``, ``has_unfinished``,
``check_integrity``, ``clock``, tokenizer, SLO classes ...), so the same OpenAI server serves
a cluster. It keeps what a client needs -- the input and output paths
(:mod:`laser.frontend.inputs`, :mod:`laser.frontend.outputs`: validation, detokenization, stop
strings), each request's tokens and token times -- and sends only token ids to the instances (:class:`~laser.cluster.handles.InstanceHandle`: in process
or Ray actors).

Per request (PPoPP'26 §7, CONTROLLER.md D1): the controller routes it at arrival (prefill
instance, and on a disaggregated cluster the decode instance, which reserves room); while its
final prefill chunk runs, the prefill instance streams each finished layer's K/V straight to
that decode instance (``stream_kv``); after its first token the prefill instance hands the
request (and the KV, if not streamed there) to it by itself and the decode instance confirms
back -- the front end learns the adoption from the decode instance's step answer (:mod:`.transfers`).
A request without a live decode instance chosen at arrival (``distserve`` picks at the
hand-off; the chosen one died) is pulled by the front end instead: ``at_handoff``,
``adopt(take_handoff)`` instance to instance, then ``confirm``.

Failures (CONTROLLER.md A9, D10, C2, C6): every call has a timeout and every step a longer
one; an instance that dies or misses one is marked dead, the controller is re-attached to the
live ones (groups re-sized), and each of its requests resumes elsewhere: a hand-off still held
by a live prefill instance is re-sent to another decode instance, anything else is
re-prefilled from prompt + the tokens generated so far (kept here, so no token is streamed
twice) with its original arrival time and deadline. Greedy requests continue identically, and so
do seeded sampled ones (a draw's generator is a function of seed and position,
:func:`laser.model.sampler.draw_seed`); the response and ``/metrics`` say a request failed over.
While idle the instances are pinged, so a restarted one rejoins without a request; with no decode
instance left the prefill instances serve as mixed; a request that finds a needed role gone
waits, bounded, for it to return, else fails with a 503-class error (:mod:`.availability`); a
lost Ray node is started again with its instances, or reported so the server exits (:mod:`.node`).

The jobs live in their own modules: hand-offs and migrations (:mod:`.transfers`), failure
recovery (:mod:`.recovery`), staying available (:mod:`.availability`), the lost node
(:mod:`.node`), the records
(:mod:`.state`), starting a cluster (:mod:`.launch`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Callable

from ..controller.base import Controller, prefill_load_key
from ..core.request import SLO, InvalidRequestError, Request, SamplingParams
from ..frontend.inputs import InputProcessor
from ..frontend.outputs import OutputProcessor, RequestOutput
from ..instance.handoff import DirectRoute
from ..instance.messages import RequestInfo
from .availability import Availability
from .handles import Call, InstanceFailure, InstanceHandle
from .node import NodeRestart
from .recovery import Recovery
from .state import ClusterError, ClusterStats, Tracked
from .transfers import Transfers

__all__ = ["ClusterEngine", "ClusterError", "ClusterStats"]


#: A decode step may run this many times the instance's slowest recent step before it counts as stalled.
STALL_FACTOR = 10.0
#: Per answered step, the remembered slowest step time decays by this factor (a slow spell is forgotten).
STALL_DECAY = 0.9


class ClusterEngine(Transfers, Recovery, Availability, NodeRestart):
    """Engine-like front end over ``handles`` driven by ``controller``.

    Args:
        handles: the instances (roles must fit the controller: prefill + decode, or mixed).
        controller: a :class:`~laser.controller.Controller` (not yet attached).
        tokenizer / model_config / model_name: the served model (front-end side only).
        slo_classes: the SLO class table. step_timeout_s: a step longer than this marks its
            instance dead (a stall). stall_timeout_s: a decode instance's step (one iteration)
            counts as stalled sooner: after this, or ``STALL_FACTOR`` times its slowest recent
            step if longer (at most ``step_timeout_s``; None: ``step_timeout_s``); a synchronous
            call to an instance never waits past its step's deadline either, so a frozen decode
            instance's requests move within this plus their re-prefill. clock: the cluster clock (seconds; instances on the same
            host share ``time.monotonic``). stream_kv: when the decode instance is chosen at
            arrival, stream the request's KV to it layer by layer during its final prefill
            chunk (False: all layers at the hand-off).
    """

    def __init__(self, handles: list[InstanceHandle], controller: Controller, tokenizer, model_config,
                 model_name: str, slo_classes, step_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, stream_kv: bool = True,
                 stall_timeout_s: float | None = None):
        self.stream_kv = stream_kv
        if not handles:
            raise ValueError("a cluster needs at least one instance")
        self.handles = {h.instance_id: h for h in handles}
        for h in handles:  # an instance fenced by an earlier front end refuses steps of an older epoch
            h.epoch = max(h.epoch, h.call("fence_epoch"))
        self.controller = controller  # the router now: ``main_controller``, or the mixed fallback's
        self.main_controller = controller
        controller.attach(list(handles))
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = model_name
        self.slo_classes = slo_classes
        self.max_model_len = min(h.describe["max_model_len"] for h in handles)
        from ..model.structured import GrammarBackend

        # checks (and, for tool calls, spells) a request's grammar here; each instance masks with its own
        eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        self.grammars = GrammarBackend(tokenizer, model_config.vocab_size, eos)
        # dynamic depth is accepted when every instance loaded exit heads (start_cluster(exits=...))
        self.inputs = InputProcessor(tokenizer, model_config.vocab_size, self.max_model_len, slo_classes,
                                     self.grammars, serves_exits=all(h.describe.get("serves_exits") for h in handles))
        self.outputs = OutputProcessor(tokenizer)
        entry = next((h for h in handles if h.role != "decode"), handles[0])
        self.latency_model = entry.latency_model
        self.clock = clock
        self.step_timeout_s = step_timeout_s
        self.stall_timeout_s = step_timeout_s if stall_timeout_s is None else min(stall_timeout_s, step_timeout_s)
        self._step_s: dict[int, float] = {}  # decode instance id -> its slowest recent step (decaying), s
        self.monotonic = time.monotonic  # the timer of steps in flight (tests put a fake one here)
        self.requests: dict[str, Tracked] = {}
        self.stats = ClusterStats()
        self._steps: dict[int, Call] = {}  # instance id -> its step in flight
        self._busy: set[int] = set()  # instances with work (as of their last step)
        self._work_sent: collections.Counter = collections.Counter()  # instance id -> work given so far
        self._step_gen: dict[int, int] = {}  # instance id -> _work_sent when its step in flight started
        self._transfers: list[Tracked] = []
        self._pending: list[str] = []  # handed off, waiting for a decode instance
        self._confirms: list[Call] = []  # "confirm" calls (prefill side drops a delivered hand-off) in flight
        self._fences: list[Call] = []  # "reset" calls sent to instances marked dead (nobody waits for them)
        self._hash_root: tuple[bytes, int] | None = None  # (prefix root, block size) of the instances
        self._recovering: dict[str, float] = {}  # req id -> time its instance failed
        self.last_reports: dict = {}  # instance id -> its InstanceReport after its last step (gauges)
        self.rejoin_probe_s = 1.0  # a dead instance that may answer again is pinged this often ...
        self.rejoin_timeout_s = 600.0  # ... for this long after its failure (model reload included)
        self._probes: dict[int, list] = {}  # dead instance id -> [failed at, next probe at, ping in flight]
        self._stranded: set[int] = set()  # dead instances whose requests wait for a needed role to return
        self._parked: list[str] = []  # requests that found no live instance; they wait for one to rejoin
        self._lost_outputs: list[RequestOutput] = []  # final outputs of requests given up on
        self._dispatching: set[str] = set()  # requests being routed now
        self.health_probe_s = 1.0  # idle: every live instance is pinged this often (availability)
        self.outage_wait_s = 30.0  # a request waits this long for an instance of a needed role to return
        self._health: dict[int, "Call | float"] = {}  # live instance id -> its ping in flight, or next ping at
        self._wait_until: dict[str, float] = {}  # waiting req id -> when it fails if still waiting
        self._failed: list[tuple[str, ClusterError]] = []  # (req id, the error its client gets)
        self._fallback: set[int] = set()  # prefill instances serving as mixed (no live decode instance)
        self.arrival_hook = None  # AsyncEngine sets it; arrivals are routed on the engine thread

    # -- what AsyncEngine reads --------------------------------------------------------------------------
    @property
    def scheduler(self):
        """The front end stands in for a scheduler where AsyncEngine lists requests (``.requests``)."""
        return self

    def admission_report(self, now: float):
        """The :class:`~laser.scheduler.report.SchedulerReport` cluster admission predicts from:
        that of the live prefill (or mixed) instance with the least prefill work queued as of
        its last step (:func:`laser.controller.base.prefill_load_key`: where the controller's
        fallback routes a request; a feasible instance the controller prefers has no more work).
        Its time is the front end's ``now`` and it is not busy: instance clocks are their own,
        so the rest of a step in flight is not counted. None before any instance reported."""
        reps = [r for iid, r in self.last_reports.items()
                if r is not None and r.role != "decode" and self.handles[iid].alive]
        if not reps:
            return None
        rep = min(reps, key=prefill_load_key).scheduler
        return dataclasses.replace(rep, time=now, busy=False)

    def predict_prefill_seconds(self, num_tokens: int) -> float:
        return self.latency_model.predict_prefill(num_tokens)

    def alive(self) -> dict[int, bool]:
        """Instance id -> not marked dead."""
        return {i: h.alive for i, h in self.handles.items()}

    def can_serve(self) -> bool:
        """Live instances of every role the controller needs remain."""
        try:
            self._require_roles()
        except ClusterError:
            return False
        return True

    # -- requests ----------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | list[dict], sampling_params: SamplingParams | None = None,
                    slo: SLO | str | None = None, req_id: str | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate (:meth:`InputProcessor.process`), route and send a request. Raises
        InvalidRequestError (nothing is sent) or ClusterError (no live instance can take it)."""
        return self.add_processed(self.inputs.process(prompt, sampling_params, slo, req_id, arrival_time,
                                                      self.clock, self.requests.__contains__))

    def add_processed(self, req: Request) -> Request:
        """Route and send a request the input path built. Raises InvalidRequestError (its id is
        in use) or ClusterError (no live instance can take it and none may return); nothing is
        kept then. With no live instance of a needed role but one that may return, it waits
        (up to ``outage_wait_s``, :mod:`.availability`)."""
        if req.req_id in self.requests:
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use")
        t = Tracked(req, self._info(req), owner=-1)
        self.requests[req.req_id] = t
        self.outputs.add_request(req)
        try:
            self._dispatch(t)
        except ClusterError:
            if self._wait_for_return(t):  # an instance of the missing role may return: wait (bounded)
                return req
            self._forget(req.req_id)
            raise
        except BaseException:
            self._forget(req.req_id)
            raise
        return req

    def _forget(self, req_id: str) -> None:
        del self.requests[req_id]
        self.outputs.abort(req_id)

    def _info(self, req: Request) -> RequestInfo:
        return RequestInfo(req.req_id, req.arrival_time, req.num_tokens, req.slo.ttft, req.slo.tbt, req.slo.name,
                           self.controller.expected_output(req.slo.name), self._block_hashes(req))

    def _block_hashes(self, req: Request) -> tuple[bytes, ...]:
        """The prompt's block hashes for cache-aware routing, chained from the instances' root
        (asked of a prefill instance's report once; instances of one model and dtype share it)."""
        from ..core.block_manager import hash_blocks

        if self._hash_root is None:
            try:
                rep = self.controller.prefill[0].report()
            except (InstanceFailure, IndexError) as e:  # routed without them; the dispatch meets the failure
                if isinstance(e, InstanceFailure):
                    self._fail_instance(e.instance_id, e)
                return ()
            self._hash_root = (rep.prefix_root, rep.block_size)
        root, bs = self._hash_root
        return tuple(hash_blocks([], req.all_token_ids, bs, root)) if root else ()

    def _dispatch(self, t: Tracked) -> None:
        """Route ``t`` (controller) and send it to its prefill instance, marking dead whatever
        fails to answer on the way and routing again (what the failed try left on a live
        instance is dropped there). Raises ClusterError when no live instance takes it."""
        rid = t.req.req_id
        self._dispatching.add(rid)  # a failure met on the way must not move it too (no double send)
        try:
            for _ in range(len(self.handles) + 1):
                self._require_roles()
                t0 = time.perf_counter()
                route = None
                try:
                    route = self.controller.route(t.info, self.clock())
                    self.stats.routes += 1
                    self.stats.route_seconds += time.perf_counter() - t0
                    t.owner, t.decode = route.prefill, route.decode
                    self._send(t, route.prefill, route.decode)
                except InstanceFailure as e:
                    self._fail_instance(e.instance_id, e)
                    if route is not None:
                        self._drop_on_live(rid, {route.prefill, route.decode})
                    continue
                self._mark_busy(route.prefill)
                return
            raise ClusterError("no live instance accepted the request")
        finally:
            self._dispatching.discard(rid)

    def _drop_on_live(self, rid: str, instances, fence: int | None = None) -> None:
        """Abort ``rid`` on those of ``instances`` still alive (``fence``: see ``InstanceWorker.abort``)."""
        for iid in set(instances) - {None, -1}:
            h = self.handles[iid]
            if h.alive:
                try:
                    h.call("abort", rid, fence)
                except InstanceFailure as e:
                    self._fail_instance(e.instance_id, e)

    def _send(self, t: Tracked, prefill: int, decode: int | None) -> None:
        """Give ``t`` to its prefill instance; with a decode instance chosen already, the prefill
        instance hands it there by itself after its first token (a
        :class:`~laser.instance.handoff.DirectRoute`), streaming its KV layer by layer during
        the final prefill chunk when ``stream_kv`` (the decode instance expects it)."""
        req = t.req.copy_for_instance()
        t.direct, t.early = None, None
        if decode is None or decode == prefill:
            self.handles[prefill].add_request(req)
            return
        key = (t.restarts, prefill) if self.stream_kv else None  # a re-prefill's stream never mixes with a lost one's
        src, dst = self.handles[prefill], self.handles[decode]
        if key is not None:
            dst.call("expect_kv", req.req_id, key)
        src.call("add_request", req, DirectRoute(decode, dst.kv_sink(), src.kv_sink(), t.restarts, dst.epoch, key))
        t.direct = decode

    def _require_roles(self) -> None:
        live = [h for h in self.handles.values() if h.alive]
        roles = {h.role for h in live}
        if self.controller.disaggregated and not {"prefill", "decode"} <= roles or not live:
            raise ClusterError(f"no live instance of a needed role (live: {sorted(roles) or 'none'})")

    def abort(self, req_id: str) -> bool:
        """Abort a request wherever it is (front end, prefill, transfer, decode). False when unknown."""
        t = self.requests.pop(req_id, None)
        if t is None:
            return False
        self._recovering.pop(req_id, None)
        self.outputs.abort(req_id)
        if req_id in self._pending:
            self._pending.remove(req_id)
        self._release_everywhere(t)
        return True

    def _release_everywhere(self, t: Tracked) -> None:
        # a hand-off on its way (sent directly by its prefill instance) is refused when it arrives
        fence = None if t.transfer is None else t.restarts + 1
        self._drop_on_live(t.req.req_id, {t.owner, t.decode, t.transfer.src if t.transfer else None}, fence)
        if t in self._transfers:
            self._transfers.remove(t)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the loop ------------------------------------------------------------------------------------------
    def step(self, wait_s: float = 0.05) -> list[RequestOutput]:
        """Start a step on every live instance with work and none in flight, wait up to
        ``wait_s`` for one to finish, then deliver tokens, move hand-offs and detect failures."""
        for iid in list(self._busy):
            h = self.handles[iid]
            if h.alive and iid not in self._steps:
                self._steps[iid] = call = h.submit("step", h.epoch)
                call.started = self.monotonic()
                h.answer_by, h.step_future = call.started + self._step_deadline(iid), call.future
                self._step_gen[iid] = self._work_sent[iid]
        outs: list[RequestOutput] = []
        futs = [c.future for c in self._steps.values()] + [t.transfer.adopt.future for t in self._transfers
                                                             if not t.transfer.direct]
        if not futs and (self._parked or self._stranded):
            time.sleep(min(wait_s, 0.01))  # requests wait for an instance to return: no busy loop
        end = time.monotonic() + wait_s
        while futs and time.monotonic() < end:
            done, _ = concurrent.futures.wait(futs, timeout=min(0.005, wait_s),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if done:
                break
            if self.arrival_hook is not None:  # requests arriving meanwhile are routed now
                self.arrival_hook()
        self._poll_transfers()  # first: a decode step may already carry an adopted request's token
        self._poll_confirms()
        now = self.monotonic()
        # prefill answers first: a decode answer may carry a direct hand-off whose first token is in one
        for iid, call in sorted(self._steps.items(), key=lambda kv: self.handles[kv[0]].role == "decode"):
            if self._steps.get(iid) is not call:
                continue  # its instance failed while an earlier answer was handled
            if call.future.done():
                del self._steps[iid]
                call.handle.answer_by = call.handle.step_future = None
                try:
                    res = call.handle.result(call)
                except InstanceFailure as e:
                    self._fail_instance(iid, e)
                    continue
                self._note_step_time(iid, now - call.started)
                if self.handles[iid].role == "decode":  # frozen between two steps: caught as in one
                    call.handle.idle_answer_s = self._step_deadline(iid)
                if not res["busy"] and self._step_gen.get(iid) == self._work_sent[iid] and not self._direct_to(iid):
                    self._busy.discard(iid)  # idle, given nothing since this step started, nothing on its way
                self.last_reports[iid] = res.get("report")
                for rec in res.get("adopted", ()):
                    self._on_adopted(iid, *rec)
                outs.extend(self._on_events(iid, res["events"]))
                if self.handles[iid].role == "decode":
                    self._maybe_migrate(iid)
            elif now - call.started > self._step_deadline(iid):
                self._fail_instance(iid, f"step exceeded {self._step_deadline(iid):.3g} s", timed_out=True)
        self._start_transfers()
        if self._fences:
            self._fences = [c for c in self._fences if not c.future.done()]
        if self._probes or self._parked or self._stranded:
            self._probe_dead()
        if self._lost_outputs:
            outs.extend(self._lost_outputs)
            self._lost_outputs.clear()
        return outs

    def _step_deadline(self, iid: int) -> float:
        """Seconds a step of ``iid`` may run before the instance counts as stalled (a frozen or
        hung process): ``step_timeout_s`` (a prefill step may be a long prompt's chunk); a decode
        step is one iteration: ``stall_timeout_s``, or ``STALL_FACTOR`` x its slowest recent step."""
        if self.handles[iid].role != "decode":
            return self.step_timeout_s
        return min(self.step_timeout_s, max(self.stall_timeout_s, STALL_FACTOR * self._step_s.get(iid, 0.0)))

    def _note_step_time(self, iid: int, seconds: float) -> None:
        """Remember ``iid``'s step took ``seconds`` (send -> answer read) for :meth:`_step_deadline`."""
        self._step_s[iid] = max(seconds, STALL_DECAY * self._step_s.get(iid, 0.0))

    def _mark_busy(self, iid: int) -> None:
        """``iid`` was given work: step it until a step that started after this reports it idle
        (a step already in flight may answer "idle" without having seen the new work)."""
        self._busy.add(iid)
        self._work_sent[iid] += 1

    def _on_events(self, iid: int, events: list) -> list[RequestOutput]:
        outs = []
        now = self.clock()
        for ev in events:
            outs.extend(self._on_event(iid, now, *ev))
        return outs

    def _on_event(self, iid: int, now: float, rid: str, token: int, reason, handed_off: bool,
                  cached: int, logprob=None, prompt_logprobs=None, depth=None) -> list[RequestOutput]:
        """One token of ``rid`` from instance ``iid`` (a step answer's event, see
        :meth:`~laser.instance.worker.InstanceWorker.step`): its outputs (more than one when a
        direct hand-off's early decode tokens follow it)."""
        t = self.requests.get(rid)
        if t is not None and t.transfer is not None and t.transfer.dst == iid:
            t.owner = iid  # adopted (its adopt answer may come after this step's)
        if t is not None and t.owner != iid and t.early is not None and t.direct == iid:
            # before the prefill's hand-off event
            t.early[2].append((rid, token, reason, handed_off, cached, logprob, prompt_logprobs, depth))
            return []
        if t is None or t.owner != iid:
            return []  # aborted, or a stale token of an instance the request left
        req = t.req
        if not req.output_token_ids:  # the prefill that made the first token read this many from its cache
            req.num_cached_tokens = cached
        req.output_token_ids.append(token)
        req.token_times.append(now)
        if logprob is not None:  # the instance's sampler computed it (SamplingParams.logprobs)
            req.output_logprobs.append(logprob)
        if prompt_logprobs is not None and req.prompt_logprobs is None:  # (a re-prefill sends them again)
            req.prompt_logprobs = prompt_logprobs
        if depth is not None:  # dynamic depth: the instance's totals (the response's mean depth)
            req.num_depth_tokens, req.depth_layers = depth
        if rid in self._recovering:
            self.stats.recovery_seconds.append(now - self._recovering.pop(rid))
        # never "handed off" to the consumer: the stream goes on here, whichever instance holds it
        # (AsyncEngine ends a stream at a handed-off output: a served 1P1D request hung)
        out, stop = self.outputs.process(req, token, reason)
        if stop:  # a stop string: the instance still has it
            try:
                self.handles[iid].abort(rid)
            except InstanceFailure as e:
                self._fail_instance(e.instance_id, e)
        reason = out.finish_reason
        if reason is not None:
            req.finish_reason = reason
            del self.requests[rid]
            if t.decode is not None and t.decode != iid:  # (a stop string at a hand-off: refuse it there)
                self._drop_on_live(rid, {t.decode}, t.restarts + 1 if handed_off else None)
            self.controller.on_finish(req.slo.name, req.num_output_tokens, now, req.slo.tbt_or_inf)
        elif handed_off:
            return [out] + self._handed_off(t, iid)
        return [out]

    def _release_reservation(self, t: Tracked) -> None:
        """Cancel ``t``'s reservation on its decode instance, and any KV streamed there."""
        self._drop_on_live(t.req.req_id, {t.decode})
    # -- checks ------------------------------------------------------------------------------------------
    def check_integrity(self, expect_empty: bool = False) -> None:
        """Every live instance's KV pool, intermediate cache and scheduler (and, when idle, no
        outbox, waiting hand-off or reservation). Raises AssertionError."""
        self._poll_confirms(wait=True)  # a delivered hand-off's copy is dropped before the check
        for h in self.handles.values():
            if h.alive and h.instance_id not in self._steps:
                try:
                    h.call("check_integrity", expect_empty and not self.requests)
                except InstanceFailure as e:
                    self._fail_instance(e.instance_id, e)

    def describe_unfinished(self) -> list[str]:
        """One line per unfinished request: where the front end believes it is (diagnostics)."""
        lines = []
        for rid, t in self.requests.items():
            tr = t.transfer
            lines.append(f"{rid}: owner {t.owner} decode {t.decode} tokens {len(t.req.output_token_ids)} "
                         f"restarts {t.restarts} pending {rid in self._pending} "
                         f"transfer {None if tr is None else (tr.src, tr.dst)} "
                         f"busy {sorted(self._busy)} steps {sorted(self._steps)}")
        return lines

    def drain(self, timeout_s: float = 300.0) -> list[RequestOutput]:
        """Step until every request finished (tests, offline use); all outputs in order."""
        outs = []
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.requests)} request(s) unfinished after {timeout_s} s: "
                                   + "; ".join(self.describe_unfinished()))
            outs.extend(self.step())
        return outs

