"""Prefill -> decode disaggregation between two instances in one process.

The prefill instance (role ``prefill``) stops each request after its first token and
exports its KV layer by layer (:class:`~laser.frontend.engine.Handoff`); the decode instance
(role ``decode``) imports it and continues. The global controller over many instances
(and Ray) builds on the same two calls: ``Engine.handoffs`` and ``Engine.accept_handoff``.
"""

from __future__ import annotations

from ..instance.handoff import AdoptQueue
from .engine import Engine
from .outputs import RequestOutput


class DisaggregatedPair:
    """One prefill instance feeding one decode instance; stepped alternately.

    Hand-offs that the decode instance cannot hold yet (KV pool full) wait in order
    (:class:`~laser.instance.handoff.AdoptQueue`).
    """

    def __init__(self, prefill: Engine, decode: Engine):
        if prefill.role != "prefill" or decode.role != "decode":
            raise ValueError("need a prefill-role engine and a decode-role engine")
        self.prefill = prefill
        self.decode = decode
        self.adopts = AdoptQueue()
        self.adopted: dict = {}  # req_id -> the decode instance's Request

    def add_request(self, *args, **kwargs):
        return self.prefill.add_request(*args, **kwargs)

    def abort(self, req_id: str) -> bool:
        self.adopts.drop(req_id)
        return self.prefill.abort(req_id) or self.decode.abort(req_id)

    def resolve(self, req):
        """The request's latest state (its decode-instance copy after the hand-off)."""
        return self.adopted.get(req.req_id, req)

    def has_unfinished(self) -> bool:
        return self.prefill.has_unfinished() or self.decode.has_unfinished() or bool(self.adopts)

    def step(self) -> list[RequestOutput]:
        outs = self.prefill.step()
        for h in self.prefill.handoffs:
            self.adopts.deliver(h)
        self.prefill.handoffs.clear()
        for req in self.adopts.adopt_ready(self.decode.accept_handoff):
            self.adopted[req.req_id] = req
        return outs + self.decode.step()
