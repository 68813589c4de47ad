"""Layer-level decode plans (PPoPP'26 §6.2): the (L, O) plan of a request, the per-layer load
model Alg. 1 prices plans with, Alg. 1 itself and which requests a plan runs in an iteration, as
pure functions. The Laser scheduler (:mod:`laser.scheduler.laser.scheduler`), Alg. 2's
``LatencyIncrement`` (:mod:`laser.scheduler.laser.increment`) and the controller's instances
(:mod:`laser.instance.state`) share them; neither copies the other. Torch-free.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ...latency import LatencyModel
from ...core.depth import exit_plan, expected_layers
from ...core.plan import Work
from ...core.speculation import SpecShape, spec_decode_time
from ...core.request import SLO
from ..util import ceil_div
from .budget import best_effort_limit, yields_to_slo
from .memo import DecodeMemo, layer_price, memo_for


@dataclass(slots=True)
class DecodePlan:
    """Alg. 1 plan of one decode request: L layers per iteration, offset O."""

    layers: int  # L
    offset: int  # O

    def groups(self, n: int) -> int:
        return ceil_div(n, self.layers)

    def iterations_left(self, next_layer: int, n: int, iteration: int) -> int:
        """Iterations until the token of a request at ``next_layer`` (of ``n``) comes, this one
        included, at scheduler ``iteration``: 1 at full depth; else those until its next group's
        turn in Alg. 1's cycle (none when it is mid-token), then its remaining groups."""
        if self.layers >= n:
            return 1
        k, g = self.groups(n), next_layer // self.layers + 1
        return (0 if next_layer % self.layers else (g + self.offset - iteration) % k) + k - g + 1


class _LayerLoad:
    """Decode requests per layer over the next ``HORIZON`` iterations, for Alg. 1.

    Layer j of iteration (now + h) runs ``full + partial[h][j]`` decode requests: ``full``
    counts full-depth requests, ``partial`` the reduced ones (L < N). A layer's time is
    priced by the latency model for that many decode tokens at the batch's mean context
    (memoised), so trying an offset costs O(HORIZON·L), not a re-simulation. Exact for K in
    {1, 2, 3, 4, 6, 12}; an approximation of the worst iteration otherwise.

    ``background``: prefill tokens that ride every layer call of the iteration beside the
    decode tokens (a mixed instance whose pending prefills need that many per iteration):
    the iteration is then priced as the merged layer calls, so a decode token costs what it
    adds to them -- on a GPU, nearly nothing while the call is bound by its weight read, and
    a prefill token's compute once the prefill makes it compute-bound (priced alone, a
    decode batch is weight-bound there, and cutting its layers looks like it saves nothing).

    Dynamic depth (:mod:`laser.core.depth`): a full-depth request expected to run ``d < N``
    layers per token (:func:`~laser.core.depth.expected_layers`: its running mean depth) occupies
    layers ``[0, d)`` of every iteration, not all N (``depths``: req id -> d for those); a token
    that needs more runs them anyway, and the running mean follows. Reduced plans keep their N-layer
    groups (an early exit restarts the cycle: ``LaserScheduler._restart_exited``). The exit checks,
    the K/V fill and the LM head of those tokens are in :attr:`const` as a plan prices them
    (:meth:`_price_exits`).

    Self-speculation (``spec``, :mod:`laser.core.speculation`): a request that speculates
    (``spec_ids``: :meth:`SpecShape.draft_len` > 0) at full depth runs its token's draft passes
    and verify chunk after the iteration's layer calls: the ``num_spec`` of them are priced
    together by :func:`~laser.core.speculation.spec_decode_time` (at the batch's mean context and
    ``g`` drafts each) on top of the layer rows, not in them. Relaxed (L < N) it decodes its groups
    plainly and counts in ``partial`` like any other; :meth:`add` / :meth:`remove` take its id.
    """

    HORIZON = 12

    def __init__(self, lm: LatencyModel, num_layers: int, iteration: int, reqs: list, plans: dict[str, DecodePlan],
                 shared: DecodeMemo | None = None, background: int = 0, spec: SpecShape | None = None):
        self.n = num_layers
        self.it0 = iteration
        ctx = round(sum(r.num_tokens for r in reqs) / max(1, len(reqs)))
        shared = memo_for(lm, shared)
        # The mean context prices the batch as the model would its real contexts only if the
        # model is linear in them; a fitted model need not be (one long summarization stream
        # among short ones cost 272 ms where the mean priced 144 ms, and T_g broke unseen):
        # every price is scaled by the whole batch's real / mean-context price.
        fix = 1.0
        if len(reqs) > 1 and any(r.num_tokens != ctx for r in reqs):
            mean_t = lm.step_layer_time((1,) * len(reqs), (ctx,) * len(reqs))
            if mean_t > 0:
                fix = lm.step_layer_time((1,) * len(reqs), tuple(r.num_tokens for r in reqs)) / mean_t
        if shared is not None:
            def layer(c: int, _t=shared.layer_time) -> float:
                return _t(c, ctx, background) * fix
        else:
            memo: dict[int, float] = {}

            def layer(c: int) -> float:
                t = memo.get(c)
                if t is None:
                    t = memo[c] = layer_price(lm, c, ctx, background) * fix
                return t

        self.ctx = ctx
        self.shared = shared
        self.layer = layer
        self.spec = spec
        self.spec_ids = {r.req_id for r in reqs if spec.draft_len(r) > 0} if spec is not None else set()
        self.num_spec = 0  # speculating requests at full depth
        self._spec_memo: dict[int, float] = {}
        self._lm, self._fix = lm, fix
        plain = len(reqs) - sum(1 for r in reqs if plans[r.req_id].layers >= num_layers and r.req_id in self.spec_ids)
        self.const = lm.embed_time(plain) + lm.head_time(plain)
        masked = sum(1 for r in reqs if r.masked)
        if masked:  # grammar masks of their sampled rows (PlanCost's term)
            self.const += lm.mask_time(masked)
        self.full = 0
        self.num_partial = 0  # requests with L < N or an expected depth < N (0: every row of ``partial`` is zero)
        self._partial: list[list[int]] | None = None  # built when first needed (``partial``)
        self.times: list[float] | None = None  # per iteration; None = recompute
        self._row_memo: dict[tuple, float] = {}  # (full, row) -> that iteration's layer time
        n = self.n
        self.depths: dict[str, int] = {}
        for r in reqs:
            p = plans[r.req_id]
            if p.layers >= n and r.req_id in self.spec_ids:
                self.num_spec += 1
                continue
            d = expected_layers(r, n)
            if d < n:
                self.depths[r.req_id] = d
                self.add(p, depth=d)
            elif p.layers >= n:
                self.full += 1  # (what ``add`` does for a full-depth plan, in line)
            else:
                self.add(p)
        if self.depths or getattr(lm, "exit_cost", None) is not None:
            self._price_exits(lm, reqs, plans)

    def _price_exits(self, lm: LatencyModel, reqs: list, plans: dict[str, DecodePlan]) -> None:
        """Dynamic depth in :attr:`const`, as a plan is priced (:class:`~laser.core.pricing.PlanCost`,
        :func:`~laser.core.depth.exit_plan`): a full-depth request whose token may exit pays its
        exit checks (and K/V fill), and its LM head row only when it is expected to run every layer
        (a request that speculates is priced by its draft and verify passes instead)."""
        n = self.n
        ex = []
        for r in reqs:
            if r.req_id in self.spec_ids and plans[r.req_id].layers >= n:
                continue
            d, f = exit_plan(r, r.num_tokens - 1, 1, n)
            if f and plans[r.req_id].layers >= n:
                ex.append(Work(r.req_id, r.num_tokens - 1, 1, 0, n, True, depth=d, exit_from=f))
        if not ex:
            return
        leaving = sum(1 for w in ex if w.priced_end < n)
        if leaving:
            rows = len(reqs) - self.num_spec  # the LM head rows in ``const``
            self.const += lm.head_time(rows - leaving) - lm.head_time(rows)
        cost = getattr(lm, "exit_cost", None)
        if cost is not None:
            self.const += cost.price(lm, n, ex)

    @property
    def partial(self) -> list[list[int]]:
        """Reduced requests per layer (``[HORIZON][N]`` counts), all zero until one is added."""
        rows = self._partial
        if rows is None:
            rows = self._partial = [[0] * self.n for _ in range(self.HORIZON)]
        return rows

    def _span(self, p: DecodePlan, h: int, depth: int | None = None) -> tuple[int, int]:
        if p.layers >= self.n:
            return 0, depth  # a full-depth plan expected to run ``depth`` layers per token
        k = p.groups(self.n)
        g = (self.it0 + h - p.offset - 1) % k + 1  # the group that runs in this iteration
        return (g - 1) * p.layers, min(self.n, g * p.layers)

    def _times(self) -> list[float]:
        if self.times is None:
            f, lt, memo = self.full, self.layer, self._row_memo
            if not self.num_partial:
                # every row is zero: one row's time, the same ``sum`` of N equal layer times
                # as the general case (one latency-model lookup instead of N; kept: the general
                # loop cost the 16P16D simulation ~5 % CPU, docs/benchmarks.md)
                t = sum(itertools.repeat(lt(f), self.n))
                self.times = [t] * self.HORIZON
                return self.times
            times = []
            for row in self.partial:  # rows repeat (every request full depth: all zero)
                key = (f, tuple(row))
                t = memo.get(key)
                if t is None:
                    t = memo[key] = sum(lt(f + c) for c in row)
                times.append(t)
            self.times = times
        return self.times

    def _delta(self, p: DecodePlan, h: int, d: int, depth: int | None = None) -> float:
        a, b = self._span(p, h, depth)
        row, lt, f = self.partial[h], self.layer, self.full
        return sum(lt(f + row[j] + d) - lt(f + row[j]) for j in range(a, b))

    def add(self, p: DecodePlan, d: int = 1, depth: int | None = None, rid: str | None = None) -> None:
        """Count ``d`` requests of plan ``p`` (``depth``: layers per token a full-depth plan is
        expected to run, None = all N; ``rid``: the request's id, which says whether it speculates
        at full depth)."""
        if p.layers >= self.n and rid in self.spec_ids:
            self.num_spec += d
            return
        if p.layers >= self.n and (depth is None or depth >= self.n):
            self.full += d
            self.times = None
            return
        self.num_partial += d
        times = self.times
        for h in range(self.HORIZON):
            if times is not None:
                times[h] += self._delta(p, h, d, depth)
            a, b = self._span(p, h, depth)
            row = self.partial[h]
            for j in range(a, b):
                row[j] += d

    def remove(self, p: DecodePlan, depth: int | None = None, rid: str | None = None) -> None:
        self.add(p, -1, depth, rid)

    def slots(self) -> int:
        """Layer slots the counted requests occupy over the ``HORIZON`` iterations (request-layers)."""
        return (self.full + self.num_spec) * self.n * self.HORIZON + (sum(map(sum, self._partial)) if self._partial else 0)

    def spec_time(self) -> float:
        """Seconds of the speculating requests' draft passes and verify chunk in an iteration."""
        b = self.num_spec
        if not b:
            return 0.0
        t = self._spec_memo.get(b)
        if t is None:
            sp = self.spec
            t = self._spec_memo[b] = spec_decode_time(self._lm, self.n, sp.exit_layer,
                                                      [(self.ctx, sp.draft_tokens)] * b) * self._fix
        return t

    def predict(self) -> float:
        t = max(self._times()) + self.const
        return t + self.spec_time() if self.num_spec else t

    def best_offset(self, L: int) -> DecodePlan:
        """Offset of a new plan with L layers: the one whose first group runs in the coming
        iteration (``it0``). A request is relaxed right after its token (full-depth requests
        get one every iteration), so its gap in progress then takes exactly K = ceil(N/L)
        iterations; any other offset makes it wait up to K - 1 more, and the gap breaks its
        TBT target unless every iteration before it shrinks (the scheduler's TBT-slack
        bound: 30 ms iterations instead of 45 on the A100 grid). Alg. 1 chose the offset
        that balances the layer load; requests relaxed at the same moment with the same K now
        run the same group together, which loads every iteration with one group of each."""
        return DecodePlan(L, (self.it0 - 1) % ceil_div(self.n, L))


# -- Alg. 1 and Alg. 2 lines 1-9 as pure functions (the scheduler and the controller's
# LatencyIncrement share them; neither copies the other) -----------------------------------


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """A request about to join a decode instance, as Alg. 1 sees it: ``num_tokens`` is its
    context (prompt + the first token), ``slo`` its targets (only ``slo.tbt`` is used);
    ``masked``: its sampled rows go through a grammar mask (``Request.masked``; the controller's
    :class:`~laser.instance.messages.RequestInfo` does not say, so False)."""

    req_id: str
    num_tokens: int
    slo: SLO
    masked: bool = False


#: Granularity (tokens) of the prefill chunk :func:`exec_plan` prices iterations with.
PREFILL_QUANTUM = 16


def exec_plan(lm: LatencyModel, num_layers: int, iteration: int, decoding: list, plans: dict[str, DecodePlan],
              target_factor: float = 1.0, memo: DecodeMemo | None = None, prefill_rate: float = 0.0,
              max_prefill_tokens: int = 0, spec: SpecShape | None = None, best_effort_share: float = 1.0
              ) -> tuple[dict[str, DecodePlan], float, "_LayerLoad | None"]:
    """Algorithm 1 (PPoPP'26 §6.2.2), ``ExecPlan(N, R, L, O, R*)``: plans for ``decoding``.

    ``decoding``: requests (or :class:`DecodeCandidate`) with ``req_id``, ``num_tokens``,
    ``slo``; a request without a plan in ``plans`` is new (``L = N, O = 0``). T_g is the
    tightest TBT target that can be met at all: not out of reach alone (:func:`tbt_infeasible`),
    and not one whose requests alone at full depth already take longer than it (overload: the
    next looser target is T_g, and those requests run at full depth; our rule, the paper is
    silent). Alg. 1 plans iterations to ``T_g * target_factor`` seconds: while too slow, the most relaxed full-depth request drops to ``L = ceil(N/K)`` layers per
    iteration, ``K = floor(SLO_r/T_g)`` (:func:`relaxed_layers`: its ``ceil(N/L)`` iterations of
    T_g fit its target; the paper's ``ceil(N*T_g/SLO_r)`` when ``SLO_r/T_g`` is whole; best
    effort drops to 1 layer), its first group in the coming iteration
    (:meth:`_LayerLoad.best_offset`); while there is headroom, the strictest reduced request
    is restored to ``L = N`` (reverted and stop if that breaks the target). ``prefill_rate`` (tokens/s, a mixed instance's pending prefill demand):
    every iteration is priced with ``prefill_rate * T_g * target_factor`` prefill tokens
    (rounded up to a multiple of ``PREFILL_QUANTUM``, at most ``max_prefill_tokens``) merged
    into its layer calls (:class:`_LayerLoad`'s ``background``), so Alg. 1 cuts decode
    layers exactly when the merged iteration would not fit. When the decode work alone stays
    over T_g after the relax loop (T_g cannot be held), each reduced request whose token gap
    ``ceil(N/L) * iteration`` would break ``target_factor`` times its own TBT target gets fewer,
    longer groups until it fits (:func:`_keep_reduced_within`; our rule, Alg. 1 assumes
    iterations of T_g). ``spec``: the instance's self-speculation; a speculating request at full depth is
    priced at its speculative step's cost (:class:`_LayerLoad`), and relaxing it stops its
    speculation. Returns ``(plans, T_g, load)``; ``load`` (None when no request has a TBT target)
    prices the returned plans (:meth:`_LayerLoad.predict`, seconds). Pure: the input ``plans`` dict
    is not changed. ``memo``: the caller's :class:`DecodeMemo` of ``lm`` (the same answer, faster).

    ``best_effort_share`` (in (0, 1]; 1.0: the paper's rule, best effort restored up to T_g too, so
    SLO streams get a token per T_g and pile up): below 1.0 a best-effort stream is relaxed and
    restored against ``min(target, best_effort_limit(P, share))``, P the price without best-effort
    streams: best effort slows down, the SLO streams keep their pace. Our rule (issue 28 item 3).
    """
    n = num_layers
    given = plans
    floor = 0.0
    while True:
        plans = {r.req_id: given.get(r.req_id, DecodePlan(n, 0)) for r in decoding}
        # A TBT target that even an iteration of this request alone misses cannot be met by
        # cutting iterations for it: it runs at full depth, as fast as possible, and T_g comes
        # from the targets that can be met (Laser would otherwise halve throughput for nobody).
        t_g = _tightest_feasible_tbt(lm, decoding, memo, floor)
        if t_g == math.inf:
            return {rid: DecodePlan(n, 0) for rid in plans}, t_g, None
        target = t_g * target_factor
        background = 0
        if prefill_rate > 0 and max_prefill_tokens > 0:
            q = PREFILL_QUANTUM
            background = min(max_prefill_tokens, q * math.ceil(prefill_rate * target / q))
        load = _LayerLoad(lm, n, iteration, decoding, plans, memo, background, spec)
        be_target = target
        if best_effort_share < 1.0 and any(yields_to_slo(r.slo) for r in decoding):
            slo = [r for r in decoding if not yields_to_slo(r.slo)]
            slo_price = _LayerLoad(lm, n, iteration, slo, {r.req_id: plans[r.req_id] for r in slo}, memo,
                                   background, spec).predict()
            be_target = min(target, best_effort_limit(slo_price, best_effort_share))
        _relax_and_restore(load, plans, decoding, n, t_g, target, be_target)
        # (judged on the decode work alone: the priced prefill gives way to the TBT gaps)
        bare = load if not background else _LayerLoad(lm, n, iteration, decoding, plans, memo, spec=spec)
        if bare.predict() > t_g and _keep_reduced_within(bare, plans, decoding, n, target_factor) and background:
            load = _LayerLoad(lm, n, iteration, decoding, plans, memo, background, spec)
        if load.predict() <= t_g or not _overloaded(lm, n, iteration, decoding, t_g, floor, memo, spec):
            return plans, t_g, load
        # Overload: the requests at T_g (and tighter) alone, at full depth, already take longer
        # than T_g, so every one of them misses whatever is cut for them; they run at full
        # depth and T_g comes from the next looser target (else the whole instance is held to
        # an iteration nobody gets).
        floor = t_g


def _relax_and_restore(load: "_LayerLoad", plans: dict[str, DecodePlan], decoding: list, n: int, t_g: float,
                       target: float, be_target: float | None = None) -> None:
    """Alg. 1's two loops on ``load`` and ``plans`` (both changed in place): relax the most
    relaxed full-depth requests while the iteration is over ``target`` seconds (a best-effort
    one: over ``be_target``, default ``target``), then restore the strictest reduced ones while
    it stays under (a best-effort one: under ``be_target``)."""
    be_target = target if be_target is None else be_target

    def limit(r) -> float:
        return be_target if yields_to_slo(r.slo) else target

    # relax: the most relaxed full-depth request first
    split = be_target < target  # (the requests that yield relax first and restore last)
    relaxable = () if load.predict() <= min(target, be_target) else sorted(  # (the loop would stop at once)
        (r for r in decoding if plans[r.req_id].layers >= n and r.slo.tbt_or_inf > t_g),
        key=lambda r: (split and not yields_to_slo(r.slo), -r.slo.tbt_or_inf),
    )
    for r in relaxable:
        if load.predict() <= limit(r):
            if yields_to_slo(r.slo):
                continue  # (within the best-effort limit: the SLO streams after it are judged by target)
            break
        slo = r.slo.tbt_or_inf
        L = 1 if slo == math.inf else relaxed_layers(n, t_g, slo)  # best effort: 1 layer
        if L >= n:
            continue
        load.remove(plans[r.req_id], load.depths.get(r.req_id), r.req_id)
        plans[r.req_id] = load.best_offset(L)
        load.add(plans[r.req_id])
    # restore: the strictest reduced request first; revert (and stop) if it breaks the target
    reduced = sorted((r for r in decoding if plans[r.req_id].layers < n),
                     key=lambda r: (split and yields_to_slo(r.slo), r.slo.tbt_or_inf)) if load.num_partial else ()
    for r in reduced:
        if load.predict() >= limit(r):
            break
        old = plans[r.req_id]
        depth = load.depths.get(r.req_id)
        load.remove(old)
        load.add(DecodePlan(n, 0), depth=depth, rid=r.req_id)
        if load.predict() > limit(r):
            load.remove(DecodePlan(n, 0), depth, r.req_id)
            load.add(old)
            break
        plans[r.req_id] = DecodePlan(n, 0)


def relaxed_layers(n: int, t_g: float, tbt: float) -> int:
    """Layers per iteration Alg. 1's relax loop gives a request with TBT target ``tbt`` (seconds)
    when iterations are held to ``t_g`` seconds: ``ceil(N / K)`` with ``K = floor(tbt / t_g)``,
    the most iterations of T_g its token may take. The paper writes ``ceil(N*T_g/TBT_r)``
    (PPoPP'26 §6.2.2), the same number when ``TBT_r / T_g`` is whole, but a token takes ``ceil(N/L)``
    whole iterations: for TBT_r = 2.4 T_g on 30 layers its 13 layers made 3 iterations per token
    (3 x 47 = 142 ms against 120 ms with T_g held), and 1 < TBT_r/T_g < 2 made 2 iterations
    against a target under 2 T_g (every token late); ``N`` (no cut) when ``K`` is 1. Our rule."""
    # (1e-9: 0.1 / 0.05 must be 2 iterations, whatever the floating point does)
    k = max(1, math.floor(tbt / t_g + 1e-9))
    return ceil_div(n, k)


def _keep_reduced_within(load: "_LayerLoad", plans: dict[str, DecodePlan], decoding: list, n: int,
                         target_factor: float) -> bool:
    """When the iteration stays over T_g after Alg. 1's relax loop (T_g cannot be held:
    its requests plus every looser one at its fewest layers still take longer), a reduced
    request's token takes ``ceil(N/L)`` of these longer iterations, not of T_g ones, and can
    miss its own target though it was cut for T_g's. Give each reduced request whose gap
    ``ceil(N/L) * iteration`` exceeds ``target_factor * TBT_r`` the layers per iteration that
    bring it back within (fewer, longer groups; full depth at most), strictest first, until
    none is over: the requests at T_g miss either way, the looser ones need not (issue 16's
    offline case: summarization streams cut to 8 of 30 layers for a lost code stream's 50 ms
    took 4 x 58 ms = 235 ms per token against 200 ms). Our rule; Alg. 1 assumes iterations of T_g.
    ``load`` and ``plans`` change in place; returns whether a plan changed."""
    changed = False
    for _ in range(n):
        it = load.predict()
        over = sorted((r for r in decoding if plans[r.req_id].layers < n
                       and plans[r.req_id].groups(n) * it > target_factor * r.slo.tbt_or_inf),
                      key=lambda r: r.slo.tbt_or_inf)
        if not over:
            return changed
        changed = True
        for r in over:
            old = plans[r.req_id]
            k = max(1, min(old.groups(n) - 1, math.floor(target_factor * r.slo.tbt / it)))
            layers = ceil_div(n, k)
            load.remove(old)
            plans[r.req_id] = load.best_offset(layers) if layers < n else DecodePlan(n, 0)
            load.add(plans[r.req_id], depth=load.depths.get(r.req_id), rid=r.req_id)
    return changed


def _overloaded(lm: LatencyModel, n: int, iteration: int, decoding: list, t_g: float, floor: float,
                memo: DecodeMemo | None, spec: SpecShape | None = None) -> bool:
    """Whether the requests whose targets set T_g (TBT in (``floor``, ``t_g``]), decoding alone at
    full depth (speculating where they do), take longer than ``t_g`` seconds per iteration."""
    tight = [r for r in decoding if r.slo.tbt is not None and floor < r.slo.tbt <= t_g]
    full = {r.req_id: DecodePlan(n, 0) for r in tight}
    return _LayerLoad(lm, n, iteration, tight, full, memo, spec=spec).predict() > t_g


def _tightest_feasible_tbt(lm: LatencyModel, decoding: list, memo: DecodeMemo | None, floor: float = 0.0) -> float:
    """The tightest TBT target of ``decoding`` above ``floor`` that is not out of reach alone
    (:func:`tbt_infeasible`; inf if none), seconds."""
    return min((r.slo.tbt_or_inf for r in decoding if r.slo.tbt_or_inf > floor and not tbt_infeasible(lm, r, memo)),
               default=math.inf)


def level_given_up(lm: LatencyModel, decoding: list, t_g: float, memo: DecodeMemo | None = None) -> bool:
    """Whether ``t_g`` (seconds; :func:`exec_plan`'s T_g for ``decoding``) is looser than the
    tightest TBT target of ``decoding`` reachable alone: Alg. 1 gave a level up because its own
    requests overload the iteration, so the strictest TBT that could be met breaks (Alg. 2 line
    7's condition, PPoPP'26 §7.2.1, and the migration trigger's, CONTROLLER.md D9)."""
    return _tightest_feasible_tbt(lm, decoding, memo) < t_g


def tbt_infeasible(lm: LatencyModel, r, memo: DecodeMemo | None = None) -> bool:
    """Whether ``r``'s TBT target is missed even by a decode iteration of ``r`` alone
    (every layer, its context; seconds from the latency model). ``memo``: a
    :class:`DecodeMemo` of ``lm`` (memoised per context and target)."""
    tbt = r.slo.tbt
    if tbt is None:
        return False
    memo = memo_for(lm, memo)
    if memo is not None:
        return memo.tbt_infeasible(r.num_tokens, tbt)
    return lm.predict_decode_iteration((r.num_tokens,)) > tbt


def due_requests(decoding: list, plans: dict[str, DecodePlan], num_layers: int, iteration: int) -> list:
    """The requests of ``decoding`` whose plan runs a layer group in ``iteration`` (Alg. 1's cycle):
    group g (layers ((g-1)L, gL]) of request r runs iff ``(iteration - g - O_r) mod K_r == 0``; a
    full-depth request, or one finishing a group a preemption cut short, runs every iteration."""
    n = num_layers
    due = []
    for r in decoding:
        p = plans[r.req_id]
        if p.layers >= n or r.next_layer % p.layers:
            due.append(r)  # full depth, or finishing a group cut short by a preemption
            continue
        g = r.next_layer // p.layers + 1
        if (iteration - g - p.offset) % p.groups(n) == 0:
            due.append(r)
    return due


def group_end(r, p: DecodePlan, num_layers: int) -> int:
    """The layer where the group ``r`` runs next under plan ``p`` ends (``num_layers`` at full depth)."""
    n = num_layers
    return n if p.layers >= n else min(n, (r.next_layer // p.layers + 1) * p.layers)
