"""Per-layer KV streaming, decode side (PPoPP'26 §7 "layer-wise KV transfer", issue 13).

The decode instance is chosen at a request's arrival (Alg. 2); the prefill instance then
sends each layer's K/V as soon as the request's final prefill chunk has written it
(:attr:`laser.model.runner.ModelRunner.kv_streams`), so most of the transfer overlaps the rest
of the prefill. Here the pieces arrive on any actor thread (:meth:`InboundKV.receive` only
queues them), and the instance's stepping thread writes them into KV blocks it allocates for
the request, between steps and at layer boundaries (:meth:`InboundKV.drain`). When the
hand-off itself comes (a small message without KV), :meth:`InboundKV.kv_for_adopt` hands the
core what is still unwritten.

A stream is keyed: pieces of an attempt the front end gave up on (its prefill instance died,
the request was re-prefilled) carry an old key and are dropped.
"""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol


class KVSink(Protocol):
    """A channel from one instance into another (in process or a Ray actor): a prefill instance
    sends a request's layers and then the request itself to its decode instance, which confirms
    back through the prefill instance's own sink (:class:`~laser.instance.handoff.DirectRoute`).
    Picklable; no method waits for the receiver, and a dead receiver is ignored (the front end
    sees the instance fail and moves the request)."""

    def send(self, req_id: str, key: Any, layer: int, k, v) -> None:
        """Deliver layer ``layer``'s K and V (``[T, kv_heads, head_dim]`` each, T = the request's
        computed tokens) of stream ``(req_id, key)``."""

    def adopt(self, sent: tuple, attempt: int, epoch: int | None, reply: "KVSink") -> None:
        """Hand the request over: the receiver's ``InstanceWorker.adopt(sent, attempt, epoch, reply)``."""

    def confirm(self, req_id: str, attempt: int | None = None) -> None:
        """Tell the sender the receiver holds ``req_id``'s attempt ``attempt`` (``InstanceWorker.confirm``)."""


@dataclass
class _Stream:
    key: Any
    pieces: dict[int, tuple] = field(default_factory=dict)  # layer -> (K, V), kept until adopted
    written: set[int] = field(default_factory=set)  # layers written into this instance's blocks


class InboundKV:
    """The streams a decode instance expects and the layers it has received.

    Args:
        kv_cache: the instance's :class:`~laser.model.kv_cache.KVCache` (allocation goes through its
            block manager). num_layers: layers of the model.
    """

    def __init__(self, kv_cache, num_layers: int):
        self.kv_cache = kv_cache
        self.num_layers = num_layers
        self.streams: dict[str, _Stream] = {}
        self._inbox: collections.deque = collections.deque()  # appended by any thread
        self.bytes_received = 0

    def expect(self, req_id: str, key: Any) -> None:
        """Accept stream ``(req_id, key)`` (a previous stream of ``req_id`` is dropped)."""
        self.drop(req_id)
        self.streams[req_id] = _Stream(key)

    def receive(self, req_id: str, key: Any, layer: int, k, v) -> None:
        """Queue one layer (any thread; written by the next :meth:`drain`)."""
        self._inbox.append((req_id, key, layer, k, v))

    def drain(self) -> None:
        """Stepping thread: take the queued layers; write each expected one into blocks allocated
        now (a full pool leaves it unwritten until the hand-off); drop stale or unexpected ones."""
        import torch

        from ..core.block_manager import OutOfBlocksError

        while self._inbox:
            rid, key, layer, k, v = self._inbox.popleft()
            s = self.streams.get(rid)
            if s is None or s.key != key:
                continue
            with warnings.catch_warnings():  # a Ray-delivered array is read-only: we only read it
                warnings.simplefilter("ignore", UserWarning)
                k, v = torch.as_tensor(k), torch.as_tensor(v)
            s.pieces[layer] = (k, v)
            self.bytes_received += k.nbytes + v.nbytes
            try:
                if layer in s.written:
                    self.kv_cache.write_layer(rid, layer, k, v)
                else:
                    self.kv_cache.import_layer(rid, layer, k, v)
                    s.written.add(layer)
            except OutOfBlocksError:
                pass

    def complete(self, req_id: str) -> bool:
        """Every layer of ``req_id``'s stream has arrived (after :meth:`drain`)."""
        s = self.streams.get(req_id)
        return s is not None and len(s.pieces) == self.num_layers

    def kv_for_adopt(self, req_id: str) -> list:
        """Per layer: None where the layer is already in this instance's blocks, else (K, V)
        (see :meth:`laser.model.runner.ModelRunner.import_kv`). Raises KeyError when no stream."""
        s = self.streams[req_id]
        return [None if layer in s.written else s.pieces[layer] for layer in range(self.num_layers)]

    def import_failed(self, req_id: str) -> None:
        """The adoption raised OutOfBlocksError and freed ``req_id``'s blocks: nothing is written."""
        s = self.streams.get(req_id)
        if s is not None:
            s.written.clear()

    def adopted(self, req_id: str) -> None:
        """The request now runs here: forget its stream (its blocks now belong to the scheduler)."""
        self.streams.pop(req_id, None)

    def drop(self, req_id: str) -> bool:
        """Forget ``req_id``'s stream and free the blocks written for it. True if there was one."""
        s = self.streams.pop(req_id, None)
        if s is None:
            return False
        if s.written:
            self.kv_cache.block_manager.free(req_id)
        return True

    def pending(self) -> int:
        """Streams expected or in progress (not adopted yet)."""
        return len(self.streams)
