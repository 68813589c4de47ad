"""Keeping a cluster serving through instance losses (CONTROLLER.md A9, D10; issue 28 items 5, 5b).

Three rules, on top of :mod:`.recovery` (which moves the requests of a dead instance):

* **Idle probing.** While no request is in flight nothing calls the instances, so the front end
  pings each live one every ``health_probe_s``: one that died, missed the call timeout or
  answers with a new boot id (its host restarted it, empty) is marked dead, pinged until it
  answers and rejoins -- a restarted instance serves again without a request to notice it.
* **Mixed fallback.** A disaggregated cluster that loses its last decode instance keeps
  serving: its prefill instances (whole engines) serve as ``mixed`` instances behind a
  least-loaded router (KV demand, the ``colocated`` rule); the interrupted requests are re-prefilled
  there from prompt + the tokens streamed so far, a hand-off still held by a prefill instance
  is adopted by that instance itself. When a decode instance returns the prefill instances go
  back to ``prefill``: the requests decoding on them move to it with their KV (no re-prefill).
* **Bounded waits, then a clear error.** A request that finds no live instance of a needed
  role waits for one that may return (a Ray restart, a straggler) up to ``outage_wait_s``; if
  none may return, or none did in time, it fails with a :class:`~.state.ClusterError` -- an
  HTTP 503 with ``Retry-After`` before its stream started, an SSE error event (or a 503 body)
  after -- never a 500 and never a stream silently cut with ``finish_reason="abort"``.
"""

from __future__ import annotations

import logging
import time

from ..controller.baselines import ColocatedController
from ..instance.messages import RequestInfo
from .handles import InstanceFailure, InstanceHandle
from .state import ClusterError, Tracked

log = logging.getLogger(__name__)


class MixedFallback(ColocatedController):
    """The router while a disaggregated cluster has no decode instance: least KV demand among
    the prefill instances serving as ``mixed`` (``mixed_load_key``, the ``colocated``
    rule); a hand-off already exported before the switch is adopted by its own instance."""

    name = "mixed-fallback"

    def __init__(self, owner_of):
        super().__init__()
        self._owner_of = owner_of  # req id -> the instance holding it

    def at_handoff(self, info: RequestInfo, chosen: int | None, now: float) -> int:
        return self._owner_of(info.req_id)


class Availability:
    """The availability steps of :class:`~laser.cluster.engine.ClusterEngine`, which owns the
    state they use (``handles``, ``controller``, ``main_controller``, ``_fallback``,
    ``_health``, ``_wait_until``, ``_failed``, and the recovery state) and calls them."""

    # -- idle probing ---------------------------------------------------------------------------------
    def poll_idle(self) -> float:
        """While no request is in flight (the server's engine thread calls it when idle): ping
        the live instances (:meth:`_check_health`) and the dead ones that may return, so a
        restarted instance rejoins now; a node started again (:mod:`.node`) serves. Returns
        seconds until the next poll is due."""
        self._poll_node_restart()
        if self.restarting_node:
            return min(self.health_probe_s, 0.1)
        self._check_health(time.monotonic())
        if self._probes or self._parked or self._stranded:
            self._probe_dead()
        return min(self.health_probe_s, self.rejoin_probe_s) if self._probes else self.health_probe_s

    def _check_health(self, now: float) -> None:
        """One health ping in flight per live instance, every ``health_probe_s``: a failed one,
        one past the call timeout, or a new boot id (a restarted process, empty) marks it dead;
        a restarted or late one is then probed until it rejoins."""
        for iid, h in self.handles.items():
            if not h.alive:
                self._health.pop(iid, None)
                continue
            ping = self._health.get(iid)
            if ping is None or isinstance(ping, float):
                if ping is None or now >= ping:
                    self._health[iid] = h.submit("ping")
                continue
            if not ping.future.done():
                if now - ping.started > h.call_timeout_s:
                    del self._health[iid]
                    self._fail_instance(iid, f"no answer to a health ping within {h.call_timeout_s:.3g} s",
                                        timed_out=True)
                continue
            self._health[iid] = now + self.health_probe_s
            try:
                boot = h.result(ping)
            except InstanceFailure as e:
                self._fail_instance(iid, e)
                continue
            if boot != h.describe.get("boot_id", boot):
                self._fail_instance(iid, "restarted by its host (a new process, empty)")
                self._probes.setdefault(iid, [now, now, None])  # it answers: it rejoins at the next probe

    # -- mixed fallback ---------------------------------------------------------------------------------
    def _serve_with_live(self) -> bool:
        """Fit the roles to the live instances (:meth:`_sync_roles`) and attach the controller to
        them; False (logged) when no live instance of a needed role remains."""
        self._sync_roles()
        try:
            self._require_roles()
            self.controller.attach([h for h in self.handles.values() if h.alive])
        except (ClusterError, ValueError) as e:
            log.error("cluster cannot serve until an instance returns: %s", e)
            return False
        return True

    def _sync_roles(self) -> None:
        """No live decode instance on a disaggregated cluster: the live prefill instances serve
        as mixed (:class:`MixedFallback` routes); a decode instance is live again: they go back
        to prefill (:meth:`_leave_fallback`)."""
        if not self.main_controller.disaggregated:
            return
        live = [h for h in self.handles.values() if h.alive]
        if any(h.role == "decode" for h in live):
            if self._fallback:
                self._leave_fallback()
            return
        prefill = [h for h in live if h.role == "prefill"]
        if prefill and not self._fallback:
            log.warning("no live decode instance: prefill instances %s serve as mixed until one returns",
                        [h.instance_id for h in prefill])
            self.controller = MixedFallback(lambda rid: self.requests[rid].owner)
        for h in prefill:
            if h.alive and self._set_role(h, "mixed") is not None:
                self._fallback.add(h.instance_id)

    def _leave_fallback(self) -> None:
        """Give the prefill instances serving as mixed their role back; each request decoding
        on one is handed off to a decode instance with its KV (:meth:`_start_transfers`)."""
        ids, self._fallback = sorted(self._fallback), set()  # (a failure met on the way re-fits the roles)
        log.warning("a decode instance is back: instances %s serve as prefill again", ids)
        self.controller = self.main_controller
        self._finish_self_adoptions()
        for iid in ids:
            h = self.handles[iid]
            moved = self._set_role(h, "prefill") if h.alive else None
            for rid in moved or ():
                t = self.requests.get(rid)
                if t is None or t.owner != iid:
                    self._drop_on_live(rid, {iid})
                    continue
                t.decode = t.direct = None
                self._pending.append(rid)

    def _finish_self_adoptions(self) -> None:
        """Wait for the hand-offs a fallback instance is adopting itself (one call each): adopted
        first, they decode there and move on with the others."""
        for t in list(self._transfers):
            tr = t.transfer
            if tr is not None and tr.src == tr.dst:
                try:
                    self.handles[tr.dst].result(tr.adopt, timeout=self.handles[tr.dst].call_timeout_s)
                except Exception:  # noqa: BLE001 - _poll_transfers reads the same answer and handles it
                    pass
        self._poll_transfers()

    def _set_role(self, h: InstanceHandle, role: str) -> list[str] | None:
        """Switch ``h`` to ``role`` (its ``set_role``): the ids of the requests it exported, or
        None when it failed on the way (then marked dead)."""
        try:
            moved = h.call("set_role", role)
        except InstanceFailure as e:
            self._fail_instance(e.instance_id, e)
            return None
        h.role = role
        return moved

    def _restore_role(self, h: InstanceHandle) -> None:
        """A rejoining instance serves its own role again (it may have left as a mixed one); a
        health ping sent before it failed is forgotten."""
        self._fallback.discard(h.instance_id)
        self._health.pop(h.instance_id, None)
        h.role = h.describe["role"]
        h.call("set_role", h.role)

    # -- bounded waits and errors -------------------------------------------------------------------
    def _wait_for_return(self, t: Tracked) -> bool:
        """Park ``t`` until an instance of a needed role returns, at most ``outage_wait_s`` from
        when it started waiting; False when none may return (nothing to wait for)."""
        if not self._probes or self.outage_wait_s <= 0:
            return False
        t.owner, t.decode, t.direct = -1, None, None
        self._parked.append(t.req.req_id)
        self._wait_until.setdefault(t.req.req_id, time.monotonic() + self.outage_wait_s)
        return True

    def _strand(self, iid: int) -> None:
        """Dead ``iid``'s requests wait (no live instance of a needed role): bounded as parked ones."""
        self._stranded.add(iid)
        until = time.monotonic() + self.outage_wait_s
        for rid, t in self.requests.items():
            tr = t.transfer
            if t.owner == iid or (tr is not None and iid in (tr.src, tr.dst)):
                self._wait_until.setdefault(rid, until)

    def _expire_waits(self) -> None:
        """Fail the requests that waited ``outage_wait_s`` for a returning instance in vain."""
        now = time.monotonic()
        for rid, until in list(self._wait_until.items()):
            t = self.requests.get(rid)
            waiting = t is not None and (rid in self._parked or t.owner in self._stranded
                                         or (t.transfer is not None and {t.transfer.src, t.transfer.dst} & self._stranded))
            if not waiting:
                del self._wait_until[rid]
            elif now >= until:
                del self._wait_until[rid]
                if rid in self._parked:
                    self._parked.remove(rid)
                self._give_up(t, f"no instance of a needed role came back within {self.outage_wait_s:.3g} s")

    def take_failed(self) -> list[tuple[str, ClusterError]]:
        """Requests given up on since the last call, each with the error its client gets (the
        server's engine thread ends their streams with it)."""
        failed, self._failed = self._failed, []
        return failed
