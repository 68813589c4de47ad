"""Failure recovery of the cluster front end (CONTROLLER.md A9, D10, C2, C6).

An instance that dies or misses a timeout is marked dead, the controller is re-attached to the
live ones, and each of its requests resumes elsewhere: a hand-off still held by a live prefill
instance is re-sent, anything else is re-prefilled from prompt + the tokens streamed so far.
An instance that may come back is pinged until it answers and rejoins empty.
"""

from __future__ import annotations

import logging
import time

from .handles import InstanceFailure
from .state import ClusterError, Tracked

log = logging.getLogger(__name__)


class Recovery:
    """The failure steps of :class:`~laser.cluster.engine.ClusterEngine`, which owns the state
    they use (``requests``, ``handles``, ``controller``, ``_probes``, ``_stranded``, ``_parked``,
    ``_recovering``, ``stats``) and calls them from its step and its calls' error paths."""

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
        self._fence(h)
        self.stats.instance_failures += 1
        if h.restarts_left > 0 or timed_out:  # it may answer again: probe until it does
            if not timed_out:
                h.restarts_left -= 1
            now_m = time.monotonic()
            self._probes[iid] = [now_m, now_m + self.rejoin_probe_s, None]
        self._steps.pop(iid, None)
        self._step_gen.pop(iid, None)
        self._busy.discard(iid)
        if not self._serve_with_live():  # (prefill instances serve as mixed when the decode role is lost)
            self._strand(iid)  # its requests move when an instance rejoins
            self._check_node()  # (none alive: was it the node itself? then it starts again)
            return
        self._move_requests_of(iid)

    def _fence(self, h) -> None:
        """Raise dead instance ``h``'s epoch and send it a reset of that epoch without waiting: a
        frozen instance runs it when it wakes (after the step it froze in), so it drops
        the requests that moved away (their KV freed) and refuses a step or an adoption sent
        before its failure; it rejoins only through a probe (:meth:`_probe_dead`). Its last
        report stops counting them at once (the ``/metrics`` gauges)."""
        h.epoch += 1
        h.answer_by = h.step_future = None
        self.last_reports.pop(h.instance_id, None)
        self._fences.append(h.submit("reset", h.epoch))

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
                    t.req.num_failovers += 1
                    t.resend = True
                    t.decode = t.direct = None  # the front end pulls it to another decode instance
                    self._pending.append(t.req.req_id)
                    continue
                self._resume(t, now)
            elif t.owner == iid:
                if t.req.req_id in self._pending:
                    self._pending.remove(t.req.req_id)
                self._resume(t, now)
            elif t.decode == iid:  # chosen at arrival; the front end pulls it at the hand-off instead
                t.decode = t.direct = t.early = None

    def _probe_dead(self) -> None:
        """Ping dead instances that may come back; one that answers is reset (emptied: a restarted
        actor is empty, one that had only missed a timeout is not) and rejoins the controller."""
        self._expire_waits()
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
                boot = h.result(ping)
                dropped = h.call("reset", h.epoch)
                self._restore_role(h)
            except InstanceFailure:
                probe[1] = time.monotonic() + self.rejoin_probe_s
                continue
            del self._probes[iid]
            h.alive = True
            h.describe["boot_id"] = boot
            self.stats.rejoins += 1
            log.warning("instance %d (%s) rejoined after %.1f s (dropped %d stale requests)", iid, h.role,
                        now - failed_at, dropped)
            if self._serve_with_live():
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

    def _resume(self, t: Tracked, failed_at: float, counted: bool = False) -> None:
        """Re-prefill ``t`` (prompt + streamed tokens) on a live instance, original deadline kept;
        ``counted``: its fail-over was counted already (a re-send that found nothing to send)."""
        self.stats.recoveries += 1
        t.restarts += 1
        t.req.num_failovers += not counted
        t.resend = False
        self.stats.seeded_recoveries += bool(t.req.seed_kept)
        # drop what live instances still hold of it, and refuse a late adoption of the old attempt
        self._drop_on_live(t.req.req_id, {t.owner, t.decode}, t.restarts)
        if self.requests.get(t.req.req_id) is not t:
            return  # (an instance failed on the way and moved it already)
        self._recovering.setdefault(t.req.req_id, failed_at)
        t.info = self._info(t.req)
        try:
            self._dispatch(t)
        except ClusterError as e:
            if not self._wait_for_return(t):  # (bounded: an instance may come back)
                self._give_up(t, str(e))

    def _give_up(self, t: Tracked, why: str) -> None:
        """``t`` cannot be served any more: its final output says ``finish_reason="abort"`` and
        :meth:`take_failed` gives the error its client gets (a server ends its stream with it)."""
        log.error("request %s lost: %s", t.req.req_id, why)
        out = self.outputs.final(t.req, "abort")
        self.abort(t.req.req_id)
        t.req.finish_reason = "abort"
        self._lost_outputs.append(out)
        self._failed.append((t.req.req_id, ClusterError(f"the cluster cannot continue this request: {why}")))
