"""The front end of a cluster: many instances behind the global controller, one engine to a server.

:class:`ClusterEngine` has the methods :class:`~laser.frontend.async_engine.AsyncEngine` calls on an
:class:`~laser.frontend.engine.Engine` (``add_request``, ``abort``, ``step``, ``has_unfinished``,
``check_integrity``, ``clock``, tokenizer, SLO classes ...), so the same OpenAI server serves
a cluster. It keeps what a client needs -- tokenizer, detokenizer, stop strings
(:class:`~laser.frontend.detokenizer.OutputText`), each request's tokens and token times -- and sends
only token ids to the instances (:class:`~laser.cluster.handles.InstanceHandle`: in process
or Ray actors).

Per request (PPoPP'26 §7, CONTROLLER.md D1): the controller routes it at arrival (prefill
instance, and on a disaggregated cluster the decode instance, which reserves room); while its
final prefill chunk runs, the prefill instance streams each finished layer's K/V straight to
that decode instance (``stream_kv``; a controller that picks the decode instance only at the
hand-off, like ``distserve``, gets the KV whole then); after its first token the prefill
instance exports its sampling-generator state (and the KV, if not streamed there); the front end
has the decode instance pull it (``adopt(take_handoff)``, instance to instance) and tells the
prefill instance to drop its copy once the decode instance holds it.

Failures (CONTROLLER.md A9, D10, C2, C6): every call has a timeout and every step a longer
one; an instance that dies or misses one is marked dead, the controller is re-attached to the
live ones (groups re-sized), and each of its requests resumes elsewhere: a hand-off still held
by a live prefill instance is re-sent to another decode instance, anything else is
re-prefilled from prompt + the tokens generated so far (kept here, so no token is streamed
twice) with its original arrival time and deadline. Greedy requests continue identically; a
seeded sampled request that is re-prefilled restarts its generator from the seed.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..controller.base import Controller
from .handles import Call, InstanceFailure, InstanceHandle
from ..frontend.detokenizer import OutputText
from ..frontend.engine import RequestOutput
from ..instance.messages import RequestInfo
from ..core.request import SLO, InvalidRequestError, Phase, Request, SamplingParams

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The cluster cannot serve: no live instance of a role it needs."""


@dataclass(eq=False)  # compared by identity (membership of ``_transfers``)
class _Tracked:
    """The front end's copy of one request: what was streamed, and where it is."""

    req: Request  # prompt, sampling params, SLO, arrival; output_token_ids/token_times as streamed
    text: OutputText
    info: RequestInfo
    owner: int  # instance that holds it now (its prefill instance until adopted)
    decode: int | None = None  # decode instance chosen (reserved) or holding it
    transfer: "_Transfer | None" = None
    restarts: int = 0


@dataclass
class _Transfer:
    src: int
    dst: int
    take: Call
    adopt: Call
    migration: bool = False  # a decode -> decode move (else the prefill -> decode hand-off)


@dataclass
class ClusterStats:
    """Counters of the cluster front end (exported by the server's ``/metrics``)."""

    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: list[float] = field(default_factory=list)  # per hand-off, send -> written
    transfer_layers: int = 0  # layers per hand-off (the model's)
    streamed_transfers: int = 0  # hand-offs whose KV was streamed layer by layer during prefill
    handoff_seconds: list[float] = field(default_factory=list)  # per hand-off, prefill end -> adopted
    resends: int = 0  # hand-offs re-sent to another decode instance
    migrations: int = 0  # decode -> decode moves started (KV and sampler state, CONTROLLER.md D9)
    migration_seconds: list[float] = field(default_factory=list)  # per completed move, send -> adopted
    recoveries: int = 0  # requests re-prefilled after their instance failed
    recovery_seconds: list[float] = field(default_factory=list)  # failure -> next token
    instance_failures: int = 0
    rejoins: int = 0  # dead instances that answered again (restarted by Ray) and rejoined, empty
    routes: int = 0
    route_seconds: float = 0.0


class ClusterEngine:
    """Engine-like front end over ``handles`` driven by ``controller``.

    Args:
        handles: the instances (roles must fit the controller: prefill + decode, or mixed).
        controller: a :class:`~laser.controller.Controller` (not yet attached).
        tokenizer / model_config / model_name: the served model (front-end side only).
        slo_classes: the SLO class table. step_timeout_s: a step longer than this marks its
            instance dead (a stall). clock: the cluster clock (seconds; instances on the same
            host share ``time.monotonic``). stream_kv: when the decode instance is chosen at
            arrival, stream the request's KV to it layer by layer during its final prefill
            chunk (False: all layers at the hand-off).
    """

    def __init__(self, handles: list[InstanceHandle], controller: Controller, tokenizer, model_config,
                 model_name: str, slo_classes, step_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, stream_kv: bool = True):
        self.stream_kv = stream_kv
        if not handles:
            raise ValueError("a cluster needs at least one instance")
        self.handles = {h.instance_id: h for h in handles}
        self.controller = controller
        controller.attach(list(handles))
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = model_name
        self.slo_classes = slo_classes
        self.max_model_len = min(h.describe["max_model_len"] for h in handles)
        entry = next((h for h in handles if h.role != "decode"), handles[0])
        self.latency_model = entry.latency_model
        self.clock = clock
        self.step_timeout_s = step_timeout_s
        self.requests: dict[str, _Tracked] = {}
        self.stats = ClusterStats()
        self._steps: dict[int, Call] = {}  # instance id -> its step in flight
        self._busy: set[int] = set()  # instances with work (as of their last step)
        self._work_sent: collections.Counter = collections.Counter()  # instance id -> work given so far
        self._step_gen: dict[int, int] = {}  # instance id -> _work_sent when its step in flight started
        self._transfers: list[_Tracked] = []
        self._pending: list[str] = []  # handed off, waiting for a decode instance
        self._confirms: list[Call] = []  # "confirm" calls (prefill side drops a delivered hand-off) in flight
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
        self.arrival_hook = None  # AsyncEngine sets it; arrivals are routed on the engine thread

    # -- what AsyncEngine reads --------------------------------------------------------------------------
    @property
    def scheduler(self):
        """The front end stands in for a scheduler where AsyncEngine lists requests (``.requests``)."""
        return self

    def admission_snapshot(self, *args):
        """No single queue to publish (admission predicts a prompt alone)."""
        return None

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
    def add_request(self, prompt: list[int], sampling_params: SamplingParams | None = None,
                    slo: SLO | str | None = None, req_id: str | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate, route and send a request (token ids). Raises InvalidRequestError (nothing
        is sent) or ClusterError (no live instance can take it)."""
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise InvalidRequestError("a cluster takes prompts as non-empty token id lists")
        bad = [t for t in prompt if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} out of range [0, {self.model_config.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; this model's context is "
                                      f"{self.max_model_len} tokens")
        if req_id is not None and req_id in self.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        sp = sampling_params or SamplingParams()
        slo_obj = slo if isinstance(slo, SLO) else self.slo_classes.get(slo)
        req = Request(prompt_token_ids=list(prompt), sampling_params=sp, slo=slo_obj,
                      arrival_time=self.clock() if arrival_time is None else arrival_time, req_id=req_id or "")
        info = self._info(req)
        t = _Tracked(req, OutputText(self.tokenizer, req.prompt_token_ids, sp.stop), info, owner=-1)
        self.requests[req.req_id] = t
        try:
            self._dispatch(t)
        except BaseException:
            del self.requests[req.req_id]
            raise
        return req

    def _info(self, req: Request) -> RequestInfo:
        return RequestInfo(req.req_id, req.arrival_time, req.num_tokens, req.slo.ttft, req.slo.tbt, req.slo.name,
                           self.controller.expected_output(req.slo.name), self._block_hashes(req))

    def _block_hashes(self, req: Request) -> tuple[bytes, ...]:
        """The prompt's block hashes for cache-aware routing, chained from the instances' root
        (asked of a prefill instance's report once; instances of one model and dtype share it)."""
        from ..core.block_manager import hash_blocks

        if self._hash_root is None:
            rep = self.controller.prefill[0].report()
            self._hash_root = (rep.prefix_root, rep.block_size)
        root, bs = self._hash_root
        return tuple(hash_blocks([], req.all_token_ids, bs, root)) if root else ()

    def _copy_for_instance(self, req: Request) -> Request:
        """What an instance gets: the request, with the output so far (re-prefilled with the prompt)."""
        r = Request(prompt_token_ids=list(req.prompt_token_ids), sampling_params=req.sampling_params, slo=req.slo,
                    arrival_time=req.arrival_time, req_id=req.req_id)
        if req.output_token_ids:
            r.output_token_ids = list(req.output_token_ids)
            r.token_times = list(req.token_times)
            r.phase = Phase.PREFILL
        return r

    def _dispatch(self, t: _Tracked) -> None:
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

    def _send(self, t: _Tracked, prefill: int, decode: int | None) -> None:
        """Give ``t`` to its prefill instance; with a decode instance chosen already (and
        ``stream_kv``), that one expects its KV layer by layer, straight from the prefill instance."""
        req = self._copy_for_instance(t.req)
        if not self.stream_kv or decode is None:
            self.handles[prefill].add_request(req)
            return
        key = (t.restarts, prefill)  # a re-prefill's stream never mixes with a lost one's
        dst = self.handles[decode]
        dst.call("expect_kv", req.req_id, key)
        self.handles[prefill].call("add_request", req, (dst.kv_sink(), key, decode))

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
        if req_id in self._pending:
            self._pending.remove(req_id)
        self._release_everywhere(t)
        return True

    def _release_everywhere(self, t: _Tracked) -> None:
        self._drop_on_live(t.req.req_id, {t.owner, t.decode, t.transfer.src if t.transfer else None})
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
                self._steps[iid] = h.submit("step")
                self._step_gen[iid] = self._work_sent[iid]
        outs: list[RequestOutput] = []
        futs = [c.future for c in self._steps.values()] + [t.transfer.adopt.future for t in self._transfers]
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
        now = time.monotonic()
        for iid, call in list(self._steps.items()):
            if self._steps.get(iid) is not call:
                continue  # its instance failed while an earlier answer was handled
            if call.future.done():
                del self._steps[iid]
                try:
                    res = call.handle.result(call)
                except InstanceFailure as e:
                    self._fail_instance(iid, e)
                    continue
                if not res["busy"] and self._step_gen.get(iid) == self._work_sent[iid]:
                    self._busy.discard(iid)  # idle, and given nothing since this step started
                self.last_reports[iid] = res.get("report")
                outs.extend(self._on_events(iid, res["events"]))
                if self.handles[iid].role == "decode":
                    self._maybe_migrate(iid)
            elif now - call.started > self.step_timeout_s:
                self._fail_instance(iid, f"step exceeded {self.step_timeout_s:.3g} s", timed_out=True)
        self._start_transfers()
        if self._probes or self._parked or self._stranded:
            self._probe_dead()
        if self._lost_outputs:
            outs.extend(self._lost_outputs)
            self._lost_outputs.clear()
        return outs

    def _mark_busy(self, iid: int) -> None:
        """``iid`` was given work: step it until a step that started after this reports it idle
        (a step already in flight may answer "idle" without having seen the new work)."""
        self._busy.add(iid)
        self._work_sent[iid] += 1

    def _on_events(self, iid: int, events: list) -> list[RequestOutput]:
        outs = []
        now = self.clock()
        for rid, token, reason, handed_off in events:
            t = self.requests.get(rid)
            if t is not None and t.transfer is not None and t.transfer.dst == iid:
                t.owner = iid  # adopted (its adopt answer may come after this step's)
            if t is None or t.owner != iid:
                continue  # aborted, or a stale token of an instance the request left
            req = t.req
            req.output_token_ids.append(token)
            req.token_times.append(now)
            if rid in self._recovering:
                self.stats.recovery_seconds.append(now - self._recovering.pop(rid))
            if t.text.add(token) and reason is None:
                reason = "stop"  # a stop string: the instance still has it
                try:
                    self.handles[iid].abort(rid)
                except InstanceFailure as e:
                    self._fail_instance(e.instance_id, e)
                handed_off = False
            finished = reason is not None
            if finished:
                req.finish_reason = reason
                del self.requests[rid]
                if t.decode is not None and t.decode != iid:
                    self._release_reservation(t)
                self.controller.on_finish(req.slo.name, req.num_output_tokens, now, req.slo.tbt_or_inf)
            elif handed_off:
                self._pending.append(rid)
            outs.append(RequestOutput(
                req_id=rid, prompt=None, prompt_token_ids=req.prompt_token_ids, text=t.text.visible(finished),
                token_ids=list(req.output_token_ids), delta_text=t.text.delta(finished), new_token_ids=[token],
                finished=finished, finish_reason=reason, slo=req.slo, request=req, arrival_time=req.arrival_time,
                token_times=tuple(req.token_times)))
        return outs

    def _release_reservation(self, t: _Tracked) -> None:
        """Cancel ``t``'s reservation on its decode instance, and any KV streamed there."""
        self._drop_on_live(t.req.req_id, {t.decode})

    # -- prefill -> decode hand-off ---------------------------------------------------------------------
    def _start_transfers(self) -> None:
        while self._pending:
            rid = self._pending.pop(0)
            t = self.requests.get(rid)
            if t is None:
                continue
            src = self.handles[t.owner]
            try:
                d = self.controller.at_handoff(self._info(t.req), t.decode, self.clock())
            except InstanceFailure as e:
                self._pending.insert(0, rid)
                self._fail_instance(e.instance_id, e)
                continue
            if self.stream_kv and t.decode is not None and d != t.decode:
                self._release_reservation(t)  # the layers streamed there go unused
            self._transfer(t, src, d)

    def _transfer(self, t: _Tracked, src: InstanceHandle, d: int, migration: bool = False) -> None:
        """Move ``t`` from ``src``'s outbox to decode instance ``d`` (instance to instance)."""
        rid = t.req.req_id
        t.decode = d
        take = src.submit("take_handoff", rid, d)
        # the attempt number fences the adoption: a stale one (of an attempt given up on) is refused
        t.transfer = _Transfer(src.instance_id, d, take, self.handles[d].submit("adopt", take, t.restarts), migration)
        self._transfers.append(t)

    def _maybe_migrate(self, iid: int) -> None:
        """Between two steps of decode instance ``iid``: the controller's D9 move, if any (only
        with another live decode instance to go to). The request leaves ``iid``'s scheduler into
        its outbox and travels like a hand-off; it streams again once adopted."""
        if sum(h.alive and h.role == "decode" for h in self.handles.values()) < 2:
            return
        try:
            m = self.controller.plan_migration(self.handles[iid], self.clock())
            if m is None:
                return
            cand, d = m
            t = self.requests.get(cand.info.req_id)
            if t is None or t.owner != iid or t.transfer is not None:
                self.handles[d].release(cand.info.req_id)
                return
            self.handles[iid].call("migrate_out", t.req.req_id)
        except InstanceFailure as e:
            self._fail_instance(e.instance_id, e)
            return
        except KeyError:  # finished or moved meanwhile
            return
        self.stats.migrations += 1
        self._transfer(t, self.handles[iid], d, migration=True)

    def _poll_transfers(self) -> None:
        for t in list(self._transfers):
            tr = t.transfer
            if tr is None or t not in self._transfers:
                continue  # moved on while an earlier transfer's failure was handled
            if not tr.adopt.future.done():
                if time.monotonic() - tr.adopt.started > self.step_timeout_s:
                    if tr.take.future.done():
                        self._fail_instance(tr.dst, "hand-off not adopted in time", timed_out=True)
                    else:  # the adoption waits for its argument: the prefill side is stuck
                        self._fail_instance(tr.src, "hand-off not sent in time", timed_out=True)
                continue
            self._transfers.remove(t)
            rid = t.req.req_id
            src, dst = self.handles[tr.src], self.handles[tr.dst]
            try:
                src.result(tr.take)
            except InstanceFailure as e:  # the prefill instance died holding the KV: re-prefill
                self._fail_instance(tr.src, e)
                continue
            except KeyError as e:
                self._lost_handoff(t, tr, e)
                continue
            try:
                m = dst.result(tr.adopt)
            except InstanceFailure as e:  # decode side died: the prefill instance still holds it
                self._fail_instance(tr.dst, e)
                continue
            except KeyError as e:
                self._lost_handoff(t, tr, e)
                continue
            t.transfer = None
            t.owner = tr.dst
            self._mark_busy(tr.dst)
            if tr.migration:
                self.stats.migration_seconds.append(m["seconds"])
            else:
                self.stats.transfers += 1
                self.stats.transfer_bytes += m["bytes"]
                self.stats.transfer_seconds.append(m["seconds"])
                self.stats.transfer_layers = m["layers"]
                self.stats.streamed_transfers += m["streamed"]
                self.stats.handoff_seconds.append(m["after_prefill_s"])
            # the prefill side drops its copy when it next can (a layer boundary); nothing waits
            # for the answer: a prefill instance that fails now has nothing of this request left to lose
            self._confirms.append(src.submit("confirm", rid))

    def _poll_confirms(self, wait: bool = False) -> None:
        """Collect the answers of the ``confirm`` calls sent (all of them when ``wait``); one that
        failed marks its prefill instance dead."""
        for c in list(self._confirms):
            if not c.handle.alive:
                self._confirms.remove(c)
                continue
            if not (wait or c.future.done()):
                continue
            self._confirms.remove(c)
            try:
                c.handle.result(c, timeout=c.handle.call_timeout_s if wait else 0.0)
            except InstanceFailure as e:
                self._fail_instance(e.instance_id, e)

    def _lost_handoff(self, t: _Tracked, tr: _Transfer, e: KeyError) -> None:
        """A hand-off one side no longer knows (aborted there): nothing when ``t`` is gone or moved
        on; else re-prefill it, so it is never left waiting for a transfer that will not come."""
        if self.requests.get(t.req.req_id) is t and t.transfer is tr:
            log.warning("hand-off of %s lost (%s); re-prefilling it", t.req.req_id, e)
            t.transfer = None
            self._resume(t, self.clock())

    # -- failures ---------------------------------------------------------------------------------------
    def _fail_instance(self, iid: int, why: "str | InstanceFailure", timed_out: bool = False) -> None:
        """Mark ``iid`` dead, re-attach the controller to the live instances and move every
        request it held (re-send a hand-off still held by a live prefill instance, else
        re-prefill prompt + output elsewhere). An instance that only missed a timeout
        (``timed_out``, or an :class:`InstanceFailure` that says so: a straggler, perhaps alive)
        or that its host restarts (Ray ``max_restarts``) is pinged until it answers and then
        rejoins empty (:meth:`_probe_dead`); a restart is counted only for a death."""
        timed_out = timed_out or getattr(why, "timed_out", False)
        h = self.handles[iid]
        if not h.alive:
            return
        log.warning("instance %d (%s) marked dead: %s", iid, h.role, why)
        h.alive = False
        self.stats.instance_failures += 1
        if h.restarts_left > 0 or timed_out:  # it may answer again: probe until it does
            if not timed_out:
                h.restarts_left -= 1
            now_m = time.monotonic()
            self._probes[iid] = [now_m, now_m + self.rejoin_probe_s, None]
        self._steps.pop(iid, None)
        self._step_gen.pop(iid, None)
        self._busy.discard(iid)
        live = [x for x in self.handles.values() if x.alive]
        try:
            self._require_roles()
            self.controller.attach(live)
        except (ClusterError, ValueError) as e:
            log.error("cluster cannot serve any more: %s", e)
            self._stranded.add(iid)  # its requests move when an instance rejoins
            return
        self._move_requests_of(iid)

    def _move_requests_of(self, iid: int) -> None:
        """Resume elsewhere every request dead instance ``iid`` held (see :meth:`_fail_instance`)."""
        now = self.clock()
        for t in list(self.requests.values()):
            if t.req.req_id in self._dispatching:
                continue  # its _dispatch routes it again
            tr = t.transfer
            if tr is not None and iid in (tr.src, tr.dst):
                if t in self._transfers:  # (_poll_transfers takes it out before reading its answers)
                    self._transfers.remove(t)
                t.transfer = None
                if tr.src != iid:  # the decode side died: the prefill instance still holds the KV
                    self.stats.resends += 1
                    t.decode = None
                    self._pending.append(t.req.req_id)
                    continue
                self._resume(t, now)
            elif t.owner == iid:
                if t.req.req_id in self._pending:
                    self._pending.remove(t.req.req_id)
                self._resume(t, now)
            elif t.decode == iid:
                t.decode = None  # chosen at arrival; re-chosen at the hand-off

    def _probe_dead(self) -> None:
        """Ping dead instances that may come back; one that answers is reset (emptied: a restarted
        actor is empty, one that had only missed a timeout is not) and rejoins the controller."""
        now = time.monotonic()
        for iid, probe in list(self._probes.items()):
            failed_at, next_at, ping = probe
            h = self.handles[iid]
            if ping is None:
                if now - failed_at > self.rejoin_timeout_s:
                    log.error("instance %d did not come back within %.0f s", iid, self.rejoin_timeout_s)
                    del self._probes[iid]
                elif now >= next_at:
                    probe[2] = h.submit("ping")
                continue
            if not ping.future.done():
                continue
            probe[2] = None
            try:
                h.result(ping)
                dropped = h.call("reset")
            except InstanceFailure:
                probe[1] = time.monotonic() + self.rejoin_probe_s
                continue
            del self._probes[iid]
            h.alive = True
            self.stats.rejoins += 1
            log.warning("instance %d (%s) rejoined after %.1f s (dropped %d stale requests)", iid, h.role,
                        now - failed_at, dropped)
            if self.can_serve():
                self.controller.attach([x for x in self.handles.values() if x.alive])
                for dead in sorted(self._stranded):
                    self._move_requests_of(dead)
                self._stranded.clear()
                parked, self._parked = self._parked, []
                for rid in parked:
                    if rid in self.requests:
                        self._resume(self.requests[rid], self._recovering.get(rid, self.clock()))
        if not self._probes:  # nothing can come back: what still waits is lost
            dead = self._stranded
            for t in list(self.requests.values()):
                tr = t.transfer
                if (t.req.req_id in self._parked or t.owner in dead
                        or (tr is not None and {tr.src, tr.dst} & dead)):
                    self._give_up(t, "no live instance of a needed role")
            self._parked.clear()
            self._stranded.clear()

    def _resume(self, t: _Tracked, failed_at: float) -> None:
        """Re-prefill ``t`` (prompt + streamed tokens) on a live instance, original deadline kept."""
        self.stats.recoveries += 1
        t.restarts += 1
        # drop what live instances still hold of it, and refuse a late adoption of the old attempt
        self._drop_on_live(t.req.req_id, {t.owner, t.decode}, t.restarts)
        if self.requests.get(t.req.req_id) is not t:
            return  # (an instance failed on the way and moved it already)
        self._recovering.setdefault(t.req.req_id, failed_at)
        t.info = self._info(t.req)
        try:
            self._dispatch(t)
        except ClusterError as e:
            if self._probes:  # an instance may come back: it waits for that
                t.owner, t.decode = -1, None
                self._parked.append(t.req.req_id)
            else:
                self._give_up(t, str(e))

    def _give_up(self, t: _Tracked, why: str) -> None:
        """``t`` cannot be served any more: its stream ends with ``finish_reason="abort"``."""
        log.error("request %s lost: %s", t.req.req_id, why)
        self.abort(t.req.req_id)
        t.req.finish_reason = "abort"
        self._lost_outputs.append(RequestOutput(
            req_id=t.req.req_id, prompt=None, prompt_token_ids=t.req.prompt_token_ids, text=t.text.visible(True),
            token_ids=list(t.req.output_token_ids), delta_text=t.text.delta(True), new_token_ids=[], finished=True,
            finish_reason="abort", slo=t.req.slo, request=t.req, arrival_time=t.req.arrival_time,
            token_times=tuple(t.req.token_times)))

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


def instance_roles(prefill: int, decode: int, mixed: int) -> list[tuple[int, str]]:
    """``(instance_id, role)`` of a cluster of ``prefill`` + ``decode`` + ``mixed`` instances."""
    roles = ["prefill"] * prefill + ["decode"] * decode + ["mixed"] * mixed
    return list(enumerate(roles))


def start_cluster(controller: str | Controller, prefill: int = 0, decode: int = 0, mixed: int = 0, *,
                  model: str | None = None, dtype: str = "auto", cache=None, scheduler=None, slo_classes=None,
                  latency_profile: str | None = None, max_model_len: int | None = None, seed: int = 0,
                  threads_per_instance: int | None = None, use_ray: bool = True, ray_address: str | None = None,
                  call_timeout_s: float = 5.0, step_timeout_s: float = 60.0,
                  stream_kv: bool = True, max_restarts: int = 0, latency_calibration: bool = True,
                  jitter_margin: bool = False) -> ClusterEngine:
    """Start the instances (Ray actors, or in process with ``use_ray=False``) and the front end.
    ``latency_calibration``, ``jitter_margin``: each instance's, as :class:`~laser.frontend.engine.Engine`'s.

    The instances run the controller's ``instance_policy`` scheduler; ``scheduler`` gives the
    other scheduler knobs. With Ray, a local cluster is started with one CPU per instance
    thread unless Ray is already up or ``ray_address`` names one to join; ``max_restarts``: times
    Ray restarts a dead instance actor (it rejoins empty; in process: ignored).
    Raises ValueError (bad layout for the controller, or a controller whose roles run different
    policies: simulator only) or InstanceFailure (an actor did not start).
    """
    import dataclasses

    from ..core.config import SchedulerConfig
    from ..controller import get_controller
    from ..model.loader import load_config, load_tokenizer, resolve_model
    from ..core.slo import SLOClasses

    ctrl = get_controller(controller)() if isinstance(controller, str) else controller
    if any(ctrl.policy_for(r) != ctrl.instance_policy for r in ("prefill", "decode", "mixed")):
        raise ValueError("per-role instance policies (the ablation options) run on the simulator only")
    specs = instance_roles(prefill, decode, mixed)
    if not specs:
        raise ValueError("a cluster needs at least one instance")
    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    sched = dataclasses.replace(scheduler or SchedulerConfig(), policy=ctrl.instance_policy)
    kwargs = dict(model=model, policy=ctrl.instance_policy, dtype=dtype, cache=cache, scheduler=sched,
                  latency_profile=latency_profile, seed=seed, max_model_len=max_model_len,
                  latency_calibration=latency_calibration, jitter_margin=jitter_margin,
                  extra_eos_ids=() if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,))
    if use_ray:
        from . import ray_actors

        ray_actors.init_local_ray(len(specs) * (threads_per_instance or 1), ray_address)
        handles = ray_actors.start_instances(specs, kwargs, threads_per_instance, call_timeout_s,
                                             max_restarts=max_restarts)
    else:
        from .handles import LocalHandle
        from ..instance.worker import InstanceWorker

        handles = [LocalHandle(InstanceWorker(i, role, kwargs, threads_per_instance), call_timeout_s)
                   for i, role in specs]
    return ClusterEngine(handles, ctrl, tokenizer, load_config(path), "smollm2" if model is None else str(model),
                         slo_classes or SLOClasses.load(), step_timeout_s=step_timeout_s, stream_kv=stream_kv)
