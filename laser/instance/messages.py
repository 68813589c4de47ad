"""Messages between the global controller and its instances (PPoPP'26 §7, Fig. 4).

Plain, picklable dataclasses of numbers and strings: they cross a process boundary (a
Ray actor's calls) unchanged. Torch-free. Times are absolute seconds on the cluster's
clock (virtual in the simulator); token counts are tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..scheduler.report import QueueEntry, SchedulerReport


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the controller knows of a request when it routes it.

    ``expected_output`` is the controller's estimate of its output length (tokens; the
    paper's Laser has no prior knowledge of it, CONTROLLER.md D3: the class mean), used
    only for the decode memory check. ``ttft``/``tbt`` are None for no target.
    ``block_hashes``: the chained hashes of its prompt's full blocks
    (:func:`laser.core.block_manager.hash_blocks` from the instances' ``prefix_root``; empty when
    unknown), matched against each instance's cache summary for cache-aware routing.
    """

    req_id: str
    arrival_time: float
    prompt_len: int
    ttft: float | None
    tbt: float | None
    slo_name: str = "best_effort"
    expected_output: int = 128
    block_hashes: tuple[bytes, ...] = ()

    @property
    def ttft_deadline(self) -> float:
        """Arrival + TTFT target (the EDF key; inf without a target)."""
        return math.inf if self.ttft is None else self.arrival_time + self.ttft

    @property
    def tbt_or_inf(self) -> float:
        return math.inf if self.tbt is None else self.tbt


@dataclass(frozen=True, slots=True)
class InstanceReport:
    """An instance's state for the controller (§7.1 "scheduling decisions and request
    statistics"; CONTROLLER.md A0 lists the fields).

    ``scheduler``: its scheduler's :class:`~laser.scheduler.report.SchedulerReport` (the queue of
    requests with prefill work left, in the scheduler's order, including those delivered and not
    yet added; the decode contexts; T_g; the counters) -- the one picture of its queue, read by
    the controller and cluster admission alike. ``busy_until``: predicted end of the executing
    step (== ``time`` when idle). ``num_decoding`` / ``sum_context`` count the hand-offs on their
    way too. ``cached_blocks``: hashes of (up to a bound) the KV blocks in its prefix cache, the
    most recently used first (:meth:`laser.core.block_manager.BlockManager.summary`);
    ``prefix_root``: the root of its hash chains (requests are hashed with it; instances of one
    model and dtype share it).
    """

    instance_id: int
    role: str  # prefill | decode | mixed
    time: float
    busy_until: float
    scheduler: SchedulerReport
    num_decoding: int
    num_reserved: int
    sum_context: int
    free_blocks: int
    total_blocks: int
    block_size: int
    icache_used: int
    icache_capacity: int
    cached_blocks: frozenset = frozenset()
    prefix_root: bytes = b""

    @property
    def queue(self) -> tuple[QueueEntry, ...]:
        """Requests with prefill work left, in the instance's queue order."""
        return self.scheduler.queue

    @property
    def t_g(self) -> float:
        """Tightest TBT target of its decode requests (seconds; inf: none)."""
        return self.scheduler.t_g

    @property
    def iteration_s(self) -> float | None:
        """Last measured decode iteration (seconds; None: none yet)."""
        return self.scheduler.last_iteration_s

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in its prefix cache so far (vLLM's counter)."""
        return self.scheduler.counters.get("prefix_cache_queries", 0)

    @property
    def prefix_cache_hits(self) -> int:
        """Of :attr:`prefix_cache_queries`, the tokens found cached."""
        return self.scheduler.counters.get("prefix_cache_hits", 0)

    def cached_prefix_tokens(self, info: RequestInfo) -> int:
        """Prompt tokens of ``info`` this instance's prefix cache holds, as its scheduler would
        find them: the leading blocks of ``info.block_hashes`` in ``cached_blocks``, at most
        ``prompt_len - 1`` tokens (the last one is computed for its logits)."""
        k, held = 0, self.cached_blocks
        if not held:
            return 0
        for h in info.block_hashes[: max(0, info.prompt_len - 1) // self.block_size]:
            if h not in held:
                break
            k += 1
        return k * self.block_size

    @property
    def pending_prefill_tokens(self) -> int:
        """Queued plus unfinished prompt tokens (the prefill fallback's "fewest tokens")."""
        return self.scheduler.pending_prefill_tokens

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def num_requests(self) -> int:
        return len(self.queue) + self.num_decoding + self.num_reserved


@dataclass(frozen=True, slots=True)
class LatencyIncrement:
    """A decode instance's answer to ``LatencyIncrement(r*)`` (Alg. 2 lines 1-9).

    ``value``: increase of the aggregate TBT of its requests, seconds; inf when the
    strictest TBT (``reason == "slo"``) or the KV pool (``reason == "memory"``) would
    break. ``iter_before``/``iter_after``: predicted worst iteration without/with r*.
    """

    instance_id: int
    req_id: str
    value: float
    iter_before: float = 0.0
    iter_after: float = 0.0
    reason: str = "ok"  # ok | slo | memory
    num_requests: int = 0
    used_blocks: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.value != math.inf


@dataclass(frozen=True, slots=True)
class MigrationCandidate:
    """A decode instance's answer to "must a request leave?" (CONTROLLER.md A8.4, D9):
    ``reason`` ``memory`` (free KV blocks below one step of growth) or ``slo`` (Alg. 1 cannot
    bring the predicted iteration under T_g); ``info``: the request that should leave, as the
    controller routes it (``prompt_len`` = its context now, ``expected_output`` = the tokens it
    is still expected to generate); ``blocks``: KV blocks per layer it holds."""

    instance_id: int
    reason: str
    info: RequestInfo
    blocks: int
