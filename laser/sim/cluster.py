"""Cluster simulator: many simulated instances and the real controller on one virtual clock.

Torch-free. Every instance runs its real scheduler on a latency model
(:class:`~laser.sim.cluster_instance.SimClusterInstance`); the controller is the real
controller code (:mod:`laser.controller`), talking to instances through the instance
interface. One event queue (:mod:`laser.sim.events`) orders everything:

* ``arrive``: the controller routes the request; it reaches its prefill (or mixed)
  instance one controller->instance message later (``msg_delay_s``, default 1 ms).
* ``wake``: a delivery is due at an idle instance: it starts a step.
* ``end``: an instance's step reaches its predicted end: the step is executed layer by
  layer (deliveries released at the layer boundary after their time; a Laser stop can end
  it earlier, and the instance then runs on from its own clock). Finished requests are
  recorded; prefill hand-offs go to the controller's decode instance with their KV.

KV transfer (§8): ``bytes = tokens · 2·kv_heads·head_dim·dtype_bytes`` per layer; the
link is NVLink inside a node (the hardware's ``link_bw``) and the LAN between nodes
(``inter_node_bw``, 100 Gbps = 12.5 GB/s in the paper's testbed). The KV of a decode
instance chosen at arrival streams layer by layer during prefill, so it is ready at
``max(prefill end + one layer's transfer, prefill start + whole transfer)``; a decode
instance chosen (or changed) at the hand-off receives it all after prefill (DistServe's
pull). Instances fill nodes of ``gpus_per_node`` GPUs in order, ``tp`` GPUs each;
prefill and decode instances alternate so that P and D share nodes where they can.

Decode->decode migration (§8, CONTROLLER.md A8.4, D9): after each step of a decode
instance the controller may move one request out (:meth:`Controller.plan_migration`); its
KV leaves the source at once and reaches the destination one controller message plus the
whole transfer later (as a pulled prefill->decode transfer), where it is adopted and
decodes on from its last token (the transfer is a gap in its token times).

What is not modelled: link contention between concurrent transfers, the controller's own
compute time (measured separately in wall time: ``decision_wall_s``), Llumnix's multi-stage
live copy (decoding on at the source while the bulk of the KV moves; here the request
pauses for the whole copy and the source frees its blocks when it starts), failures.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field

from ..core.config import SchedulerConfig
from ..controller import Controller, get_controller
from ..instance.messages import RequestInfo
from ..core.request import Request
from ..latency.machine_speed import refuse_scattered
from .cluster_instance import SimClusterInstance
from .events import EventQueue

#: GPU memory per device, bytes (vendor datasheets); the KV pool is what weights leave of ``mem_fraction``.
GPU_MEMORY = {"a100-80gb": 80e9, "h100-sxm": 80e9, "h200": 141e9, "cpu-2core": 16e9}


@dataclass(frozen=True)
class ClusterSpec:
    """Instance counts: ``"8P8D"`` (8 prefill + 8 decode) or ``"16M"`` (16 mixed)."""

    num_prefill: int = 0
    num_decode: int = 0
    num_mixed: int = 0

    @classmethod
    def parse(cls, s: str) -> "ClusterSpec":
        """Raises ValueError for anything but ``<n>P<m>D`` or ``<n>M``."""
        m = re.fullmatch(r"\s*(?:(\d+)P(\d+)D|(\d+)M)\s*", s, re.IGNORECASE)
        if not m:
            raise ValueError(f"bad cluster {s!r}: want e.g. 8P8D or 16M")
        if m.group(3):
            spec = cls(num_mixed=int(m.group(3)))
        else:
            spec = cls(num_prefill=int(m.group(1)), num_decode=int(m.group(2)))
        if spec.total < 1 or (spec.num_mixed == 0 and (spec.num_prefill < 1 or spec.num_decode < 1)):
            raise ValueError(f"bad cluster {s!r}: need at least one prefill and one decode instance, or one mixed")
        return spec

    @property
    def total(self) -> int:
        return self.num_prefill + self.num_decode + self.num_mixed

    def layout_for(self, disaggregated: bool) -> "ClusterSpec":
        """The same instance count in the controller's shape: a mixed spec splits in half
        (prefill gets the smaller half); a P/D spec becomes all mixed."""
        if disaggregated and self.num_mixed:
            p = max(1, self.num_mixed // 2)
            return ClusterSpec(num_prefill=p, num_decode=max(1, self.num_mixed - p))
        if not disaggregated and not self.num_mixed:
            return ClusterSpec(num_mixed=self.total)
        return self

    def __str__(self) -> str:
        return f"{self.num_mixed}M" if self.num_mixed else f"{self.num_prefill}P{self.num_decode}D"


@dataclass
class ClusterConfig:
    """Hardware and instance knobs of a simulated cluster.

    ``latency_model``: one instance's model (all instances alike); ``tp``: GPUs per
    instance; ``params``: model parameters (for the KV pool size); ``kv_bytes_per_token_layer``.
    """

    latency_model: object
    kv_bytes_per_token_layer: int
    num_blocks: int
    tp: int = 1
    gpus_per_node: int = 4
    intra_node_bw: float = 300e9  # bytes/s (NVLink)
    inter_node_bw: float = 12.5e9  # bytes/s (100 Gbps LAN)
    msg_delay_s: float = 1e-3
    block_size: int = 16
    prefill_icache_tokens: int = 16384  # paper §8
    decode_icache_tokens: int = 2048
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_num_seqs=512,
                                                                               max_num_batched_tokens=2048))
    mixed_token_budget: int | None = None  # Sarathi's chunk budget on mixed instances
    # Model each instance's prefix cache (the engine's block manager) and route by the cache
    # summaries in the reports (requests must carry real token ids: hits where they share them).
    enable_prefix_caching: bool = False
    # ... with the controller told each prompt's block hashes (False: prefix-blind routing)
    cache_aware_routing: bool = True


def paper_config(model: str = "qwen2.5-14b", hardware: str = "a100-80gb", tp: int | None = None,
                 mem_fraction: float = 0.9, **overrides) -> ClusterConfig:
    """A :class:`ClusterConfig` for a paper-scale model on the analytic latency model
    (an ESTIMATE, :class:`~laser.latency.AnalyticLatencyModel`): TP as in §9
    (Qwen2.5-14B 1, Qwen2.5-32B 2, Llama-3-70B 4) unless given; the KV pool is
    ``mem_fraction`` of the instance's GPU memory minus the bf16 weights."""
    from ..latency import HARDWARE, AnalyticLatencyModel, ModelShape

    hw = HARDWARE[hardware_name(hardware)]
    shape = ModelShape.preset(model)
    tp = tp or {"qwen2.5-14b": 1, "qwen2.5-32b": 2, "llama-3-70b": 4}.get(model.lower(), 1)
    lm = AnalyticLatencyModel(shape, hw, tp=tp)
    kv_layer = 2 * shape.kv_heads * shape.head_dim * 2
    block = overrides.pop("block_size", 16)
    free = GPU_MEMORY.get(hw.name, 80e9) * tp * mem_fraction - 2 * shape.num_params()
    if free <= 0:
        raise ValueError(f"{model} does not fit {tp} x {hw.name}")
    blocks = int(free // (kv_layer * shape.layers * block))
    return ClusterConfig(latency_model=lm, kv_bytes_per_token_layer=kv_layer, num_blocks=blocks, tp=tp,
                         intra_node_bw=hw.link_bw, block_size=block, **overrides)


def hardware_name(name: str) -> str:
    """The ``laser.latency.HARDWARE`` key of a hardware name or alias (``a100``, ``h100``), lower case."""
    aliases = {"a100": "a100-80gb", "h100": "h100-sxm"}
    return aliases.get(name.lower(), name.lower())


@dataclass
class ClusterResult:
    """Final request copies (the decode instance's after a hand-off), in input order, and run stats."""

    requests: list[Request]
    wall_s: float
    events: int
    decisions: int
    decision_wall_s: float
    transfers: int
    transfer_s: float
    reassigned: int = 0
    migrations: int = 0  # decode->decode moves (counted apart from ``transfers``; their time is in ``transfer_s``)


class ClusterSim:
    """The controller and the instances of ``spec`` (in the controller's shape) on one clock.

    Args:
        controller: a controller instance (or a registered name). spec: instance counts.
        config: hardware and instance knobs. check: check conservation and every
        instance's integrity at the end (raises AssertionError).
    """

    def __init__(self, controller: Controller | str, spec: ClusterSpec, config: ClusterConfig, check: bool = True):
        self.controller = get_controller(controller)() if isinstance(controller, str) else controller
        self.spec = spec.layout_for(self.controller.disaggregated)
        self.config = config
        self.check = check
        refuse_scattered(config.latency_model, "the cluster simulator's latency model")
        self.lm = config.latency_model
        self.num_layers = self.lm.num_layers
        self.instances = self._build()
        self.controller.attach(self.instances)

    def _build(self) -> list[SimClusterInstance]:
        c, s = self.config, self.spec
        roles: list[str] = []
        if s.num_mixed:
            roles = ["mixed"] * s.num_mixed
        else:  # alternate P and D while both last, so pairs share nodes
            p, d = s.num_prefill, s.num_decode
            while p or d:
                if p:
                    roles.append("prefill")
                    p -= 1
                if d:
                    roles.append("decode")
                    d -= 1
        out = []
        for i, role in enumerate(roles):
            pol = self.controller.policy_for(role)
            cfg = c.scheduler
            if role == "mixed" and pol == "sarathi" and c.mixed_token_budget:
                cfg = dataclasses.replace(cfg, max_num_batched_tokens=c.mixed_token_budget)
            icache = c.decode_icache_tokens if role == "decode" else c.prefill_icache_tokens
            out.append(SimClusterInstance(i, role, pol, self.lm, c.num_blocks, c.block_size, icache,
                                          node=(i * c.tp) // c.gpus_per_node, config=cfg,
                                          enable_prefix_caching=c.enable_prefix_caching))
        return out

    # -- KV transfer ------------------------------------------------------------------------------
    def transfer_time(self, tokens: int, src: SimClusterInstance, dst: SimClusterInstance) -> float:
        """Seconds to move ``tokens`` tokens of KV (every layer) from ``src`` to ``dst``."""
        bw = self.config.intra_node_bw if src.node == dst.node else self.config.inter_node_bw
        return tokens * self.config.kv_bytes_per_token_layer * self.num_layers / bw

    # -- run ------------------------------------------------------------------------------------
    def run(self, requests: list[Request], until: float = math.inf) -> ClusterResult:
        """Serve ``requests`` (``arrival_time`` in virtual seconds). Returns every request's
        final copy in input order. A prompt that no instance's KV pool can hold is rejected at
        arrival, as a real engine rejects a prompt over its context (``finish_reason="abort"``,
        no token: an SLO miss), and the others are served."""
        t_wall = time.perf_counter()
        run = _ClusterRun(self)
        q = EventQueue()
        for r in requests:
            q.push(r.arrival_time, "arrive", r)
        q.run({"arrive": run.arrive, "wake": run.wake, "end": run.end}, until=until)
        stats, ctl = run.stats, self.controller
        result = ClusterResult([run.final.get(r.req_id, r) for r in requests], time.perf_counter() - t_wall,
                               q.processed, ctl.decisions, stats["decision_s"], stats["transfers"],
                               stats["transfer_s"], getattr(ctl, "num_reassigned", 0), stats["migrations"])
        if self.check and until == math.inf:
            self.check_conservation(requests, run.done)
        return result

    def check_conservation(self, requests: list[Request], done: dict[str, int]) -> None:
        """Every request finished exactly once; every instance is empty and consistent."""
        twice = [k for k, v in done.items() if v != 1]
        missing = [r.req_id for r in requests if r.req_id not in done]
        if twice or missing:
            raise AssertionError(f"conservation broken: finished twice {twice[:5]}, never {missing[:5]}")
        for i in self.instances:
            i.check_integrity(expect_empty=True)

    def isolated_prefill(self, prompt_len: int) -> float:
        """Seconds of a prefill of ``prompt_len`` tokens alone on an idle instance."""
        return self.lm.predict_prefill(prompt_len)


class _ClusterRun:
    """The event handlers of one :meth:`ClusterSim.run` and the state they share: each handler
    takes ``(t, payload)`` and yields the ``(time, kind, payload)`` events it causes."""

    def __init__(self, sim: "ClusterSim"):
        self.sim = sim
        self.ctl, self.inst, self.delay = sim.controller, sim.instances, sim.config.msg_delay_s
        self.info_of: dict[str, RequestInfo] = {}
        self.decode_of: dict[str, int | None] = {}
        self.final: dict[str, Request] = {}
        self.done: dict[str, int] = {}
        self.stats = {"decision_s": 0.0, "transfers": 0, "transfer_s": 0.0, "migrations": 0}
        self.capacity = min(i.sim.bm.num_blocks * i.sim.bm.block_size for i in self.inst)

    def start(self, i: SimClusterInstance, t: float):
        if i.plan is not None:
            return
        end = i.begin(t)
        if end is not None:
            yield end, "end", i

    def arrive(self, t: float, req: Request):
        ctl, inst, delay, cfg = self.ctl, self.inst, self.delay, self.sim.config
        if req.num_prompt_tokens >= self.capacity:
            req.finish_reason = "abort"
            self.final[req.req_id] = req
            self.done[req.req_id] = 1
            return
        hashes = ()
        if cfg.enable_prefix_caching and cfg.cache_aware_routing:  # the front end's hashes
            bm = inst[0].sim.bm
            hashes = tuple(bm.block_hashes(req.block_hashes, req.prompt_token_ids))
        info = RequestInfo(req.req_id, req.arrival_time, req.num_prompt_tokens, req.slo.ttft, req.slo.tbt,
                           req.slo.name, ctl.expected_output(req.slo.name), hashes)
        t0 = time.perf_counter()
        route = ctl.route(info, t)
        self.stats["decision_s"] += time.perf_counter() - t0
        self.info_of[req.req_id] = info
        self.decode_of[req.req_id] = route.decode
        req.demoted = route.demoted
        self.final[req.req_id] = req
        inst[route.prefill].add_request(req, t + delay)
        yield t + delay, "wake", inst[route.prefill]

    def wake(self, t: float, i: SimClusterInstance):
        yield from self.start(i, t)

    def end(self, t: float, i: SimClusterInstance):
        outs = i.complete()
        moves = self.migrate(i)
        while True:
            nxt = i.begin(i.clock)
            if nxt is None or nxt > t:
                break
            outs += i.complete()
            moves += self.migrate(i)
        if nxt is not None:
            yield nxt, "end", i
        for o in outs:
            yield from self.output(i, o)
        yield from moves

    def migrate(self, src: SimClusterInstance) -> list:
        """Between two steps of a decode instance: the controller's D9 move, if any."""
        if src.role != "decode":
            return []
        t0 = time.perf_counter()
        m = self.ctl.plan_migration(src, src.clock)
        self.stats["decision_s"] += time.perf_counter() - t0
        if m is None:
            return []
        cand, d = m
        h = src.migrate_out(cand.info.req_id)
        dst = self.inst[d]
        whole = self.sim.transfer_time(h.request.num_computed_tokens, src, dst)
        ready = src.clock + self.delay + whole
        self.stats["migrations"] += 1
        self.stats["transfer_s"] += whole
        dst.add_request(h, ready)
        return [(ready, "wake", dst)]

    def output(self, src: SimClusterInstance, o):
        rid = o.req.req_id
        ctl, stats = self.ctl, self.stats
        if o.kind == "finished":
            self.done[rid] = self.done.get(rid, 0) + 1
            self.final[rid] = o.req
            chosen = self.decode_of.get(rid)
            if chosen is not None and src.role == "prefill":
                self.inst[chosen].release(rid)
            ctl.on_finish(o.req.slo.name, o.req.num_output_tokens, o.time, o.req.slo.tbt_or_inf)
            return
        info = self.info_of[rid]
        chosen = self.decode_of.get(rid)
        t0 = time.perf_counter()
        d = ctl.at_handoff(info, chosen, o.time)
        stats["decision_s"] += time.perf_counter() - t0
        dst = self.inst[d]
        whole = self.sim.transfer_time(o.req.num_computed_tokens, src, dst)
        if d == chosen:  # streamed layer by layer during prefill
            ready = max(o.time + whole / self.sim.num_layers, o.prefill_start + whole)
        else:  # pulled (or re-sent) after prefill, after the controller's message
            ready = o.time + self.delay + whole
        stats["transfers"] += 1
        stats["transfer_s"] += whole
        dst.add_request(o.handoff, ready)
        yield ready, "wake", dst
