"""Routing a request and sending it to its instances, seen from the cluster front end
(PPoPP'26 §7, CONTROLLER.md D1).

The controller routes a request at arrival (its prefill instance, and on a disaggregated
cluster the decode instance, which reserves room); the request goes to its prefill instance
with a :class:`~laser.instance.handoff.DirectRoute` to that decode instance, so the prefill
instance hands it over by itself after its first token, streaming its KV layer by layer during
the final prefill chunk when ``stream_kv``. Whatever fails to answer on the way is marked dead
and the request routed again. The role of SGLang's data-parallel controller (one router in
front of the workers) and of vLLM's KV-connector "scheduler side" that picks the remote. Torch-free.
"""

from __future__ import annotations

import time

from ..core.request import Request
from ..instance.handoff import DirectRoute
from ..instance.messages import RequestInfo
from .handles import InstanceFailure
from .state import ClusterError, ClusterState, Tracked


class Dispatcher:
    """Routes (``state.controller``) and sends requests to ``state``'s instances.

    Args:
        state: the cluster's table. steps: the step tracker (an instance given a request is
            stepped). recovery: the failure handling (an instance that fails to answer is
            marked dead there). stream_kv: when the decode instance is chosen at arrival,
            stream the request's KV to it layer by layer during its final prefill chunk
            (False: all layers at the hand-off).
    """

    def __init__(self, state: ClusterState, steps, recovery, stream_kv: bool):
        self.state = state
        self.steps = steps
        self.recovery = recovery
        self.stream_kv = stream_kv
        self._hash_root: tuple[bytes, int] | None = None  # (prefix root, block size) of the instances
        self._dispatching: set[str] = set()  # requests being routed now

    def is_dispatching(self, rid: str) -> bool:
        """``rid`` is being routed now (a failure met on the way must not move it too)."""
        return rid in self._dispatching

    def info(self, req: Request) -> RequestInfo:
        """What the controller sees of ``req`` (its expected output length, its prompt's block hashes)."""
        return RequestInfo(req.req_id, req.arrival_time, req.num_tokens, req.slo.ttft, req.slo.tbt, req.slo.name,
                           self.state.controller.expected_output(req.slo.name), self._block_hashes(req))

    def _block_hashes(self, req: Request) -> tuple[bytes, ...]:
        """The prompt's block hashes for cache-aware routing, chained from the instances' root
        (asked of a prefill instance's report once; instances of one model and dtype share it)."""
        from ..core.block_manager import hash_blocks

        if self._hash_root is None:
            try:
                rep = self.state.controller.prefill[0].report()
            except (InstanceFailure, IndexError) as e:  # routed without them; the dispatch meets the failure
                if isinstance(e, InstanceFailure):
                    self.recovery.fail_instance(e.instance_id, e)
                return ()
            self._hash_root = (rep.prefix_root, rep.block_size)
        root, bs = self._hash_root
        return tuple(hash_blocks([], req.all_token_ids, bs, root)) if root else ()

    def dispatch(self, t: Tracked) -> None:
        """Route ``t`` (controller) and send it to its prefill instance, marking dead whatever
        fails to answer on the way and routing again (what the failed try left on a live
        instance is dropped there). Raises ClusterError when no live instance takes it."""
        rid = t.req.req_id
        state = self.state
        self._dispatching.add(rid)  # a failure met on the way must not move it too (no double send)
        try:
            for _ in range(len(state.handles) + 1):
                state.require_roles()
                t0 = time.perf_counter()
                route = None
                try:
                    route = state.controller.route(t.info, state.clock())
                    state.stats.routes += 1
                    state.stats.route_seconds += time.perf_counter() - t0
                    t.owner, t.decode = route.prefill, route.decode
                    self._send(t, route.prefill, route.decode)
                except InstanceFailure as e:
                    self.recovery.fail_instance(e.instance_id, e)
                    if route is not None:
                        self.recovery.drop_on_live(rid, {route.prefill, route.decode})
                    continue
                self.steps.mark_busy(route.prefill)
                return
            raise ClusterError("no live instance accepted the request")
        finally:
            self._dispatching.discard(rid)

    def _send(self, t: Tracked, prefill: int, decode: int | None) -> None:
        """Give ``t`` to its prefill instance; with a decode instance chosen already, the prefill
        instance hands it there by itself after its first token (a
        :class:`~laser.instance.handoff.DirectRoute`), streaming its KV layer by layer during
        the final prefill chunk when ``stream_kv`` (the decode instance expects it)."""
        req = t.req.copy_for_instance()
        t.direct, t.early = None, None
        handles = self.state.handles
        if decode is None or decode == prefill:
            handles[prefill].add_request(req)
            return
        key = (t.restarts, prefill) if self.stream_kv else None  # a re-prefill's stream never mixes with a lost one's
        src, dst = handles[prefill], handles[decode]
        if key is not None:
            dst.call("expect_kv", req.req_id, key)
        src.call("add_request", req, DirectRoute(decode, dst.kv_sink(), src.kv_sink(), t.restarts, dst.epoch, key))
        t.direct = decode
