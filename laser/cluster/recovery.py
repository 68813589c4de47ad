"""Failure recovery of the cluster front end (CONTROLLER.md A9, D10, C2, C6).

An instance that dies or misses a timeout is marked dead, the controller is re-attached to the
live ones, and each of its requests resumes elsewhere: a hand-off still held by a live prefill
instance is re-sent, anything else is re-prefilled from prompt + the tokens streamed so far.
An instance that may come back is pinged until it answers and rejoins empty.

:class:`Recovery` owns what that needs: the instances being probed, the fences sent, the
requests recovering (failure time, for the recovery-time counter) and the requests given up on
(their final outputs and the errors their clients get). vLLM v1 has the same split for one
engine: the core client watches its engine cores and raises ``EngineDeadError``; here an
instance's requests continue elsewhere.
"""

from __future__ import annotations

import logging
import time

from typing import Callable

from .handles import Call, InstanceFailure
from .state import ClusterError, ClusterState, Tracked

log = logging.getLogger(__name__)


class Recovery:
    """The failure handling of :class:`~laser.cluster.engine.ClusterEngine`.

    Args:
        state: the cluster's table. steps: the step tracker (a dead instance's step is forgotten).
        outputs: the front end's output path (a request given up on gets its final output).
        abort: the front end's abort (a request given up on is dropped everywhere).

    The parts it moves requests with are given by :meth:`connect` (they are built with this
    one: each calls :meth:`fail_instance`). ``rejoin_probe_s``: a dead instance that may answer
    again is pinged this often, for ``rejoin_timeout_s`` after its failure (model reload included).
    """

    def __init__(self, state: ClusterState, steps, outputs, abort: Callable[[str], bool]):
        self.state = state
        self.steps = steps
        self.outputs = outputs
        self.abort = abort
        self.dispatcher = self.transfers = self.availability = self.node_restart = None
        self.rejoin_probe_s = 1.0
        self.rejoin_timeout_s = 600.0
        self._probes: dict[int, list] = {}  # dead instance id -> [failed at, next probe at, ping in flight]
        self._fences: list[Call] = []  # "reset" calls sent to instances marked dead (nobody waits for them)
        self._recovering: dict[str, float] = {}  # req id -> time its instance failed
        self._lost_outputs: list = []  # final outputs of requests given up on
        self._failed: list[tuple[str, ClusterError]] = []  # (req id, the error its client gets)

    def connect(self, dispatcher, transfers, availability, node_restart) -> None:
        """The parts a failure moves requests with: routing again (``dispatcher``), re-sending a
        hand-off (``transfers``), waiting for a role to return (``availability``), the lost
        node (``node_restart``)."""
        self.dispatcher, self.transfers = dispatcher, transfers
        self.availability, self.node_restart = availability, node_restart

    # -- what the other parts ask ---------------------------------------------------------------------
    def may_return(self) -> bool:
        """A dead instance may still answer again (it is being probed)."""
        return bool(self._probes)

    def probed(self) -> list[int]:
        """The dead instances being probed (diagnostics)."""
        return sorted(self._probes)

    def probe_soon(self, iid: int, now: float) -> None:
        """Probe dead ``iid`` at the next look (it answers: it restarted, empty)."""
        self._probes.setdefault(iid, [now, now, None])

    def recovered(self, rid: str, now: float) -> None:
        """``rid`` streamed a token at ``now``: if it was recovering, count the recovery time."""
        if rid in self._recovering:
            self.state.stats.recovery_seconds.append(now - self._recovering.pop(rid))

    def forget(self, rid: str) -> None:
        """``rid`` is aborted: it recovers no more."""
        self._recovering.pop(rid, None)

    def prune_fences(self) -> None:
        """Drop the answered ``reset`` calls of the fences sent."""
        if self._fences:
            self._fences = [c for c in self._fences if not c.future.done()]

    def forget_calls(self) -> None:
        """The instances' node is gone: stop probing them and forget the fences sent (:mod:`.node`)."""
        self._probes.clear()
        self._fences.clear()

    def take_lost(self) -> list:
        """The final outputs of the requests given up on since the last call."""
        lost, self._lost_outputs = self._lost_outputs, []
        return lost

    def take_failed(self) -> list[tuple[str, ClusterError]]:
        """Requests given up on since the last call, each with the error its client gets (the
        server's engine thread ends their streams with it)."""
        failed, self._failed = self._failed, []
        return failed

    def drop_on_live(self, rid: str, instances, fence: int | None = None) -> None:
        """Abort ``rid`` on those of ``instances`` still alive (``fence``: see ``InstanceWorker.abort``)."""
        for iid in set(instances) - {None, -1}:
            h = self.state.handles[iid]
            if h.alive:
                try:
                    h.call("abort", rid, fence)
                except InstanceFailure as e:
                    self.fail_instance(e.instance_id, e)

    # -- failures -------------------------------------------------------------------------------------
    def fail_instance(self, iid: int, why: "str | InstanceFailure", timed_out: bool = False) -> None:
        """Mark ``iid`` dead, re-attach the controller to the live instances and move every
        request it held (re-send a hand-off still held by a live prefill instance, else
        re-prefill prompt + output elsewhere). An instance that only missed a timeout
        (``timed_out``, or an :class:`InstanceFailure` that says so: a straggler, perhaps alive)
        or that its host restarts (Ray ``max_restarts``) is pinged until it answers and then
        rejoins empty (:meth:`probe_dead`); a restart is counted only for a death."""
        timed_out = timed_out or getattr(why, "timed_out", False)
        h = self.state.handles[iid]
        if not h.alive:
            return
        log.warning("instance %d (%s) marked dead: %s", iid, h.role, why)
        h.alive = False
        self._fence(h)
        self.state.stats.instance_failures += 1
        if h.restarts_left > 0 or timed_out:  # it may answer again: probe until it does
            if not timed_out:
                h.restarts_left -= 1
            now_m = time.monotonic()
            self._probes[iid] = [now_m, now_m + self.rejoin_probe_s, None]
        self.steps.forget(iid)
        if not self.availability.serve_with_live():  # (prefill instances serve as mixed when the decode role is lost)
            self.availability.strand(iid)  # its requests move when an instance rejoins
            self.node_restart.check()  # (none alive: was it the node itself? then it starts again)
            return
        self._move_requests_of(iid)

    def _fence(self, h) -> None:
        """Raise dead instance ``h``'s epoch and send it a reset of that epoch without waiting: a
        frozen instance runs it when it wakes (after the step it froze in), so it drops
        the requests that moved away (their KV freed) and refuses a step or an adoption sent
        before its failure; it rejoins only through a probe (:meth:`probe_dead`). Its last
        report stops counting them at once (the ``/metrics`` gauges)."""
        h.epoch += 1
        h.answer_by = h.step_future = None
        self.steps.drop_report(h.instance_id)
        self._fences.append(h.submit("reset", h.epoch))

    def _move_requests_of(self, iid: int) -> None:
        """Resume elsewhere every request dead instance ``iid`` held (see :meth:`fail_instance`)."""
        now = self.state.clock()
        for t in list(self.state.requests.values()):
            if self.dispatcher.is_dispatching(t.req.req_id):
                continue  # its dispatch routes it again
            tr = t.transfer
            if tr is not None and iid in (tr.src, tr.dst):
                self.transfers.cancel(t)  # (its poll takes it out before reading its answers)
                t.transfer = None
                if tr.src != iid:  # the decode side died: the prefill instance still holds the KV
                    self.state.stats.resends += 1
                    t.req.num_failovers += 1
                    t.resend = True
                    t.decode = t.direct = None  # the front end pulls it to another decode instance
                    self.transfers.pend(t.req.req_id)
                    continue
                self.resume(t, now)
            elif t.owner == iid:
                self.transfers.unpend(t.req.req_id)
                self.resume(t, now)
            elif t.decode == iid:  # chosen at arrival; the front end pulls it at the hand-off instead
                t.decode = t.direct = t.early = None

    def probe_dead(self) -> None:
        """Ping dead instances that may come back; one that answers is reset (emptied: a restarted
        actor is empty, one that had only missed a timeout is not) and rejoins the controller."""
        self.availability.expire_waits()
        now = time.monotonic()
        for iid, probe in list(self._probes.items()):
            failed_at, next_at, ping = probe
            h = self.state.handles[iid]
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
                boot = h.result(ping)
                dropped = h.call("reset", h.epoch)
                self.availability.restore_role(h)
            except InstanceFailure:
                probe[1] = time.monotonic() + self.rejoin_probe_s
                continue
            del self._probes[iid]
            h.alive = True
            h.describe["boot_id"] = boot
            self.state.stats.rejoins += 1
            log.warning("instance %d (%s) rejoined after %.1f s (dropped %d stale requests)", iid, h.role,
                        now - failed_at, dropped)
            if self.availability.serve_with_live():
                self._resume_waiting()
        if not self._probes:  # nothing can come back: what still waits is lost
            self.availability.give_up_waiting()

    def _resume_waiting(self) -> None:
        """An instance rejoined and the cluster serves again: the requests of the instances that
        died with no live one of their role move now, and the parked requests are re-prefilled."""
        for dead in self.availability.stranded_ids():
            self._move_requests_of(dead)
        for rid in self.availability.take_waiting():
            if rid in self.state.requests:
                self.resume(self.state.requests[rid], self._recovering.get(rid, self.state.clock()))

    def resume(self, t: Tracked, failed_at: float, counted: bool = False) -> None:
        """Re-prefill ``t`` (prompt + streamed tokens) on a live instance, original deadline kept;
        ``counted``: its fail-over was counted already (a re-send that found nothing to send)."""
        self.state.stats.recoveries += 1
        t.restarts += 1
        t.req.num_failovers += not counted
        t.resend = False
        self.state.stats.seeded_recoveries += bool(t.req.seed_kept)
        # drop what live instances still hold of it, and refuse a late adoption of the old attempt
        self.drop_on_live(t.req.req_id, {t.owner, t.decode}, t.restarts)
        if self.state.requests.get(t.req.req_id) is not t:
            return  # (an instance failed on the way and moved it already)
        self._recovering.setdefault(t.req.req_id, failed_at)
        t.info = self.dispatcher.info(t.req)
        try:
            self.dispatcher.dispatch(t)
        except ClusterError as e:
            if not self.availability.wait_for_return(t):  # (bounded: an instance may come back)
                self.give_up(t, str(e))

    def give_up(self, t: Tracked, why: str) -> None:
        """``t`` cannot be served any more: its final output says ``finish_reason="abort"`` and
        :meth:`take_failed` gives the error its client gets (a server ends its stream with it)."""
        log.error("request %s lost: %s", t.req.req_id, why)
        out = self.outputs.final(t.req, "abort")
        self.abort(t.req.req_id)
        t.req.finish_reason = "abort"
        self._lost_outputs.append(out)
        self._failed.append((t.req.req_id, ClusterError(f"the cluster cannot continue this request: {why}")))
