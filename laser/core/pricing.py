"""Pricing a plan with a latency model, segment by segment. Torch-free."""

from __future__ import annotations

from .plan import Work
from .speculation import spec_decode_time


def has_step_overhead(lm) -> bool:
    """Whether ``lm`` prices a step's own overhead (``LatencyModel.step_overhead_time`` is not 0
    everywhere): plans priced by a model without it skip counting compositions."""
    return bool(getattr(lm, "step_overhead_s", 0.0) or getattr(lm, "compose_overhead_s", 0.0)
                or getattr(lm, "compose_work_s", 0.0))


def plan_compositions(works, num_layers: int) -> tuple[int, int]:
    """``(compositions, composed works)`` of a plan's works: the segments of layers with a constant,
    non-empty batch (the walker composes each once: ``laser.core.walk``) and the works summed over
    them -- what ``LatencyModel.step_overhead_time`` prices (:class:`PlanCost` counts the same)."""
    bounds = sorted({0, num_layers} | {w.layer_start for w in works} | {w.priced_end for w in works})
    k = n = 0
    for a in bounds[:-1]:
        m = sum(1 for w in works if w.layer_start <= a < w.priced_end)
        if m:
            k, n = k + 1, n + m
    return k, n


def full_depth_decode_total(lm, num_layers: int, works: list[Work]) -> float:
    """:class:`PlanCost`'s ``total`` of one decode token per work through every layer (each work
    ``num_tokens == 1``, layers ``[0, N)``, sampled, no exit plan, no draft), in its float
    operations and order, without building the segments: one segment of N layers (its
    ``0.0 + N * t`` is ``N * t``: prices are >= 0), embedding and LM head of every row, the step
    overhead of one composition when ``lm`` prices it, the grammar mask rows. The price of a
    steady decode step (:meth:`laser.scheduler.laser.scheduler.LaserScheduler._steady_decode_plan`);
    ``tests/sim/test_sim_steady.py`` checks it against the general path."""
    b = len(works)
    total = (num_layers * lm.step_layer_time((1,) * b, tuple([w.token_start + 1 for w in works]))
             + lm.embed_time(b) + lm.head_time(b))
    if has_step_overhead(lm):
        total += lm.step_overhead_time(1, b)
    masked = sum(1 for w in works if w.masked)
    if masked:
        total += lm.mask_time(masked)
    return total


#: A streak longer than any profile measures (``decode_warm_factor`` at it: the saving of a long streak).
LONG_STREAK = 1 << 30


def quiet_step(lm, plan) -> bool:
    """Whether ``plan`` (a :class:`~laser.core.plan.StepPlan`) keeps a streak of decode steps going
    (:func:`warm_streak`): its works are decode tokens only (at any depth, no draft), as many as ``lm`` (a
    latency model) prices warm somewhere in a streak (:meth:`~laser.latency.LatencyModel.decode_warm_factor`
    of a long streak below 1; the factors never rise along a streak)."""
    return (bool(plan.works) and plan.speculative is None
            and lm.decode_warm_factor(len(plan.works), LONG_STREAK) < 1.0
            and all(w.num_tokens == 1 and w.token_start > 0 for w in plan.works))


def warm_streak(lm, streak: int, plan) -> int:
    """``plan.warm`` for ``plan`` run after ``streak`` steps in a row that were :func:`quiet_step` s and ran
    to their end (the instance core counts them): ``streak`` when ``plan`` is a quiet step at full depth (one
    token per work through every layer, no exit plan), else 0 (priced as the profile timed it, after other
    work). ``LatencyModel.predict_iteration`` and the simulator's clock price the step at
    ``lm.decode_warm_factor(rows, streak)`` of its price.

    Case (issue 26, sim vs real on an AMX Xeon, 1 thread, SmolLM2 int4 / int8, 120-request workload): a
    batch-1 decode step ran 0.91-0.96x its profiled price right after a step with prefill and fell to
    0.76x over the next 7 decode steps; batch 4 0.94x to 0.90x; batches of 5+ rows (over dense bf16 copies
    of the weights, AMX matmuls as in prefill) ~0.95x throughout. The profiler times each case after other
    work. Priced alike, the online calibration read the difference as timing spread, and the jitter margin
    cut every step's prefill budget by it."""
    if streak <= 0 or not quiet_step(lm, plan):
        return 0
    n = plan.num_layers
    if all(w.layer_start == 0 and w.layer_end == n and not w.depth and not w.exit_from for w in plan.works):
        return streak
    return 0


class PlanCost:
    """Predicted time (seconds) of a plan, with O(segments) marginal costs: the one owner of
    pricing a plan (``LatencyModel.predict_iteration`` is ``PlanCost(...).total``).

    The plan's layers split into segments where the batch is constant; each segment costs
    (its layers) x ``lm.step_layer_time`` of its batch, plus the embedding of works starting at
    layer 0 and the LM head for works ending at the last layer (plus, for each of them that
    samples through a grammar, ``Work.masked``, one row of ``lm.mask_time``: a plan without
    such a work is priced by the same sum as before), plus the step's own overhead
    (``lm.step_overhead_time``: once per step, once per segment with a batch -- each is one batch
    composition of the runner -- and once per work of each such segment; 0.0 for a model that has
    not measured it; :func:`plan_compositions` counts the same). The Laser scheduler builds a plan
    work by work: :meth:`with_work` prices adding a work only over the segments it overlaps (a
    segment it cuts at its first or end layer splits in two compositions).

    Dynamic depth (:mod:`laser.core.depth`): a decode token that may exit early
    (``Work.exit_from``) runs in the segments up to its expected depth (``Work.priced_end``),
    pays the LM head only when that is the last layer, and adds its exit checks and K/V fill
    as the latency model's ``exit_cost`` (:class:`~laser.core.depth.ExitCost`) prices them
    (none when the model has no ``exit_cost``). Every other work is priced as before.

    Self-speculation: ``drafts`` (req id -> draft length ``g > 0``) names the decode works the
    executor runs speculatively, after the step's layer calls and apart from them; they are left
    out of the segments and priced by :func:`laser.core.speculation.spec_decode_time` with
    ``exit_layer`` (``spec_seconds``, part of ``total``).
    """

    def __init__(self, lm, num_layers: int, works: list[Work], drafts: dict[str, int] | None = None,
                 exit_layer: int = 0):
        self.lm = lm
        self.n = num_layers
        self.spec_seconds = 0.0
        if drafts:
            spec = [w for w in works if w.req_id in drafts and w.is_decode and w.layer_start == 0
                    and w.layer_end == num_layers]
            self.spec_seconds = spec_decode_time(lm, num_layers, exit_layer,
                                                 [(w.context_len, drafts[w.req_id]) for w in spec])
            gone = {id(w) for w in spec}
            works = [w for w in works if id(w) not in gone]
        self.works = list(works)
        # (query lens, context lens) -> lm.step_layer_time: a batch priced by with_work is not
        # priced again when the work is added (the latency model is deterministic)
        self._memo: dict[tuple, float] = {}
        self._rebuild()

    def _rebuild(self) -> None:
        lm, ws, memo = self.lm, self.works, self._memo
        bounds = sorted({0, self.n} | {w.layer_start for w in ws} | {w.priced_end for w in ws})
        self.segs = []  # (a, b, q, c, per-layer time)
        layers = 0.0
        self._step_terms = has_step_overhead(lm)
        for a, b in zip(bounds, bounds[1:]):
            act = [w for w in ws if w.layer_start <= a < w.priced_end]
            q = tuple([w.num_tokens for w in act])
            c = tuple([w.token_start + w.num_tokens for w in act])  # context_len
            t = memo.get((q, c))
            if t is None:
                t = memo[(q, c)] = lm.step_layer_time(q, c)
            self.segs.append((a, b, q, c, t))
            layers += (b - a) * t
        self.embed_tokens = sum(w.num_tokens for w in ws if w.layer_start == 0)
        self.final = sum(1 for w in ws if w.priced_end == self.n)
        self.masked = sum(1 for w in ws if w.masked and w.sample and w.priced_end == self.n)
        self.total = layers + lm.embed_time(self.embed_tokens) + lm.head_time(self.final)
        self.compositions = sum(1 for seg in self.segs if seg[2])
        self.composed = sum(len(seg[2]) for seg in self.segs)
        self.overhead = lm.step_overhead_time(self.compositions, self.composed) if self._step_terms else 0.0
        self.total += self.overhead
        if self.masked:
            self.total += lm.mask_time(self.masked)
        self.total += self.spec_seconds
        self._layers = layers
        self._exiting = [w for w in ws if w.exit_from]  # dynamic depth: their checks and fills
        self.exits = self._exit_price(self._exiting) if self._exiting else 0.0
        self.total += self.exits

    def _exit_price(self, works: list[Work]) -> float:
        cost = getattr(self.lm, "exit_cost", None)
        return cost.price(self.lm, self.n, works) if cost is not None else 0.0

    def with_work(self, w: Work) -> float:
        """Predicted time of the plan plus ``w`` (seconds)."""
        lm, memo = self.lm, self._memo
        t = self._layers
        lo, hi = w.layer_start, w.priced_end
        k, nw = self.compositions, self.composed  # the step overhead's counts, with w added below
        for a, b, q, c, per in self.segs:
            o = min(b, hi) - max(a, lo)
            if o > 0:
                key = (q + (w.num_tokens,), c + (w.context_len,))
                t2 = memo.get(key)
                if t2 is None:
                    t2 = memo[key] = lm.step_layer_time(*key)
                t += o * (t2 - per)
                if q:  # w joins this batch; a cut at lo or hi splits off a piece without it
                    nw += 1 + len(q) * ((a < lo) + (hi < b))
                    k += (a < lo) + (hi < b)
                else:  # a gap: w alone makes it a batch
                    k, nw = k + 1, nw + 1
        if self._step_terms:
            t += lm.step_overhead_time(k, nw)
        e = self.embed_tokens + (w.num_tokens if lo == 0 else 0)
        f = self.final + (1 if hi == self.n else 0)
        t = t + lm.embed_time(e) + lm.head_time(f)
        m = self.masked + (1 if w.masked and w.sample and hi == self.n else 0)
        t = t + lm.mask_time(m) if m else t
        t = t + self.spec_seconds
        if w.exit_from:
            return t + self._exit_price(self._exiting + [w])
        return t + self.exits if self._exiting else t

    def add(self, w: Work) -> None:
        self.works.append(w)
        self._rebuild()
