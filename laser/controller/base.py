"""The global controller interface and the policy registry (PPoPP'26 §7).

A controller is torch-free policy code, like a scheduler: it sees instances only through
:class:`laser.instance.Instance` (reports, ``latency_increment``) and answers, for every
arriving request, where its prefill runs and (on a disaggregated cluster) which decode
instance receives its KV. The cluster simulator (:mod:`laser.sim.cluster`) and the cluster
front end (:mod:`laser.cluster.engine`, in process or over Ray actors) drive the same code.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..instance.interface import Instance
from ..instance.messages import InstanceReport, MigrationCandidate, RequestInfo

#: Default expected output length (tokens) before any request of a class finished.
DEFAULT_EXPECTED_OUTPUT = 128


@dataclass(frozen=True)
class Route:
    """Where a request goes: ``prefill`` (a prefill or mixed instance id); ``decode`` (a
    decode instance id chosen at arrival, or None: chosen at the hand-off, or a mixed
    cluster); ``demoted``: no prefill instance can meet its TTFT, so it is served best
    effort (queued after every request with a deadline, §7.1)."""

    prefill: int
    decode: int | None = None
    demoted: bool = False


class Controller(ABC):
    """Base class. Subclasses set ``name``, ``disaggregated`` (prefill + decode instances,
    else mixed) and ``instance_policy`` (the scheduler its instances run), and implement
    :meth:`route`.

    ``mean_output`` keeps an EWMA of output lengths per SLO class (the expected output of
    the next request of that class, CONTROLLER.md D3).
    """

    name = "base"
    disaggregated = True
    instance_policy = "laser"

    def __init__(self, **options):
        if options:
            raise ValueError(f"{self.name}: unknown options {sorted(options)}")
        self.instances: dict[int, Instance] = {}
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self.mean_output: dict[str, float] = {}
        self.decisions = 0

    def attach(self, instances: list[Instance]) -> None:
        """Take the cluster's instances (prefill + decode, or mixed). Raises ValueError if
        the roles do not fit this controller."""
        self.instances = {i.instance_id: i for i in instances}
        if self.disaggregated:
            self.prefill = [i for i in instances if i.role == "prefill"]
            self.decode = [i for i in instances if i.role == "decode"]
            if not self.prefill or not self.decode or len(self.prefill) + len(self.decode) != len(instances):
                raise ValueError(f"controller {self.name!r} needs prefill and decode instances only")
        else:
            self.prefill = [i for i in instances if i.role == "mixed"]
            self.decode = []
            if len(self.prefill) != len(instances) or not instances:
                raise ValueError(f"controller {self.name!r} needs mixed instances only")

    def policy_for(self, role: str) -> str:
        """The scheduler policy an instance of ``role`` (prefill | decode | mixed) runs under this
        controller: ``instance_policy`` for every role unless a controller says otherwise."""
        return self.instance_policy

    def expected_output(self, slo_name: str) -> int:
        return round(self.mean_output.get(slo_name, DEFAULT_EXPECTED_OUTPUT))

    # -- decisions ---------------------------------------------------------------------------
    @abstractmethod
    def route(self, info: RequestInfo, now: float) -> Route:
        """Decide where ``info`` (arriving at ``now``) runs."""

    def at_handoff(self, info: RequestInfo, chosen: int | None, now: float) -> int:
        """The decode instance that receives the KV when prefill ends (``chosen``: the one
        picked at arrival, if any). Default: keep it, else the least-loaded.

        On a real cluster (:mod:`laser.cluster`) the decode instance is chosen once, at routing:
        the prefill instance hands the request to it by itself, and this is asked only as the
        fall-back -- when no decode instance was chosen at routing (``route`` gave none, e.g.
        ``distserve``), or the chosen one died (``chosen`` is then None), or the prefill
        instances leave the mixed fall-back. The cluster simulator (:mod:`laser.sim.cluster`)
        still asks it at every hand-off."""
        return chosen if chosen is not None else least_loaded_decode(self.decode).instance_id

    def plan_migration(self, src: Instance, now: float) -> tuple[MigrationCandidate, int] | None:
        """Decode->decode migration (CONTROLLER.md A8.4, D9), asked of a decode instance ``src``
        between its steps: (the request that leaves, its destination instance id), or None.
        Default: never (the baselines do not migrate)."""
        return None

    def on_finish(self, slo_name: str, output_tokens: int, now: float, tbt: float = math.inf) -> None:
        """A request (TBT target ``tbt``) finished: update the expected output of its class
        (EWMA, weight 0.05)."""
        m = self.mean_output.get(slo_name)
        self.mean_output[slo_name] = output_tokens if m is None else 0.95 * m + 0.05 * output_tokens


def decode_load_key(rep: InstanceReport) -> tuple[int, int]:
    """Decode least-loaded order (CONTROLLER.md D4): KV blocks in use, then requests."""
    return (rep.used_blocks, rep.num_requests)


def least_loaded_decode(instances: list[Instance]) -> Instance:
    return min(instances, key=lambda i: decode_load_key(i.report()))


def prefill_load_key(rep: InstanceReport) -> tuple[int, int]:
    """Prefill least-loaded order (D4): queued + unfinished prompt tokens, then requests."""
    return (rep.pending_prefill_tokens, len(rep.queue))


def mixed_load_key(rep: InstanceReport) -> tuple[float, int]:
    """Colocated least-loaded order: KV demand in blocks (held + the queued prompts')."""
    queued = sum(-(-e.prefill_tokens // rep.block_size) for e in rep.queue)
    return (rep.used_blocks + queued, rep.num_requests)


CONTROLLERS: dict[str, type[Controller]] = {}


def register(cls: type[Controller]) -> type[Controller]:
    CONTROLLERS[cls.name] = cls
    return cls


def get_controller(name: str) -> type[Controller]:
    """Controller class by name. Raises ValueError listing the known names."""
    try:
        return CONTROLLERS[name]
    except KeyError:
        raise ValueError(f"unknown controller {name!r}; choose one of {', '.join(sorted(CONTROLLERS))}") from None

