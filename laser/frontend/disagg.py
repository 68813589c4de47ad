"""Prefill -> decode disaggregation between two instances in one process.

The prefill instance (role ``prefill``) stops each request after its first token and
exports its KV layer by layer (:class:`~laser.frontend.engine.Handoff`); the decode instance
(role ``decode``) imports it and continues. The global controller over many instances
(and Ray) builds on the same two calls: ``Engine.handoffs`` and ``Engine.accept_handoff``.
"""

from __future__ import annotations

from ..core.block_manager import OutOfBlocksError
from .engine import Engine, RequestOutput


class DisaggregatedPair:
    """One prefill instance feeding one decode instance; stepped alternately.

    Hand-offs that the decode instance cannot hold yet (KV pool full) wait in order.
    """

    def __init__(self, prefill: Engine, decode: Engine):
        if prefill.role != "prefill" or decode.role != "decode":
            raise ValueError("need a prefill-role engine and a decode-role engine")
        self.prefill = prefill
        self.decode = decode
        self._pending = []
        self.adopted: dict = {}  # req_id -> the decode instance's Request

    def add_request(self, *args, **kwargs):
        return self.prefill.add_request(*args, **kwargs)

    def abort(self, req_id: str) -> bool:
        self._pending = [h for h in self._pending if h.request.req_id != req_id]
        return self.prefill.abort(req_id) or self.decode.abort(req_id)

    def resolve(self, req):
        """The request's latest state (its decode-instance copy after the hand-off)."""
        return self.adopted.get(req.req_id, req)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        outs = self.prefill.step()
        self._pending.extend(self.prefill.handoffs)
        self.prefill.handoffs.clear()
        while self._pending:
            try:
                req = self.decode.accept_handoff(self._pending[0])
                self.adopted[req.req_id] = req
            except OutOfBlocksError:
                break
            self._pending.pop(0)
        return outs + self.decode.step()
