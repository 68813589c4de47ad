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

The engine is composed of parts, each the one owner of its state (the way vLLM v1's engine
core holds a scheduler, an executor and a KV-cache manager, and SGLang's disaggregated decode
server a prealloc queue and a transfer queue): the shared table -- instances, requests, the
router, the counters -- (:class:`~.state.ClusterState`, ``state``), the steps in flight
(:class:`~.steps.StepTracker`, ``steps``), routing and sending (:class:`~.dispatch.Dispatcher`,
``dispatcher``), hand-offs and migrations (:class:`~.transfers.HandoffTracker`, ``transfers``),
failure recovery (:class:`~.recovery.Recovery`, ``recovery``), staying available
(:class:`~.availability.Availability`, ``availability``), the lost node
(:class:`~.node.NodeRestart`, ``node_restart``). Each part is given the others it calls when it
is built. The engine itself keeps the client's side: the input and output paths and the
token events. Starting a cluster: :mod:`.launch`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Callable

from ..controller.base import Controller, prefill_load_key
from ..core.request import SLO, InvalidRequestError, Request, SamplingParams
from ..frontend.inputs import InputProcessor
from ..frontend.outputs import OutputProcessor, RequestOutput
from .availability import Availability
from .dispatch import Dispatcher
from .handles import InstanceFailure, InstanceHandle
from .node import NodeRestart
from .recovery import Recovery
from .state import ClusterError, ClusterState, ClusterStats, Tracked
from .steps import StepTracker
from .transfers import HandoffTracker

__all__ = ["ClusterEngine", "ClusterError", "ClusterStats"]


class ClusterEngine:
    """Engine-like front end over ``handles`` driven by ``controller``.

    Args:
        handles: the instances (roles must fit the controller: prefill + decode, or mixed).
        controller: a :class:`~laser.controller.Controller` (not yet attached).
        tokenizer / model_config / model_name: the served model (front-end side only).
        slo_classes: the SLO class table. step_timeout_s: a step longer than this marks its
            instance dead (a stall). stall_timeout_s: a decode instance's step (one iteration)
            counts as stalled sooner (:class:`~.steps.StepTracker`); a synchronous call to an
            instance never waits past its step's deadline either, so a frozen decode
            instance's requests move within this plus their re-prefill. clock: the cluster
            clock (seconds; instances on the same host share ``time.monotonic``). stream_kv: when the decode instance is chosen at
            arrival, stream the request's KV to it layer by layer during its final prefill
            chunk (False: all layers at the hand-off).

    Settings live on the part that uses them: ``steps.stall_timeout_s``,
    ``recovery.rejoin_probe_s``, ``availability.health_probe_s`` / ``outage_wait_s``,
    ``node_restart.node`` / ``on_node_lost``.
    """

    def __init__(self, handles: list[InstanceHandle], controller: Controller, tokenizer, model_config,
                 model_name: str, slo_classes, step_timeout_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, stream_kv: bool = True,
                 stall_timeout_s: float | None = None):
        if not handles:
            raise ValueError("a cluster needs at least one instance")
        for h in handles:  # an instance fenced by an earlier front end refuses steps of an older epoch
            h.epoch = max(h.epoch, h.call("fence_epoch"))
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
        self.arrival_hook = None  # AsyncEngine sets it; arrivals are routed on the engine thread
        # the parts, each the owner of its state, given the parts it calls
        self.state = ClusterState(handles, controller, clock)
        self.steps = StepTracker(self.state, step_timeout_s, stall_timeout_s)
        self.recovery = Recovery(self.state, self.steps, self.outputs, self.abort)
        self.dispatcher = Dispatcher(self.state, self.steps, self.recovery, stream_kv)
        self.transfers = HandoffTracker(self.state, self.steps, self.recovery, self.dispatcher, self._on_events)
        self.availability = Availability(self.state, self.recovery, self.transfers)
        self.node_restart = NodeRestart(self.state, self.steps, self.recovery, self.transfers, self.availability)
        self.recovery.connect(self.dispatcher, self.transfers, self.availability, self.node_restart)
        self.availability.connect(self.node_restart)

    # -- the shared table, read through (``state`` owns it) ---------------------------------------------
    @property
    def handles(self) -> dict[int, InstanceHandle]:
        return self.state.handles

    @property
    def requests(self) -> dict[str, Tracked]:
        return self.state.requests

    @property
    def controller(self) -> Controller:
        """The router now (the main controller, or the mixed fallback's)."""
        return self.state.controller

    @property
    def stats(self) -> ClusterStats:
        return self.state.stats

    @property
    def last_reports(self) -> dict:
        """Instance id -> its InstanceReport after its last step (the ``/metrics`` gauges)."""
        return self.steps.last_reports

    # -- what AsyncEngine reads --------------------------------------------------------------------------
    def request_ids(self) -> list[str]:
        """The ids of the unfinished requests."""
        return list(self.state.requests)

    def admission_report(self, now: float):
        """The :class:`~laser.scheduler.report.SchedulerReport` cluster admission predicts from:
        that of the live prefill (or mixed) instance with the least prefill work queued as of
        its last step (:func:`laser.controller.base.prefill_load_key`: where the controller's
        fallback routes a request; a feasible instance the controller prefers has no more work).
        Its time is the front end's ``now`` and it is not busy: instance clocks are their own,
        so the rest of a step in flight is not counted. None before any instance reported."""
        reps = [r for iid, r in self.steps.last_reports.items()
                if r is not None and r.role != "decode" and self.state.handles[iid].alive]
        if not reps:
            return None
        rep = min(reps, key=prefill_load_key).scheduler
        return dataclasses.replace(rep, time=now, busy=False)

    def predict_prefill_seconds(self, num_tokens: int) -> float:
        return self.latency_model.predict_prefill(num_tokens)

    def alive(self) -> dict[int, bool]:
        """Instance id -> not marked dead."""
        return {i: h.alive for i, h in self.state.handles.items()}

    def can_serve(self) -> bool:
        """Live instances of every role the controller needs remain."""
        try:
            self.state.require_roles()
        except ClusterError:
            return False
        return True

    def poll_idle(self) -> float:
        """While no request is in flight: :meth:`~.availability.Availability.poll_idle`."""
        return self.availability.poll_idle()

    def take_failed(self) -> list[tuple[str, ClusterError]]:
        """Requests given up on since the last call, each with the error its client gets
        (:meth:`~.recovery.Recovery.take_failed`)."""
        return self.recovery.take_failed()

    # -- requests ----------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | list[dict], sampling_params: SamplingParams | None = None,
                    slo: SLO | str | None = None, req_id: str | None = None,
                    arrival_time: float | None = None) -> Request:
        """Validate (:meth:`InputProcessor.process`), route and send a request. Raises
        InvalidRequestError (nothing is sent) or ClusterError (no live instance can take it)."""
        return self.add_processed(self.inputs.process(prompt, sampling_params, slo, req_id, arrival_time,
                                                      self.clock, self.state.requests.__contains__))

    def add_processed(self, req: Request) -> Request:
        """Route and send a request the input path built. Raises InvalidRequestError (its id is
        in use) or ClusterError (no live instance can take it and none may return); nothing is
        kept then. With no live instance of a needed role but one that may return, it waits
        (up to ``outage_wait_s``, :mod:`.availability`)."""
        requests = self.state.requests
        if req.req_id in requests:
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use")
        t = Tracked(req, self.dispatcher.info(req), owner=-1)
        requests[req.req_id] = t
        self.outputs.add_request(req)
        try:
            self.dispatcher.dispatch(t)
        except ClusterError:
            if self.availability.wait_for_return(t):  # an instance of the missing role may return: wait (bounded)
                return req
            self._forget(req.req_id)
            raise
        except BaseException:
            self._forget(req.req_id)
            raise
        return req

    def _forget(self, req_id: str) -> None:
        del self.state.requests[req_id]
        self.outputs.abort(req_id)

    def abort(self, req_id: str) -> bool:
        """Abort a request wherever it is (front end, prefill, transfer, decode). False when unknown."""
        t = self.state.requests.pop(req_id, None)
        if t is None:
            return False
        self.recovery.forget(req_id)
        self.outputs.abort(req_id)
        self.transfers.unpend(req_id)
        # a hand-off on its way (sent directly by its prefill instance) is refused when it arrives
        fence = None if t.transfer is None else t.restarts + 1
        self.recovery.drop_on_live(req_id, {t.owner, t.decode, t.transfer.src if t.transfer else None}, fence)
        self.transfers.cancel(t)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.state.requests)

    # -- the loop ------------------------------------------------------------------------------------------
    def step(self, wait_s: float = 0.05) -> list[RequestOutput]:
        """Start a step on every live instance with work and none in flight, wait up to
        ``wait_s`` for one to finish, then deliver tokens, move hand-offs and detect failures."""
        self.steps.start()
        self._wait(wait_s)
        self.transfers.poll()  # first: a decode step may already carry an adopted request's token
        self.transfers.poll_confirms()
        outs: list[RequestOutput] = []
        now = self.steps.monotonic()
        # prefill answers first: a decode answer may carry a direct hand-off whose first token is in one
        for iid, call in self.steps.in_flight():
            if not self.steps.is_in_flight(iid, call):
                continue  # its instance failed while an earlier answer was handled
            if call.future.done():
                outs.extend(self._on_answer(iid, call, now))
            elif now - call.started > self.steps.deadline(iid):
                self.recovery.fail_instance(iid, f"step exceeded {self.steps.deadline(iid):.3g} s", timed_out=True)
        self.transfers.start_pulls()
        self.recovery.prune_fences()
        if self.recovery.may_return() or self.availability.waiting():
            self.recovery.probe_dead()
        outs.extend(self.recovery.take_lost())
        return outs

    def _wait(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a step or a pulled adoption to finish, routing the requests
        that arrive meanwhile (``arrival_hook``)."""
        futs = self.steps.futures() + self.transfers.pulled_futures()
        if not futs and self.availability.waiting():
            time.sleep(min(wait_s, 0.01))  # requests wait for an instance to return: no busy loop
        end = time.monotonic() + wait_s
        while futs and time.monotonic() < end:
            done, _ = concurrent.futures.wait(futs, timeout=min(0.005, wait_s),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            if done:
                break
            if self.arrival_hook is not None:  # requests arriving meanwhile are routed now
                self.arrival_hook()

    def _on_answer(self, iid: int, call, now: float) -> list[RequestOutput]:
        """Read the answer of ``iid``'s finished step ``call``: its adoptions, its tokens, then
        the controller's migration, if any, off a decode instance."""
        try:
            res = self.steps.collect(iid, call)
        except InstanceFailure as e:
            self.recovery.fail_instance(iid, e)
            return []
        self.steps.answered(iid, now - call.started, res["busy"], res.get("report"),
                            lambda: self.transfers.direct_to(iid))
        for rec in res.get("adopted", ()):
            self.transfers.on_adopted(iid, *rec)
        outs = self._on_events(iid, res["events"])
        if self.state.handles[iid].role == "decode":
            self.transfers.maybe_migrate(iid)
        return outs

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
        t = self.state.requests.get(rid)
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
        self.recovery.recovered(rid, now)
        # never "handed off" to the consumer: the stream goes on here, whichever instance holds it
        # (AsyncEngine ends a stream at a handed-off output: a served 1P1D request hung)
        out, stop = self.outputs.process(req, token, reason)
        if stop:  # a stop string: the instance still has it
            try:
                self.state.handles[iid].abort(rid)
            except InstanceFailure as e:
                self.recovery.fail_instance(e.instance_id, e)
        reason = out.finish_reason
        if reason is not None:
            req.finish_reason = reason
            del self.state.requests[rid]
            if t.decode is not None and t.decode != iid:  # (a stop string at a hand-off: refuse it there)
                self.recovery.drop_on_live(rid, {t.decode}, t.restarts + 1 if handed_off else None)
            self.state.controller.on_finish(req.slo.name, req.num_output_tokens, now, req.slo.tbt_or_inf)
        elif handed_off:
            return [out] + self.transfers.handed_off(t, iid)
        return [out]

    # -- checks ------------------------------------------------------------------------------------------
    def check_integrity(self, expect_empty: bool = False) -> None:
        """Every live instance's KV pool, intermediate cache and scheduler (and, when idle, no
        outbox, waiting hand-off or reservation). Raises AssertionError."""
        self.transfers.poll_confirms(wait=True)  # a delivered hand-off's copy is dropped before the check
        for h in self.state.handles.values():
            if h.alive and not self.steps.is_in_flight(h.instance_id):
                try:
                    h.call("check_integrity", expect_empty and not self.state.requests)
                except InstanceFailure as e:
                    self.recovery.fail_instance(e.instance_id, e)

    def describe_unfinished(self) -> list[str]:
        """One line per unfinished request: where the front end believes it is (diagnostics)."""
        lines = []
        for rid, t in self.state.requests.items():
            tr = t.transfer
            lines.append(f"{rid}: owner {t.owner} decode {t.decode} tokens {len(t.req.output_token_ids)} "
                         f"restarts {t.restarts} pending {self.transfers.is_pending(rid)} "
                         f"transfer {None if tr is None else (tr.src, tr.dst)} {self.steps.describe()}")
        return lines

    def drain(self, timeout_s: float = 300.0) -> list[RequestOutput]:
        """Step until every request finished (tests, offline use); all outputs in order."""
        outs = []
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.state.requests)} request(s) unfinished after {timeout_s} s: "
                                   + "; ".join(self.describe_unfinished()))
            outs.extend(self.step())
        return outs
