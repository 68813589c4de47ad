"""The interface between the global controller and one instance (PPoPP'26 §7).

A simulated instance (:class:`laser.sim.cluster_instance.SimClusterInstance`) implements it,
and so does a real instance (:class:`laser.instance.worker.InstanceWorker`, in process or as
a Ray actor). Arguments and answers are plain
data (:mod:`laser.instance.messages`). Torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..core.request import Request
from .messages import InstanceReport, LatencyIncrement, MigrationCandidate, RequestInfo

ROLES = ("prefill", "decode", "mixed")


class Instance(ABC):
    """One serving instance as the controller sees it.

    Attributes: ``instance_id`` (unique int), ``role`` (prefill | decode | mixed),
    ``latency_model`` (its fitted/analytic model: the controller's Profiler owns a copy,
    §7, Fig. 4), ``num_layers``.
    """

    instance_id: int
    role: str
    latency_model: object
    num_layers: int

    @abstractmethod
    def add_request(self, req: Request, at: float) -> None:
        """Deliver ``req`` at time ``at`` (s). On a prefill or mixed instance it joins the
        EDF queue; on a decode instance it carries its KV (``req.num_computed_tokens``
        tokens at every layer) and joins decoding once the pool holds it."""

    @abstractmethod
    def abort(self, req_id: str, at: float) -> bool:
        """Drop the request and free its state; False if unknown here."""

    @abstractmethod
    def report(self) -> InstanceReport:
        """Current state (queue, KV, decode T_g, iteration time, intermediate cache)."""

    @abstractmethod
    def latency_increment(self, info: RequestInfo) -> LatencyIncrement:
        """Alg. 2 lines 1-9 on a copy of this instance's decode state with ``info`` added
        (inf on an SLO or KV-memory break). Changes nothing."""

    def reserve(self, info: RequestInfo) -> None:
        """Pre-allocate ``info`` (CONTROLLER.md D2): it counts in later increments until
        it arrives or is released. Default: nothing."""

    def release(self, req_id: str) -> None:
        """Drop a reservation made by :meth:`reserve`."""

    def migration_candidate(self, expected_output: dict[str, float]) -> MigrationCandidate | None:
        """Decode role: the request that must leave (KV memory or T_g broke, CONTROLLER.md D9;
        :func:`laser.instance.state.migration_candidate`), None when none must. ``expected_output``:
        the controller's expected output length per SLO class (tokens). Default: None."""
        return None
