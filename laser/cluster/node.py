"""Losing the node the instances run on (CONTROLLER.md A9; issue 28 item 5).

When the Ray node itself goes (its raylet or GCS killed -- Ray fate-shares the dashboard agent
with the raylet --, every instance dies together), no instance can come back on its own: the
actors died with the node, and their handles point into a Ray session that is gone. The rule:

* **This process started that Ray cluster** (a local one, :func:`~.launch.start_cluster`
  without an address): start it again with the same settings and relaunch the instance actors
  (in a background thread: minutes for a large model), then swap them in -- the controller is
  attached to them, the cluster serves again. Meanwhile a new request gets a
  :class:`~.state.ClusterError` at once (HTTP 503 with ``Retry-After``, never a 500) and a
  request in flight when the node went ends with that error (an SSE error event).
* **It joined a cluster somebody else runs** (``ray_address``): it cannot start that node, so
  it says so (a critical log line) and calls ``on_node_lost`` -- the server exits non-zero so
  that its supervisor restarts it (systemd's ``Restart=on-failure``, a Kubernetes pod).

The node is checked only when every instance is dead, so a single instance's failure never
costs more than :mod:`.recovery`'s rules. The node object (``node``) is
:class:`~.ray_actors.RayNode` (``owned``, ``lost()``, ``restart()``).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable

from .state import ClusterState

log = logging.getLogger(__name__)

#: Consecutive failed restarts of the node before the front end gives up (``on_node_lost``).
MAX_NODE_RESTARTS = 3

# The thread that starts a node again lives as long as the process: Ray ties the processes it
# starts (GCS, raylet) to the *thread* that spawned them (``PR_SET_PDEATHSIG``), so a pool
# thread that exits after the restart would take the new node down with it.
_RESTARTER: concurrent.futures.ThreadPoolExecutor | None = None


class NodeRestart:
    """The lost-node rule of :class:`~laser.cluster.engine.ClusterEngine` (the module docstring):
    :meth:`check` when an instance's loss leaves none alive, :meth:`poll` from the idle poll.

    Args:
        state: the cluster's table (its ``handles`` are replaced by the restarted node's).
        steps / recovery / transfers / availability: the parts whose calls in flight to the lost
            instances are forgotten, and that serve with the new ones.

    ``node``: the node the instances run on (:class:`~.ray_actors.RayNode`; None: not known,
    e.g. in process). ``on_node_lost``: called with the reason when the node is gone and cannot
    be started again from here (the server exits non-zero then); None: requests keep failing
    with 503.
    """

    def __init__(self, state: ClusterState, steps, recovery, transfers, availability):
        self.state = state
        self.steps, self.recovery, self.transfers, self.availability = steps, recovery, transfers, availability
        self.node = None
        self.on_node_lost: Callable[[str], None] | None = None
        self._restart: concurrent.futures.Future | None = None  # the new handles, while a restart runs
        self._restart_failures = 0

    @property
    def restarting(self) -> bool:
        """The node is being started again (its instances are not back yet)."""
        return self._restart is not None

    def check(self) -> None:
        """No instance is alive: if the node they ran on is gone, start it again (when this
        process started it) or report it (``on_node_lost``), see the module docstring."""
        if self.node is None or self._restart is not None or any(h.alive for h in self.state.handles.values()):
            return
        why = self.node.lost()
        if why is None:
            return
        self._forget_calls()
        if not self.node.owned:
            log.critical("the Ray node of this cluster is gone (%s) and this process did not start it: it cannot "
                         "serve again until it is restarted", why)
            if self.on_node_lost is not None:
                self.on_node_lost(f"the Ray node of this cluster is gone ({why}) and this process did not start it")
            return
        log.error("the local Ray node is gone (%s): starting it again with its %d instances", why,
                  len(self.state.handles))
        self._start_restart()

    def _start_restart(self) -> None:
        global _RESTARTER
        if _RESTARTER is None:
            _RESTARTER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="laser-node-restart")
        self._restart = _RESTARTER.submit(self.node.restart)

    def _forget_calls(self) -> None:
        """The instances' node is gone: forget every call in flight to them and stop probing
        them (their Ray session ends; nothing may wait on it)."""
        for part in (self.recovery, self.availability, self.steps, self.transfers):
            part.forget_calls()

    def poll(self) -> None:
        """A node restart finished: serve with its instances (or try again, at most
        ``MAX_NODE_RESTARTS`` times in a row, then ``on_node_lost``)."""
        f = self._restart
        if f is None or not f.done():
            return
        self._restart = None
        try:
            handles = f.result()
        except Exception as e:  # noqa: BLE001 - a failed start is retried, then reported
            self._restart_failures += 1
            log.exception("starting the Ray node again failed (%d of %d)", self._restart_failures,
                          MAX_NODE_RESTARTS)
            if self._restart_failures < MAX_NODE_RESTARTS:
                self._start_restart()
            elif self.on_node_lost is not None:
                self.on_node_lost(f"the node could not be started again: {type(e).__name__}: {e}")
            return
        self._restart_failures = 0
        self.state.handles = {h.instance_id: h for h in handles}
        self.availability.node_back()
        self.state.stats.node_restarts += 1
        log.warning("the Ray node is back: instances %s serve again",
                    [f"{h.instance_id}:{h.role}" for h in handles])
        self.availability.serve_with_live()
