"""The cluster front end's records: the table every part reads (:class:`ClusterState`: the
instances, the requests, the router, the counters), its copy of each request and of each
transfer. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..core.request import Request
from ..frontend.admission import EngineUnavailableError
from ..instance.messages import RequestInfo
from .handles import Call, InstanceHandle


class ClusterError(EngineUnavailableError, RuntimeError):
    """The cluster cannot serve: no live instance of a role it needs (the server answers 503
    with ``Retry-After``: an instance may return, Ray restarting it)."""


@dataclass(eq=False)  # compared by identity (membership of ``_transfers``)
class Tracked:
    """The front end's copy of one request: what was streamed, and where it is."""

    req: Request  # prompt, sampling params, SLO, arrival; output_token_ids/token_times as streamed
    info: RequestInfo
    owner: int  # instance that holds it now (its prefill instance until adopted)
    decode: int | None = None  # decode instance chosen (reserved) or holding it
    transfer: "Transfer | None" = None
    restarts: int = 0  # its attempt number: re-prefills count up
    direct: int | None = None  # the decode instance its prefill instance hands it to by itself
    # a direct adoption read before the prefill's hand-off event: (adopt's answer, refusal, the
    # decode instance's events for it meanwhile), applied when that event is read
    early: tuple | None = None
    # its hand-off is being re-sent after its decode instance died (that fail-over is counted): if
    # the prefill instance no longer holds it (a direct hand-off that decode instance had confirmed),
    # the re-prefill that follows is the same fail-over, not another one
    resend: bool = False


@dataclass
class Transfer:
    """A hand-off or migration on its way from instance ``src`` to ``dst``: pulled by the front
    end (``take`` / ``adopt`` calls) or ``direct`` (the prefill instance sends it by itself;
    the decode instance's step answers say when it arrived), since ``started`` (monotonic s)."""

    src: int
    dst: int
    take: Call | None
    adopt: Call | None
    migration: bool = False  # a decode -> decode move (else the prefill -> decode hand-off)
    direct: bool = False
    started: float = 0.0


@dataclass
class ClusterStats:
    """Counters of the cluster front end (exported by the server's ``/metrics``)."""

    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: list[float] = field(default_factory=list)  # per hand-off, send -> written
    transfer_layers: int = 0  # layers per hand-off (the model's)
    streamed_transfers: int = 0  # hand-offs whose KV was streamed layer by layer during prefill
    handoff_seconds: list[float] = field(default_factory=list)  # per hand-off, prefill end -> adopted
    resends: int = 0  # hand-offs re-sent to another decode instance
    migrations: int = 0  # decode -> decode moves started (KV and sampler state, CONTROLLER.md D9)
    migration_seconds: list[float] = field(default_factory=list)  # per completed move, send -> adopted
    recoveries: int = 0  # requests re-prefilled after their instance failed
    seeded_recoveries: int = 0  # of those, seeded sampled ones (each continues its seeded stream)
    recovery_seconds: list[float] = field(default_factory=list)  # failure -> next token
    instance_failures: int = 0
    rejoins: int = 0  # dead instances that answered again (restarted by Ray) and rejoined, empty
    node_restarts: int = 0  # times the lost node was started again with its instances (node.py)
    routes: int = 0
    route_seconds: float = 0.0


class ClusterState:
    """The one owner of what every part of :class:`~laser.cluster.engine.ClusterEngine` reads:
    the instances (``handles``: id -> :class:`~.handles.InstanceHandle`, replaced whole when a
    lost node comes back), the request table (``requests``: req id -> :class:`Tracked`), the
    router now (``controller``: ``main_controller``, or the mixed fallback's while a
    disaggregated cluster has no decode instance), the counters (``stats``) and the cluster
    clock (``clock``, seconds). The parts own the rest (in flight, waiting, probing) themselves
    (vLLM v1's engine-core client keeps one table of its engines the same way)."""

    def __init__(self, handles: list[InstanceHandle], controller, clock: Callable[[], float]):
        self.handles: dict[int, InstanceHandle] = {h.instance_id: h for h in handles}
        self.controller = controller
        self.main_controller = controller
        self.clock = clock
        self.requests: dict[str, Tracked] = {}
        self.stats = ClusterStats()

    def live(self) -> list[InstanceHandle]:
        """The instances not marked dead, in id order of insertion."""
        return [h for h in self.handles.values() if h.alive]

    def require_roles(self) -> None:
        """Raises ClusterError unless a live instance of every role the router needs remains."""
        live = self.live()
        roles = {h.role for h in live}
        if self.controller.disaggregated and not {"prefill", "decode"} <= roles or not live:
            raise ClusterError(f"no live instance of a needed role (live: {sorted(roles) or 'none'})")
