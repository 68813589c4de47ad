"""The prefill -> decode hand-off on the instances: one owner for its three pieces of state.

Torch-free. The model is vLLM's KV connector split (``KVConnectorBase_V1``: a scheduler side
that decides what leaves and what is admitted, a worker side that moves the bytes): here the
core exports a request after its first token (:meth:`~laser.instance.core.InstanceCore.export`)
and adopts one (:meth:`~laser.instance.core.InstanceCore.adopt`); this module keeps what lies
between the two:

* :class:`Outbox` (prefill side): each exported hand-off, kept until the decode instance
  confirms it holds the request -- so a decode instance that dies mid-transfer costs a re-send,
  not a re-prefill (vLLM's ``request_finished`` -> ``delay_free``; DistServe frees on
  ``clear_migrated_blocks_callback``) -- and each request's :class:`DirectRoute`: the decode
  instance chosen when the request was routed, which the prefill instance streams the KV to
  and hands the request to itself, instance to instance, after the first token (the cluster
  front end learns the outcome from the decode instance's step answers).
* :class:`AdoptQueue` (decode side): hand-offs delivered (or due at a virtual time), adopted
  in delivery order as the KV pool can hold them (DistServe's decoding-stage ``post_process``
  admits migrations only when their blocks fit); a hand-off that does not fit blocks the ones
  behind it, so none overtakes another.
* :class:`Fences` (decode side): the front end's fencing tokens -- a request's attempt number
  (a re-prefill raises it: a late hand-off of an attempt given up on is refused) and the
  instance's epoch (raised when the front end marked the instance dead: a step or hand-off sent
  before is refused), CONTROLLER.md A9/D10.

Used by the in-process pair (:class:`laser.frontend.disagg.DisaggregatedPair`), both simulators
(:class:`laser.sim.instance.SimInstance`, :class:`laser.sim.cluster_instance.SimClusterInstance`)
and the instance of a cluster (:class:`laser.instance.worker.InstanceWorker`, in process or a
Ray actor).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.block_manager import OutOfBlocksError
from ..core.request import Request
from .core import Handoff

__all__ = ["AdoptQueue", "DirectRoute", "Fences", "Outbox", "StaleHandoff"]


class StaleHandoff(KeyError):
    """A hand-off (or step) the receiving instance refuses: its attempt was fenced by an abort,
    or it was sent under an epoch older than the instance's."""

    def __str__(self) -> str:  # KeyError quotes its argument; this is a sentence
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class DirectRoute:
    """Where a prefill instance hands a request off by itself: the decode instance chosen when
    the request was routed (picklable: it travels with the request to a Ray actor).

    ``peer``: a channel into decode instance ``dst`` (:class:`~laser.instance.kv_stream.KVSink`:
    ``send`` a streamed layer, ``adopt`` the hand-off); ``reply``: a channel back into the
    prefill instance, whose ``confirm`` the decode instance calls once it holds the request.
    ``attempt`` / ``epoch``: the front end's attempt of the request and epoch of ``dst`` when it
    routed it (the decode side's :class:`Fences` refuse stale ones). ``stream_key``: the KV
    streams layer by layer during the final prefill chunk under this key; None: the whole KV
    goes with the hand-off.
    """

    dst: int
    peer: Any
    reply: Any
    attempt: int = 0
    epoch: int | None = None
    stream_key: Any = None


class Outbox:
    """Prefill side: exported hand-offs by request id, kept until :meth:`confirm`; the
    :class:`DirectRoute` of each request routed with one, and the decode instance each
    request's KV is streamed to."""

    def __init__(self):
        self.handoffs: dict[str, Handoff] = {}
        self.routes: dict[str, DirectRoute] = {}  # req id -> where it goes by itself after its first token
        self.streamed_to: dict[str, int] = {}  # req id -> decode instance id its layers go to

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.handoffs

    def __len__(self) -> int:
        return len(self.handoffs)

    def __iter__(self):
        return iter(self.handoffs)

    def put(self, h: Handoff) -> None:
        """Keep ``h`` (a hand-off after the first token, or a decode request migrating out)."""
        self.handoffs[h.request.req_id] = h

    def route(self, req_id: str, route: DirectRoute) -> None:
        """``req_id`` goes to ``route.dst`` by itself (and streams its KV there if
        ``route.stream_key`` is set)."""
        self.routes[req_id] = route
        if route.stream_key is not None:
            self.streamed_to[req_id] = route.dst

    def direct(self, h: Handoff) -> tuple[DirectRoute, Handoff] | None:
        """Keep ``h`` (:meth:`put`); when its request has a route, the route and what to send
        along it (without the KV when streamed there), else None (the front end pulls it)."""
        self.put(h)
        rid = h.request.req_id
        route = self.routes.get(rid)
        return None if route is None else (route, self.take(rid, route.dst))

    def take(self, req_id: str, dst: int | None = None) -> Handoff:
        """``req_id``'s hand-off (kept here until :meth:`confirm`), without its KV (``kv=None``)
        when every layer was already streamed to instance ``dst``. Raises KeyError when it is
        not here."""
        import dataclasses

        h = self.handoffs[req_id]
        if dst is not None and self.streamed_to.get(req_id) == dst:
            h = dataclasses.replace(h, kv=None)
        return h

    def confirm(self, req_id: str, attempt: int | None = None) -> None:
        """The decode instance holds ``req_id``: drop the kept copy (and its route). ``attempt``:
        the front end's attempt number of the hand-off that was adopted (a direct hand-off's
        confirm, from the decode instance or the front end): a confirm of an older attempt than
        the request's route here, or of a request with no route here, is stale and dropped
        (it reached this instance after the request was re-prefilled; None: the front end's
        confirm of a hand-off it pulled itself)."""
        if attempt is not None:
            route = self.routes.get(req_id)
            if route is None or route.attempt > attempt:
                return
        self.drop(req_id)

    def finished(self, req_id: str) -> None:
        """``req_id`` finished here (no hand-off): forget its route."""
        self.streamed_to.pop(req_id, None)
        self.routes.pop(req_id, None)

    def drop(self, req_id: str) -> bool:
        """Forget everything of ``req_id`` (aborted). True if a hand-off was kept."""
        self.finished(req_id)
        return self.handoffs.pop(req_id, None) is not None

    def clear(self) -> None:
        self.handoffs.clear()
        self.routes.clear()
        self.streamed_to.clear()


class Fences:
    """Decode side fencing tokens: per request the lowest attempt still accepted, and the
    instance's epoch. Both only grow until :meth:`reset`."""

    def __init__(self):
        self.attempts: dict[str, int] = {}
        self.epoch = 0

    def stale_epoch(self, epoch: int | None) -> bool:
        """A call sent under ``epoch`` (None: unfenced) predates the instance's current epoch."""
        return epoch is not None and epoch < self.epoch

    def fence(self, req_id: str, attempt: int) -> None:
        """Refuse hand-offs of ``req_id`` older than ``attempt`` (it is re-prefilled as that)."""
        self.attempts[req_id] = max(attempt, self.attempts.get(req_id, 0))

    def check(self, req_id: str, attempt: int = 0, epoch: int | None = None) -> None:
        """Raises StaleHandoff when a hand-off of ``req_id`` (attempt ``attempt``, sent under
        ``epoch``) is fenced; else nothing."""
        if self.stale_epoch(epoch):
            raise StaleHandoff(f"stale hand-off of {req_id} (sent in epoch {epoch} < {self.epoch}: instance fenced)")
        if attempt < self.attempts.get(req_id, 0):
            raise StaleHandoff(f"stale hand-off of {req_id} (attempt {attempt} < {self.attempts[req_id]})")

    def reset(self, epoch: int | None = None) -> None:
        """Forget the attempt fences (the instance is emptied); raise the epoch to ``epoch``."""
        if epoch is not None:
            self.epoch = max(self.epoch, epoch)
        self.attempts.clear()


@dataclass(order=True)
class _Entry:
    due: float  # when the hand-off reaches the instance (virtual s; -inf: already there)
    seq: int
    handoff: Handoff = field(compare=False)


class AdoptQueue:
    """Decode side: hand-offs waiting to be adopted, in delivery order.

    A hand-off is delivered now (:meth:`deliver` without ``at``) or at a virtual time ``at``
    (the simulators: it is on its way until then). :meth:`adopt_ready` moves the due ones, by
    ``(at, delivery order)``, behind those already waiting, then adopts from the head while the
    KV pool holds them; the first that does not fit (or whose streamed layers have not all
    arrived) stops the queue. :attr:`fences` refuses stale deliveries.
    """

    def __init__(self):
        self._coming: list[_Entry] = []  # heap: delivered for a later time
        self._waiting: list[_Entry] = []  # due, in order; the head is adopted first
        self._seq = itertools.count()
        self.fences = Fences()

    def __len__(self) -> int:
        return len(self._coming) + len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._coming or self._waiting)

    def deliver(self, h: Handoff, at: float | None = None, attempt: int = 0, epoch: int | None = None) -> None:
        """Queue ``h``, due now (``at`` None) or at virtual time ``at``. ``attempt`` / ``epoch``:
        the front end's attempt of the request and epoch of this instance when it was sent.
        Raises StaleHandoff (nothing queued) when :attr:`fences` refuse it."""
        self.fences.check(h.request.req_id, attempt, epoch)
        e = _Entry(-math.inf if at is None else at, next(self._seq), h)
        if at is None:
            self._waiting.append(e)
        else:
            heapq.heappush(self._coming, e)

    def release(self, now: float) -> None:
        """Move the hand-offs due by ``now`` behind the waiting ones."""
        while self._coming and self._coming[0].due <= now:
            self._waiting.append(heapq.heappop(self._coming))

    def adopt_ready(self, adopt: Callable[[Handoff], Request | None], now: float = math.inf) -> list[Request]:
        """Release what is due by ``now``, then adopt from the head in order: ``adopt(h)`` returns
        the instance's request, None when ``h`` is not ready yet (streamed layers on their way),
        or raises OutOfBlocksError (nothing kept) when the pool cannot hold it; either stops the
        queue. Returns the requests adopted."""
        self.release(now)
        done = []
        while self._waiting:
            try:
                req = adopt(self._waiting[0].handoff)
            except OutOfBlocksError:
                break
            if req is None:
                break
            self._waiting.pop(0)
            done.append(req)
        return done

    def num_waiting(self) -> int:
        """Hand-offs due and not adopted yet (their KV did not fit, or their layers are on their way)."""
        return len(self._waiting)

    def next_due(self, after: float = -math.inf) -> float:
        """The earliest time a hand-off not yet released is due, later than ``after`` (inf: none)."""
        if after == -math.inf:
            return self._coming[0].due if self._coming else math.inf
        return min((e.due for e in self._coming if e.due > after), default=math.inf)

    def earliest(self) -> float:
        """The earliest due time of any hand-off held (waiting ones included; inf: none)."""
        return min((e.due for e in itertools.chain(self._waiting, self._coming)), default=math.inf)

    def requests(self) -> list[Request]:
        """The prefill-side requests of the hand-offs held: on their way, then waiting."""
        return [e.handoff.request for e in itertools.chain(self._coming, self._waiting)]

    def ids(self) -> set[str]:
        return {e.handoff.request.req_id for e in itertools.chain(self._coming, self._waiting)}

    def drop(self, req_id: str, fence: int | None = None) -> bool:
        """Remove ``req_id``'s hand-offs (aborted); ``fence``: refuse its attempts below this from
        now on. True if one was held."""
        if fence is not None:
            self.fences.fence(req_id, fence)
        n = len(self)
        self._waiting = [e for e in self._waiting if e.handoff.request.req_id != req_id]
        coming = [e for e in self._coming if e.handoff.request.req_id != req_id]
        if len(coming) != len(self._coming):
            heapq.heapify(coming)
            self._coming = coming
        return n != len(self)

    def reset(self, epoch: int | None = None) -> None:
        """Drop every hand-off and attempt fence; raise the epoch (see :meth:`Fences.reset`)."""
        self._coming.clear()
        self._waiting.clear()
        self.fences.reset(epoch)

