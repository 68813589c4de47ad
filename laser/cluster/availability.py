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

:class:`Availability` owns the health pings in flight, the instances serving as mixed, and the
requests waiting for a role to return (parked ones, those of stranded dead instances) with
their deadlines.
"""

from __future__ import annotations

import logging
import time

from ..controller.baselines import ColocatedController
from ..instance.messages import RequestInfo
from .handles import Call, InstanceFailure, InstanceHandle
from .state import ClusterError, ClusterState, Tracked

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
    """The availability rules of :class:`~laser.cluster.engine.ClusterEngine` (the module docstring).

    Args:
        state: the cluster's table (its router is switched to :class:`MixedFallback` and back).
        recovery: the failure handling (a failed ping marks its instance dead; a request that
            waited in vain is given up on). transfers: the hand-off tracker (a request decoding
            on a fallback instance is pulled to a returning decode instance).

    :meth:`connect` gives the node restart (``poll_idle`` looks after it). ``health_probe_s``:
    while idle every live instance is pinged this often; ``outage_wait_s``: a request waits this
    long for an instance of a needed role to return.
    """

    def __init__(self, state: ClusterState, recovery, transfers):
        self.state = state
        self.recovery = recovery
        self.transfers = transfers
        self.node_restart = None
        self.health_probe_s = 1.0
        self.outage_wait_s = 30.0
        self._health: dict[int, "Call | float"] = {}  # live instance id -> its ping in flight, or next ping at
        self._fallback: set[int] = set()  # prefill instances serving as mixed (no live decode instance)
        self._parked: list[str] = []  # requests that found no live instance; they wait for one to rejoin
        self._stranded: set[int] = set()  # dead instances whose requests wait for a needed role to return
        self._wait_until: dict[str, float] = {}  # waiting req id -> when it fails if still waiting

    def connect(self, node_restart) -> None:
        """The lost-node part :meth:`poll_idle` looks after (built after this one)."""
        self.node_restart = node_restart

    def waiting(self) -> bool:
        """Requests wait for an instance of a needed role to return (parked, or stranded)."""
        return bool(self._parked or self._stranded)

    def forget_calls(self) -> None:
        """The instances' node is gone: forget the health pings in flight (:mod:`.node`)."""
        self._health.clear()

    def node_back(self) -> None:
        """A lost node came back with its instances in their own roles: none serves as mixed and
        the main controller routes again (the caller re-attaches it)."""
        self._fallback.clear()
        self.state.controller = self.state.main_controller

    # -- idle probing ---------------------------------------------------------------------------------
    def poll_idle(self) -> float:
        """While no request is in flight (the server's engine thread calls it when idle): ping
        the live instances (:meth:`_check_health`) and the dead ones that may return, so a
        restarted instance rejoins now; a node started again (:mod:`.node`) serves. Returns
        seconds until the next poll is due."""
        self.node_restart.poll()
        if self.node_restart.restarting:
            return min(self.health_probe_s, 0.1)
        self._check_health(time.monotonic())
        if self.recovery.may_return() or self.waiting():
            self.recovery.probe_dead()
        if self.recovery.may_return():
            return min(self.health_probe_s, self.recovery.rejoin_probe_s)
        return self.health_probe_s

    def _check_health(self, now: float) -> None:
        """One health ping in flight per live instance, every ``health_probe_s``: a failed one,
        one past the call timeout, or a new boot id (a restarted process, empty) marks it dead;
        a restarted or late one is then probed until it rejoins."""
        for iid, h in self.state.handles.items():
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
                    self.recovery.fail_instance(iid, f"no answer to a health ping within {h.call_timeout_s:.3g} s",
                                                timed_out=True)
                continue
            self._health[iid] = now + self.health_probe_s
            try:
                boot = h.result(ping)
            except InstanceFailure as e:
                self.recovery.fail_instance(iid, e)
                continue
            if boot != h.describe.get("boot_id", boot):
                self.recovery.fail_instance(iid, "restarted by its host (a new process, empty)")
                self.recovery.probe_soon(iid, now)  # it answers: it rejoins at the next probe

    # -- mixed fallback ---------------------------------------------------------------------------------
    def serve_with_live(self) -> bool:
        """Fit the roles to the live instances (:meth:`_sync_roles`) and attach the controller to
        them; False (logged) when no live instance of a needed role remains."""
        self._sync_roles()
        try:
            self.state.require_roles()
            self.state.controller.attach(self.state.live())
        except (ClusterError, ValueError) as e:
            log.error("cluster cannot serve until an instance returns: %s", e)
            return False
        return True

    def _sync_roles(self) -> None:
        """No live decode instance on a disaggregated cluster: the live prefill instances serve
        as mixed (:class:`MixedFallback` routes); a decode instance is live again: they go back
        to prefill (:meth:`_leave_fallback`)."""
        if not self.state.main_controller.disaggregated:
            return
        live = self.state.live()
        if any(h.role == "decode" for h in live):
            if self._fallback:
                self._leave_fallback()
            return
        prefill = [h for h in live if h.role == "prefill"]
        if prefill and not self._fallback:
            log.warning("no live decode instance: prefill instances %s serve as mixed until one returns",
                        [h.instance_id for h in prefill])
            self.state.controller = MixedFallback(lambda rid: self.state.requests[rid].owner)
        for h in prefill:
            if h.alive and self._set_role(h, "mixed") is not None:
                self._fallback.add(h.instance_id)

    def _leave_fallback(self) -> None:
        """Give the prefill instances serving as mixed their role back; each request decoding
        on one is handed off to a decode instance with its KV
        (:meth:`~.transfers.HandoffTracker.start_pulls`)."""
        ids, self._fallback = sorted(self._fallback), set()  # (a failure met on the way re-fits the roles)
        log.warning("a decode instance is back: instances %s serve as prefill again", ids)
        self.state.controller = self.state.main_controller
        self.transfers.finish_self_adoptions()
        for iid in ids:
            h = self.state.handles[iid]
            moved = self._set_role(h, "prefill") if h.alive else None
            for rid in moved or ():
                t = self.state.requests.get(rid)
                if t is None or t.owner != iid:
                    self.recovery.drop_on_live(rid, {iid})
                    continue
                t.decode = t.direct = None
                self.transfers.pend(rid)

    def _set_role(self, h: InstanceHandle, role: str) -> list[str] | None:
        """Switch ``h`` to ``role`` (its ``set_role``): the ids of the requests it exported, or
        None when it failed on the way (then marked dead)."""
        try:
            moved = h.call("set_role", role)
        except InstanceFailure as e:
            self.recovery.fail_instance(e.instance_id, e)
            return None
        h.role = role
        return moved

    def restore_role(self, h: InstanceHandle) -> None:
        """A rejoining instance serves its own role again (it may have left as a mixed one); a
        health ping sent before it failed is forgotten."""
        self._fallback.discard(h.instance_id)
        self._health.pop(h.instance_id, None)
        h.role = h.describe["role"]
        h.call("set_role", h.role)

    # -- bounded waits and errors -------------------------------------------------------------------
    def wait_for_return(self, t: Tracked) -> bool:
        """Park ``t`` until an instance of a needed role returns, at most ``outage_wait_s`` from
        when it started waiting; False when none may return (nothing to wait for)."""
        if not self.recovery.may_return() or self.outage_wait_s <= 0:
            return False
        t.owner, t.decode, t.direct = -1, None, None
        self._parked.append(t.req.req_id)
        self._wait_until.setdefault(t.req.req_id, time.monotonic() + self.outage_wait_s)
        return True

    def strand(self, iid: int) -> None:
        """Dead ``iid``'s requests wait (no live instance of a needed role): bounded as parked ones."""
        self._stranded.add(iid)
        until = time.monotonic() + self.outage_wait_s
        for rid, t in self.state.requests.items():
            tr = t.transfer
            if t.owner == iid or (tr is not None and iid in (tr.src, tr.dst)):
                self._wait_until.setdefault(rid, until)

    def expire_waits(self) -> None:
        """Fail the requests that waited ``outage_wait_s`` for a returning instance in vain."""
        now = time.monotonic()
        for rid, until in list(self._wait_until.items()):
            t = self.state.requests.get(rid)
            tr = None if t is None else t.transfer
            waiting = t is not None and (rid in self._parked or t.owner in self._stranded
                                         or (tr is not None and {tr.src, tr.dst} & self._stranded))
            if not waiting:
                del self._wait_until[rid]
            elif now >= until:
                del self._wait_until[rid]
                if rid in self._parked:
                    self._parked.remove(rid)
                self.recovery.give_up(t, f"no instance of a needed role came back within {self.outage_wait_s:.3g} s")

    def stranded_ids(self) -> list[int]:
        """The dead instances whose requests wait for a role to return, in id order."""
        return sorted(self._stranded)

    def take_waiting(self) -> list[str]:
        """An instance rejoined and the cluster serves: no instance is stranded any more; the
        parked requests, which the caller re-prefills."""
        self._stranded.clear()
        parked, self._parked = self._parked, []
        return parked

    def give_up_waiting(self) -> None:
        """No dead instance may return: every request still waiting is lost (given up on)."""
        dead = self._stranded
        for t in list(self.state.requests.values()):
            tr = t.transfer
            if (t.req.req_id in self._parked or t.owner in dead
                    or (tr is not None and {tr.src, tr.dst} & dead)):
                self.recovery.give_up(t, "no live instance of a needed role")
        self._parked.clear()
        self._stranded.clear()
