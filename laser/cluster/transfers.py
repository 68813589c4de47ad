"""Prefill -> decode hand-offs and decode -> decode migrations, seen from the cluster front end.

A hand-off goes instance to instance by itself (:class:`~laser.instance.handoff.DirectRoute`):
the decode instance chosen when the request was routed gets the request and its KV from the
prefill instance and confirms to it; the front end only watches -- it reads the hand-off in the
prefill instance's step answer, the adoption in the decode instance's, and steps the decode
instance meanwhile. Control passes through the front end only when that route is gone (no
decode instance was chosen at routing, like ``distserve``; the chosen one died; the prefill
instances leave the mixed fall-back) and for decode -> decode migrations: then it *pulls* --
``take_handoff`` on the sender feeds ``adopt`` on the receiver, the front end polls the answers
and tells the sender to drop its copy (``confirm``) once the receiver holds it (CONTROLLER.md D1, D9).
"""

from __future__ import annotations

import logging
import time

from .handles import InstanceFailure, InstanceHandle
from .state import Tracked, Transfer

log = logging.getLogger(__name__)


class Transfers:
    """The hand-off and migration steps of :class:`~laser.cluster.engine.ClusterEngine`, which
    owns the state they use (``requests``, ``handles``, ``controller``, ``_pending``,
    ``_transfers``, ``_confirms``, ``stats``) and calls them from its step."""

    def _handed_off(self, t: Tracked, src: int) -> list:
        """``t`` left prefill instance ``src`` after its first token: it is on its way to the
        decode instance chosen at routing (a direct hand-off; the outputs of decode tokens read
        before this event follow), or, with no live one, waits for the front end's pull."""
        d = t.direct
        if d is None or d != t.decode or not self.handles[d].alive:
            self._pending.append(t.req.req_id)
            return []
        t.transfer = Transfer(src, d, None, None, direct=True, started=time.monotonic())
        self._transfers.append(t)
        self._mark_busy(d)
        if t.early is None:
            return []
        m, error, events = t.early
        t.early = None
        self._direct_done(t, m, error)
        return self._on_events(d, events)

    def _direct_to(self, iid: int) -> bool:
        """A direct hand-off is on its way to instance ``iid`` (step it until it arrives)."""
        return any(t.transfer is not None and t.transfer.direct and t.transfer.dst == iid for t in self._transfers)

    def _on_adopted(self, iid: int, rid: str, attempt: int, m: dict | None, error: str | None) -> None:
        """Decode instance ``iid`` took (``m``: adopt's answer) or refused (``error``) a direct
        hand-off of ``rid``'s attempt ``attempt``."""
        t = self.requests.get(rid)
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
        self._transfers.remove(t)
        if error is not None:
            self._lost_handoff(t, tr, KeyError(error))
            return
        t.transfer = None
        t.owner = tr.dst
        self._mark_busy(tr.dst)
        self._count_transfer(m, False)

    def _count_transfer(self, m: dict, migration: bool) -> None:
        """Add adopt's answer ``m`` to the transfer statistics."""
        if migration:
            self.stats.migration_seconds.append(m["seconds"])
            return
        self.stats.transfers += 1
        self.stats.transfer_bytes += m["bytes"]
        self.stats.transfer_seconds.append(m["seconds"])
        self.stats.transfer_layers = m["layers"]
        self.stats.streamed_transfers += m["streamed"]
        self.stats.handoff_seconds.append(m["after_prefill_s"])

    def _start_transfers(self) -> None:
        """Pull the hand-offs that have no direct route (see the module's docstring): the
        controller's ``at_handoff`` picks the decode instance."""
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

    def _transfer(self, t: Tracked, src: InstanceHandle, d: int, migration: bool = False) -> None:
        """Move ``t`` from ``src``'s outbox to decode instance ``d`` (instance to instance)."""
        rid = t.req.req_id
        t.decode = d
        take = src.submit("take_handoff", rid, d)
        # the attempt number fences the adoption: a stale one (of an attempt given up on) is refused
        dst = self.handles[d]
        t.transfer = Transfer(src.instance_id, d, take, dst.submit("adopt", take, t.restarts, dst.epoch), migration)
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
            if tr.direct:  # sent when its prefill step ended: the decode side has not answered it
                if time.monotonic() - tr.started > self.step_timeout_s:
                    self._fail_instance(tr.dst, "direct hand-off not adopted in time", timed_out=True)
                continue
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
            t.transfer, t.resend = None, False
            t.owner = tr.dst
            self._mark_busy(tr.dst)
            self._count_transfer(m, tr.migration)
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

    def _lost_handoff(self, t: Tracked, tr: Transfer, e: KeyError) -> None:
        """A hand-off one side no longer knows (aborted there): nothing when ``t`` is gone or moved
        on; else re-prefill it, so it is never left waiting for a transfer that will not come."""
        if self.requests.get(t.req.req_id) is t and t.transfer is tr:
            log.warning("hand-off of %s lost (%s); re-prefilling it", t.req.req_id, e)
            t.transfer = None
            self._resume(t, self.clock(), counted=t.resend)
