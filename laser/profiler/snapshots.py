"""Plans of real schedulers, frozen for replay: the iterations the accuracy report times.

:func:`policy_snapshots` drives a policy's scheduler on a synthetic request stream
(:func:`synthetic_stream`) symbolically and keeps some of its plans with everything
``ModelRunner.execute`` reads for them (:class:`PlanSnapshot`); :class:`PlanReplay` runs
one on the real runner.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..core.config import SchedulerConfig
from ..core.intermediate_cache import IntermediateCache
from ..latency import LatencyModel
from ..model.runner import ModelRunner
from ..core.plan import StepPlan, Work
from ..core.request import SLO, Request, SamplingParams
from ..model.sampler import Sampler
from .calls import _REQ_PREFIX


class _Tables:
    """The block tables of some requests, frozen: the part of the block manager that
    ``ModelRunner._build_metadata`` reads (``block_size``, ``canonical_table``, ``table``,
    ``overridden_layers``)."""

    def __init__(self, bm, req_ids):
        self.block_size = bm.block_size
        self.num_blocks = bm.num_blocks
        self._canon = {r: list(bm.canonical_table(r)) for r in req_ids}
        self._over = {r: tuple(bm.overridden_layers(r)) for r in req_ids}
        self._tables = {(r, layer): list(bm.table(r, layer)) for r in req_ids for layer in self._over[r]}

    def canonical_table(self, req_id):
        return self._canon[req_id]

    def overridden_layers(self, req_id):
        return self._over[req_id]

    def table(self, req_id, layer):
        t = self._tables.get((req_id, layer))
        if t is not None:
            return t
        return self._canon[req_id]


@dataclass
class PlanSnapshot:
    """Everything ``ModelRunner.execute`` reads for one plan, frozen at planning time."""

    policy: str
    index: int
    plan: StepPlan
    bm: _Tables  # the block tables of the plan's requests at that step
    requests: dict  # req_id -> Request with the tokens the plan reads
    resumed: list  # (req_id, num_tokens) of works resuming from the intermediate cache


def synthetic_stream(num_requests: int, lm: LatencyModel, *, seed: int = 0, max_prompt: int = 384,
                     max_output: int = 48) -> list[tuple[float, Request]]:
    """``(arrival time, request)`` pairs: a burst, then Poisson arrivals (virtual seconds).

    Prompt lengths mix short and medium prompts; SLO classes are the paper's three classes
    scaled to this machine (targets relative to predicted decode and prefill times) plus
    best effort, so the Laser policy has TBT targets to plan layer slices against.
    """
    rng = np.random.default_rng(seed)
    t_dec = lm.predict_decode_iteration([256] * 8)
    t_pf = lm.predict_prefill(256)
    classes = [SLO(ttft=3 * t_pf, tbt=1.5 * t_dec, name="code"), SLO(ttft=6 * t_pf, tbt=3 * t_dec, name="chat"),
               SLO(ttft=20 * t_pf, tbt=6 * t_dec, name="summarization"), SLO(name="best_effort")]
    out, now = [], 0.0
    mean_gap = 2.5 * t_dec
    for k in range(num_requests):
        if k >= num_requests // 3:
            now += float(rng.exponential(mean_gap))
        short = rng.random() < 0.6
        plen = int(rng.integers(8, 96)) if short else int(rng.integers(96, max_prompt + 1))
        sp = SamplingParams(max_tokens=int(rng.integers(4, max_output + 1)), temperature=0.0, ignore_eos=True)
        ids = [int(x) for x in rng.integers(10, 1000, plen)]
        out.append((now, Request(ids, sp, slo=classes[int(rng.integers(0, len(classes)))], arrival_time=now,
                                 req_id=f"{_REQ_PREFIX}-eval-{seed}-{k}")))
    return out


def policy_snapshots(runner: ModelRunner, policy: str, lm: LatencyModel, *, num_requests: int = 24,
                     max_steps: int = 200, keep: int = 10, seed: int = 0,
                     max_num_batched_tokens: int = 256) -> list[PlanSnapshot]:
    """Drive ``policy``'s scheduler on a synthetic stream and keep ``keep`` of its plans.

    Torch-free: the plans are executed symbolically (the intermediate cache holds
    placeholders, tokens are random), which is all a scheduler observes; the virtual
    clock advances by the latency model's prediction. The engine's block manager is used
    (it must be idle) and is empty again afterwards. Plans are kept spread over the run
    and over kinds (prefill, decode, mixed, layer-sliced).
    """
    from ..scheduler import get_policy

    bm = runner.bm
    n = runner.num_layers
    cfg = SchedulerConfig(policy=policy, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64)
    icache = IntermediateCache(1 << 30)
    clock = [0.0]
    sched = get_policy(policy)(cfg, n, bm, icache, lm, clock=lambda: clock[0])
    stream = synthetic_stream(num_requests, lm, seed=seed)
    rng = random.Random(seed)
    snaps: list[PlanSnapshot] = []
    pending = list(stream)
    try:
        for step in range(max_steps):
            while pending and pending[0][0] <= clock[0]:
                sched.add_request(pending.pop(0)[1])
            if not sched.has_unfinished() and not pending:
                break
            plan = sched.schedule(clock[0])
            if not plan:
                if pending:
                    clock[0] = max(clock[0], pending[0][0])
                    continue
                break
            reqs = {w.req_id: Request(list(sched.requests[w.req_id].all_token_ids), sched.requests[w.req_id].sampling_params,
                                      req_id=w.req_id) for w in plan.works}
            snaps.append(PlanSnapshot(policy, step, plan, _Tables(bm, list(reqs)), reqs,
                                   [(w.req_id, w.num_tokens) for w in plan.works if w.layer_start > 0]))
            # symbolic execution: what the runner does to the intermediate cache, and tokens
            for w in plan.works:
                if w.layer_start > 0:
                    icache.pop(w.req_id)
            for w in plan.works:
                if w.layer_end < n:
                    icache.put(w.req_id, None, w.num_tokens)
            sampled = {w.req_id: rng.randrange(10, 1000) for w in plan.works if w.sample and w.layer_end == n}
            clock[0] += lm.predict_iteration(plan)
            for req in sched.update(plan, plan.last_layer, sampled, clock[0]):
                if req.num_output_tokens >= req.sampling_params.max_tokens:
                    sched.finish(req, "length", clock[0])
    finally:
        for rid in list(sched.requests):
            sched.abort(rid, clock[0])
    bm.check_integrity(expect_empty=True)
    bm.reset_prefix_cache()  # the synthetic prompts' blocks: nobody's prefix
    return _spread(snaps, keep, rng)


def small_decode_snapshots(runner: ModelRunner, count: int, *, seed: int = 0, max_batch: int = 32,
                           min_context: int = 16, max_context: int = 512) -> list[PlanSnapshot]:
    """``count`` random decode iterations of small batches at short contexts: the common
    iteration of an interactive load (issue 11 item 5: these were predicted up to 1.9x
    their time). Batch 1..``max_batch`` (log-uniform), contexts ``min_context``..
    ``max_context`` tokens (log-uniform), every layer, a token sampled per request; the
    blocks are allocated in the runner's (idle) block manager, frozen, and freed again.
    Policy ``"small-decode"``."""
    from .grid import fit_to_pool

    bm, n = runner.bm, runner.num_layers
    rng = np.random.default_rng(seed)
    pool = bm.num_blocks * bm.block_size
    sp = SamplingParams(temperature=0.0)
    out: list[PlanSnapshot] = []
    for k in range(count):
        b = int(round(np.exp(rng.uniform(0.0, np.log(max_batch)))))
        ctx = np.exp(rng.uniform(np.log(min_context), np.log(max_context), b)).round().astype(int)
        _, ctx = fit_to_pool((1,) * b, tuple(int(max(2, c)) for c in ctx), pool, bm.block_size)
        reqs = {f"{_REQ_PREFIX}-smalldec-{seed}-{k}-{i}": Request([int(x) for x in rng.integers(10, 1000, c)], sp,
                                                                  req_id=f"{_REQ_PREFIX}-smalldec-{seed}-{k}-{i}")
                for i, c in enumerate(ctx)}
        works = [Work(rid, c - 1, 1, 0, n, sample=True) for rid, c in zip(reqs, ctx)]
        try:
            for rid, c in zip(reqs, ctx):
                bm.allocate(rid, c)
            tables = _Tables(bm, list(reqs))
        finally:
            for rid in reqs:
                bm.free(rid)
        out.append(PlanSnapshot("small-decode", k, StepPlan(n, works), tables, reqs, []))
    bm.check_integrity(expect_empty=True)
    return out


def step_snapshots(runner: ModelRunner, shapes, *, seed: int = 0, policy: str = "step") -> list[PlanSnapshot]:
    """Plans of given shapes, frozen for replay: each shape is a list of works ``(num_tokens,
    context_len, layer_start, layer_end)`` (``layer_end == N``: sampled; ``layer_start > 0``:
    resumed from the intermediate cache). Blocks are allocated in the runner's idle block
    manager for the replay's tables and freed again. Raises ``ValueError`` for a work outside
    ``1 <= num_tokens <= context_len`` or ``0 <= layer_start < layer_end <= N``."""
    bm, n = runner.bm, runner.num_layers
    rng = np.random.default_rng(seed)
    sp = SamplingParams(temperature=0.0)
    out: list[PlanSnapshot] = []
    for k, shape in enumerate(shapes):
        reqs, works = {}, []
        for i, (q, c, a, b) in enumerate(shape):
            if not (1 <= q <= c and 0 <= a < b <= n):
                raise ValueError(f"bad work (num_tokens {q}, context {c}, layers [{a}, {b})) for {n} layers")
            rid = f"{_REQ_PREFIX}-{policy}-{seed}-{k}-{i}"
            reqs[rid] = Request([int(x) for x in rng.integers(10, 1000, c)], sp, req_id=rid)
            works.append(Work(rid, c - q, q, a, b, sample=b == n))
        try:
            for w in works:
                bm.allocate(w.req_id, w.context_len)
            tables = _Tables(bm, list(reqs))
        finally:
            for rid in reqs:
                bm.free(rid)
        out.append(PlanSnapshot(policy, k, StepPlan(n, works), tables, reqs,
                                [(w.req_id, w.num_tokens) for w in works if w.layer_start > 0]))
    bm.check_integrity(expect_empty=True)
    return out


def plan_kind(plan: StepPlan, n: int) -> str:
    if any(w.layer_start > 0 or w.layer_end < n for w in plan.works):
        return "layer-sliced"
    dec = any(w.num_tokens == 1 for w in plan.works)
    pf = any(w.num_tokens > 1 for w in plan.works)
    return "mixed" if dec and pf else ("decode" if dec else "prefill")


def _spread(snaps: list[PlanSnapshot], keep: int, rng: random.Random) -> list[PlanSnapshot]:
    """Up to ``keep`` snapshots, round-robin over plan kinds, spread over time within a kind."""
    if len(snaps) <= keep:
        return snaps
    by_kind: dict[str, list[PlanSnapshot]] = {}
    for s in snaps:
        by_kind.setdefault(plan_kind(s.plan, s.plan.num_layers), []).append(s)
    for v in by_kind.values():
        rng.shuffle(v)
    out: list[PlanSnapshot] = []
    while len(out) < keep:
        for v in by_kind.values():
            if v and len(out) < keep:
                out.append(v.pop())
    return sorted(out, key=lambda s: s.index)


class StepOverheadReplay:
    """A :class:`PlanReplay` that keeps, per call, what the step cost beyond the compute the runner
    times itself (wall time minus ``StepResult.compute_seconds``: batch compositions, joins, parks,
    the walk): :attr:`overheads` (seconds), whose median is a ``StepOverheadSample``. When the plan is a
    decode step at full depth (:attr:`decode_contexts`), the case's time less that overhead is a
    ``DecodeStepSample``: its compute (layer calls, embedding, LM head); when it is a step at full depth
    holding a prefill chunk (:attr:`prefill_batch`), a ``PrefillStepSample``."""

    def __init__(self, runner: ModelRunner, snap: PlanSnapshot, gen: torch.Generator):
        self.replay = PlanReplay(runner, snap, gen)
        self.overheads: list[float] = []
        ws, n = snap.plan.works, snap.plan.num_layers
        full = bool(ws) and all(w.layer_start == 0 and w.layer_end == n for w in ws)
        decode = all(w.num_tokens == 1 for w in ws)
        #: context lengths of the plan's works when it is a decode step at full depth, else None
        self.decode_contexts = tuple(w.context_len for w in ws) if full and decode else None
        #: (query lens, context lens) of the plan's works when it is a step at full depth holding a prefill
        #: chunk, else None
        self.prefill_batch = ((tuple(w.num_tokens for w in ws), tuple(w.context_len for w in ws))
                              if full and not decode else None)

    def __call__(self):
        t0 = time.perf_counter()
        res = self.replay()
        self.overheads.append(max(0.0, time.perf_counter() - t0 - res.compute_seconds))
        return res


class WarmDecodeReplay:
    """A decode step at full depth (a snapshot's plan) run back to back per call, as an engine in steady
    decode runs its steps: once, then up to ``streak`` more times while the call has taken under ``budget_s``
    seconds (at least 4 more). :attr:`warm` keeps, per call, the compute (``StepResult.compute_seconds``,
    seconds) of the runs after the first; the median of the ``k``-th over the calls is a
    ``WarmDecodeStepSample`` of :attr:`decode_contexts` at streak ``k``."""

    def __init__(self, runner: ModelRunner, snap: PlanSnapshot, gen: torch.Generator, streak: int = 24,
                 budget_s: float = 0.25):
        self.replay = PlanReplay(runner, snap, gen)
        self.decode_contexts = tuple(w.context_len for w in snap.plan.works)
        self.streak, self.budget_s = streak, budget_s
        self.warm: list[list[float]] = []

    def __call__(self):
        t0 = time.perf_counter()
        res = self.replay()
        times: list[float] = []
        while len(times) < self.streak and (len(times) < 4 or time.perf_counter() - t0 < self.budget_s):
            res = self.replay()
            times.append(res.compute_seconds)
        self.warm.append(times)
        return res


class PlanReplay:
    """Runs ``ModelRunner.execute`` on a snapshot: the runner reads the snapshot's block
    tables, requests and intermediate-cache entries (random hidden states of the right
    shape); its KV writes land in slots of the (idle) pool."""

    def __init__(self, runner: ModelRunner, snap: PlanSnapshot, gen: torch.Generator):
        self.runner, self.snap = runner, snap
        h = runner.model.config.hidden_size
        self.hidden = {rid: torch.randn(k, h, generator=gen).to(runner.model.dtype) for rid, k in snap.resumed}
        self.sampler = Sampler(0)

    def __call__(self):
        r = self.runner
        icache = IntermediateCache(1 << 30)
        for rid, k in self.snap.resumed:
            icache.put(rid, self.hidden[rid], k)
        saved = r.bm, r.icache, r.sampler
        r.bm, r.icache, r.sampler = self.snap.bm, icache, self.sampler
        try:
            return r.execute(self.snap.plan, self.snap.requests)
        finally:
            r.bm, r.icache, r.sampler = saved
