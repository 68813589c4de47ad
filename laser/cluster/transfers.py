"""Prefill -> decode hand-offs and decode -> decode migrations, seen from the cluster front end.

A hand-off goes instance to instance by itself (:class:`~laser.instance.handoff.DirectRoute`): the
decode instance chosen when the request was routed gets the request and its KV from the prefill
instance and confirms to it; the front end waits on none of it -- it reads the hand-off in the
prefill instance's step answer, the adoption in the decode instance's, steps the decode instance
meanwhile, and once it has read the adoption confirms to the prefill instance as well, fire and
forget (the decode instance's own confirm is lost if it dies before sending it; each confirm names
the attempt, so a late one spares a re-prefilled attempt's copy). Control passes through the front
end only when that route is gone (no decode instance was chosen at routing, like ``distserve``; the
chosen one died; the prefill instances leave the mixed fall-back) and for decode -> decode
migrations: then it *pulls* -- ``take_handoff`` on the sender feeds ``adopt`` on the receiver, the
front end polls the answers and tells the sender to drop its copy (``confirm``) once the receiver
holds it (CONTROLLER.md D1, D9).

:class:`HandoffTracker` owns the transfers in flight, the hand-offs waiting for a pull and the
``confirm`` calls in flight (SGLang's disaggregated decode server keeps the same stages as
``DecodePreallocQueue`` -> ``DecodeTransferQueue``; here they are seen from the front end).
"""

from __future__ import annotations

import logging
import time

from typing import Callable

from .handles import Call, InstanceFailure, InstanceHandle
from .state import ClusterState, Tracked, Transfer

log = logging.getLogger(__name__)


class HandoffTracker:
    """The hand-offs and migrations of :class:`~laser.cluster.engine.ClusterEngine` (see the
    module docstring).

    Args:
        state: the cluster's table. steps: the step tracker (the receiving instance is stepped
            until the request arrives). recovery: the failure handling (a side that fails is
            marked dead, a lost hand-off re-prefilled). dispatcher: the controller's view of a
            request (``info``) and whether KV is streamed (``stream_kv``). on_events: the front
            end's reader of a step answer's token events (``(iid, events) -> outputs``), for
            the decode tokens of a direct hand-off read before its prefill's hand-off event.
    """

    def __init__(self, state: ClusterState, steps, recovery, dispatcher, on_events: Callable[[int, list], list]):
        self.state = state
        self.steps = steps
        self.recovery = recovery
        self.dispatcher = dispatcher
        self.on_events = on_events
        self._in_flight: list[Tracked] = []  # requests with a transfer on its way (compared by identity)
        self._pending: list[str] = []  # handed off, waiting for a decode instance (the front end pulls them)
        self._confirms: list[Call] = []  # "confirm" calls (the sender drops a delivered hand-off) in flight

    # -- the queues -----------------------------------------------------------------------------------
    def pend(self, rid: str) -> None:
        """``rid`` waits for the front end's pull to a decode instance (:meth:`start_pulls`)."""
        self._pending.append(rid)

    def unpend(self, rid: str) -> None:
        """``rid`` no longer waits for a pull (aborted, or its instance failed)."""
        if rid in self._pending:
            self._pending.remove(rid)

    def is_pending(self, rid: str) -> bool:
        return rid in self._pending

    def cancel(self, t: Tracked) -> None:
        """``t``'s transfer is no longer watched (aborted, or one side failed)."""
        if t in self._in_flight:
            self._in_flight.remove(t)

    def pulled_futures(self) -> list:
        """The futures of the adoptions the front end pulled (the step loop waits on them too)."""
        return [t.transfer.adopt.future for t in self._in_flight if not t.transfer.direct]

    def forget_calls(self) -> None:
        """The instances' node is gone: forget the ``confirm`` calls in flight (:mod:`.node`)."""
        self._confirms.clear()

    def release_reservation(self, t: Tracked) -> None:
        """Cancel ``t``'s reservation on its decode instance, and any KV streamed there."""
        self.recovery.drop_on_live(t.req.req_id, {t.decode})

    # -- direct hand-offs -----------------------------------------------------------------------------
    def handed_off(self, t: Tracked, src: int) -> list:
        """``t`` left prefill instance ``src`` after its first token: it is on its way to the
        decode instance chosen at routing (a direct hand-off; the outputs of decode tokens read
        before this event follow), or, with no live one, waits for the front end's pull."""
        d = t.direct
        if d is None or d != t.decode or not self.state.handles[d].alive:
            self._pending.append(t.req.req_id)
            return []
        t.transfer = Transfer(src, d, None, None, direct=True, started=time.monotonic())
        self._in_flight.append(t)
        self.steps.mark_busy(d)
        if t.early is None:
            return []
        m, error, events = t.early
        t.early = None
        self._direct_done(t, m, error)
        return self.on_events(d, events)

    def direct_to(self, iid: int) -> bool:
        """A direct hand-off is on its way to instance ``iid`` (step it until it arrives)."""
        return any(t.transfer is not None and t.transfer.direct and t.transfer.dst == iid for t in self._in_flight)

    def on_adopted(self, iid: int, rid: str, attempt: int, m: dict | None, error: str | None) -> None:
        """Decode instance ``iid`` took (``m``: adopt's answer) or refused (``error``) a direct
        hand-off of ``rid``'s attempt ``attempt``."""
        t = self.state.requests.get(rid)
        if t is None or attempt != t.restarts or t.direct != iid:
            return  # finished, aborted or moved on meanwhile
        tr = t.transfer
        if tr is not None and tr.direct and tr.dst == iid:
            self._direct_done(t, m, error)
        elif tr is None and t.owner != iid:  # the prefill's step answer with the hand-off is not read yet
            t.early = (m, error, [])

    def _direct_done(self, t: Tracked, m: dict | None, error: str | None) -> None:
        """The direct hand-off in flight for ``t`` arrived (``m``) or was refused (``error``)."""
        tr = t.transfer
        self._in_flight.remove(t)
        if error is not None:
            self._lost_handoff(t, tr, KeyError(error))
            return
        t.transfer = None
        t.owner = tr.dst
        self.steps.mark_busy(tr.dst)
        self._count_transfer(m, False)
        # the decode instance confirmed to the prefill instance by itself, but that message dies
        # with it if it fails before sending (then nobody would drop the kept copy): confirm too,
        # fire and forget, fenced by the attempt (a re-prefill may route the request there again)
        src = self.state.handles[tr.src]
        if src.alive:
            self._confirms.append(src.submit("confirm", t.req.req_id, t.restarts))

    def _count_transfer(self, m: dict, migration: bool) -> None:
        """Add adopt's answer ``m`` to the transfer statistics."""
        if migration:
            self.state.stats.migration_seconds.append(m["seconds"])
            return
        self.state.stats.transfers += 1
        self.state.stats.transfer_bytes += m["bytes"]
        self.state.stats.transfer_seconds.append(m["seconds"])
        self.state.stats.transfer_layers = m["layers"]
        self.state.stats.streamed_transfers += m["streamed"]
        self.state.stats.handoff_seconds.append(m["after_prefill_s"])

    def start_pulls(self) -> None:
        """Pull the hand-offs that have no direct route (see the module's docstring): the
        controller's ``at_handoff`` picks the decode instance."""
        while self._pending:
            rid = self._pending.pop(0)
            t = self.state.requests.get(rid)
            if t is None:
                continue
            src = self.state.handles[t.owner]
            try:
                d = self.state.controller.at_handoff(self.dispatcher.info(t.req), t.decode, self.state.clock())
            except InstanceFailure as e:
                self._pending.insert(0, rid)
                self.recovery.fail_instance(e.instance_id, e)
                continue
            if self.dispatcher.stream_kv and t.decode is not None and d != t.decode:
                self.release_reservation(t)  # the layers streamed there go unused
            self._transfer(t, src, d)

    def _transfer(self, t: Tracked, src: InstanceHandle, d: int, migration: bool = False) -> None:
        """Move ``t`` from ``src``'s outbox to decode instance ``d`` (instance to instance)."""
        rid = t.req.req_id
        t.decode = d
        take = src.submit("take_handoff", rid, d)
        # the attempt number fences the adoption: a stale one (of an attempt given up on) is refused
        dst = self.state.handles[d]
        t.transfer = Transfer(src.instance_id, d, take, dst.submit("adopt", take, t.restarts, dst.epoch), migration)
        self._in_flight.append(t)

    def maybe_migrate(self, iid: int) -> None:
        """Between two steps of decode instance ``iid``: the controller's D9 move, if any (only
        with another live decode instance to go to). The request leaves ``iid``'s scheduler into
        its outbox and travels like a hand-off; it streams again once adopted."""
        if sum(h.alive and h.role == "decode" for h in self.state.handles.values()) < 2:
            return
        try:
            m = self.state.controller.plan_migration(self.state.handles[iid], self.state.clock())
            if m is None:
                return
            cand, d = m
            t = self.state.requests.get(cand.info.req_id)
            if t is None or t.owner != iid or t.transfer is not None:
                self.state.handles[d].release(cand.info.req_id)
                return
            self.state.handles[iid].call("migrate_out", t.req.req_id)
        except InstanceFailure as e:
            self.recovery.fail_instance(e.instance_id, e)
            return
        except KeyError:  # finished or moved meanwhile
            return
        self.state.stats.migrations += 1
        self._transfer(t, self.state.handles[iid], d, migration=True)

    def poll(self) -> None:
        for t in list(self._in_flight):
            tr = t.transfer
            if tr is None or t not in self._in_flight:
                continue  # moved on while an earlier transfer's failure was handled
            if tr.direct:  # sent when its prefill step ended: the decode side has not answered it
                if time.monotonic() - tr.started > self.steps.step_timeout_s:
                    self.recovery.fail_instance(tr.dst, "direct hand-off not adopted in time", timed_out=True)
                continue
            if not tr.adopt.future.done():
                if time.monotonic() - tr.adopt.started > self.steps.step_timeout_s:
                    if tr.take.future.done():
                        self.recovery.fail_instance(tr.dst, "hand-off not adopted in time", timed_out=True)
                    else:  # the adoption waits for its argument: the prefill side is stuck
                        self.recovery.fail_instance(tr.src, "hand-off not sent in time", timed_out=True)
                continue
            self._in_flight.remove(t)
            rid = t.req.req_id
            src, dst = self.state.handles[tr.src], self.state.handles[tr.dst]
            try:
                src.result(tr.take)
            except InstanceFailure as e:  # the prefill instance died holding the KV: re-prefill
                self.recovery.fail_instance(tr.src, e)
                continue
            except KeyError as e:
                self._lost_handoff(t, tr, e)
                continue
            try:
                m = dst.result(tr.adopt)
            except InstanceFailure as e:  # decode side died: the prefill instance still holds it
                self.recovery.fail_instance(tr.dst, e)
                continue
            except KeyError as e:
                self._lost_handoff(t, tr, e)
                continue
            t.transfer, t.resend = None, False
            t.owner = tr.dst
            self.steps.mark_busy(tr.dst)
            self._count_transfer(m, tr.migration)
            # the prefill side drops its copy when it next can (a layer boundary); nothing waits
            # for the answer: a prefill instance that fails now has nothing of this request left to lose
            self._confirms.append(src.submit("confirm", rid))

    def finish_self_adoptions(self) -> None:
        """Wait for the hand-offs a fallback instance is adopting itself (one call each): adopted
        first, they decode there and move on with the others (:mod:`.availability`)."""
        for t in list(self._in_flight):
            tr = t.transfer
            if tr is not None and tr.src == tr.dst:
                try:
                    self.state.handles[tr.dst].result(tr.adopt, timeout=self.state.handles[tr.dst].call_timeout_s)
                except Exception:  # noqa: BLE001 - poll reads the same answer and handles it
                    pass
        self.poll()

    def poll_confirms(self, wait: bool = False) -> None:
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
                self.recovery.fail_instance(e.instance_id, e)

    def _lost_handoff(self, t: Tracked, tr: Transfer, e: KeyError) -> None:
        """A hand-off one side no longer knows (aborted there): nothing when ``t`` is gone or moved
        on; else re-prefill it, so it is never left waiting for a transfer that will not come."""
        if self.state.requests.get(t.req.req_id) is t and t.transfer is tr:
            log.warning("hand-off of %s lost (%s); re-prefilling it", t.req.req_id, e)
            t.transfer = None
            self.recovery.resume(t, self.state.clock(), counted=t.resend)
