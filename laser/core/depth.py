"""Lossy dynamic depth (issue 31 item 3): the opt-in, the exit rule's parameters and the depth a
scheduler expects of a request. Torch-free (schedulers and the simulator read it).

A request that opts in (``SamplingParams.dynamic_depth``, or an SLO class whose config has a
``"dynamic_depth"`` entry) lets its decode tokens leave the model early: after each layer
``k`` where a trained exit head exists (:class:`laser.model.exits.ExitHeads`), and at least
``min_depth`` layers deep, the exit head's top-1 probability (softmax over its draft
vocabulary) is compared with ``threshold``; at or above it the token is that exit's top-1
token and the layers ``k..N-1`` are skipped, their K/V for the position written from the exit
hidden state through those layers' K/V projections only (:meth:`laser.model.runner.ModelRunner.early_exit`).
CALM (Schuster et al., NeurIPS'22 §3: softmax-confidence exits, the skipped layers' KV
propagated from the exit state) is the scheme; the exit heads are LayerSkip/Kangaroo-style
adapters on the frozen model.

A request that does not opt in runs exactly as before (no exit check touches it).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from .request import InvalidRequestError

#: Default confidence threshold (top-1 probability of the exit head).
DEFAULT_THRESHOLD = 0.9


@dataclass(frozen=True)
class DynamicDepth:
    """A request's early-exit settings.

    ``threshold``: in (0, 1]; a token exits at the first allowed exit whose top-1 probability
    is >= it (1.0 exits only on certainty). ``min_depth``: layers every token runs before any
    exit (None: a quarter of the model's layers, rounded up; :meth:`min_layers`).

    Raises InvalidRequestError (naming ``dynamic_depth.threshold`` / ``dynamic_depth.min_depth``)
    for values out of range.
    """

    threshold: float = DEFAULT_THRESHOLD
    min_depth: int | None = None

    def __post_init__(self):
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t <= 1):
            raise InvalidRequestError(f"dynamic_depth.threshold must be a number in (0, 1], got {t!r}")
        object.__setattr__(self, "threshold", float(t))
        m = self.min_depth
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise InvalidRequestError(f"dynamic_depth.min_depth must be an integer >= 1 (layers), got {m!r}")

    def min_layers(self, num_layers: int) -> int:
        """Layers a token runs before it may exit: ``min_depth`` (at most ``num_layers``) or
        ``ceil(num_layers / 4)``."""
        return min(num_layers, self.min_depth if self.min_depth is not None else -(-num_layers // 4))

    @classmethod
    def parse(cls, value, field: str = "dynamic_depth") -> "DynamicDepth | None":
        """From an API value: None/False (off), True (defaults), a dict with ``threshold`` and
        ``min_depth``, or a :class:`DynamicDepth`. Raises InvalidRequestError naming ``field``."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{field} must be true, false or an object with threshold and min_depth, "
                                      f"got {type(value).__name__}")
        unknown = set(value) - {"threshold", "min_depth"}
        if unknown:
            raise InvalidRequestError(f"{field}: unknown field(s) {sorted(unknown)}; known: threshold, min_depth")
        return cls(value.get("threshold", DEFAULT_THRESHOLD), value.get("min_depth"))


class DepthMeans:
    """Running means of the depth (layers run per decode token) of the requests that opted in,
    per SLO class: what a new request of the class is expected to use before it has tokens of
    its own. ``update`` after each token; ``expected`` the class mean (None: no token yet)."""

    def __init__(self):
        self._sum: dict[str, float] = {}
        self._n: dict[str, int] = {}

    def update(self, name: str, depth: int) -> None:
        self._sum[name] = self._sum.get(name, 0.0) + depth
        self._n[name] = self._n.get(name, 0) + 1

    def expected(self, name: str) -> float | None:
        n = self._n.get(name, 0)
        return self._sum[name] / n if n else None

    def snapshot(self) -> dict[str, float]:
        """Class name -> mean depth (layers) so far."""
        return {k: self._sum[k] / n for k, n in self._n.items() if n}

    def record(self, req, depth: int) -> None:
        """A decode token of dynamic-depth ``req`` (a :class:`~laser.core.request.Request`) ran
        ``depth`` layers: update its running mean, its class's, and the depth Alg. 1 plans it
        with (``req.expected_layers``)."""
        req.num_depth_tokens += 1
        req.depth_layers += depth
        self.update(req.slo.name, depth)
        req.expected_layers = req.depth_layers / req.num_depth_tokens

    def seed(self, req) -> None:
        """Seed a dynamic-depth request's expected depth from its SLO class's running mean (a
        request with tokens of its own keeps its own mean; a request not opting in: nothing)."""
        if req.sampling_params.dynamic_depth is not None and not req.num_depth_tokens:
            req.expected_layers = self.expected(req.slo.name)


def expected_layers(req, num_layers: int) -> int:
    """Layers per decode token a scheduler plans ``req`` with: ``num_layers`` unless it opted in
    and has an expectation (``req.expected_layers``: its running mean depth, seeded by its
    class's), then that mean rounded up (a slot is a whole layer), within [1, num_layers].
    Accepts any object (a :class:`laser.scheduler.laser.decode.DecodeCandidate` has none)."""
    e = getattr(req, "expected_layers", None)
    if e is None:
        return num_layers
    return max(1, min(num_layers, math.ceil(e - 1e-9)))


def exit_plan(req, token_start: int, num_tokens: int, num_layers: int) -> tuple[int, int]:
    """``(depth, exit_from)`` of a work of ``req`` running ``num_tokens`` tokens from
    ``token_start`` through every layer (:attr:`laser.core.plan.Work.depth` /
    ``exit_from``): for a decode token of a request that opted in -- the tokens the exit check
    looks at (:meth:`laser.model.runner.ModelRunner.early_exit`) -- its expected layers
    (:func:`expected_layers`) and its min depth; ``(0, 0)`` for any other work (priced as before)."""
    dd = getattr(getattr(req, "sampling_params", None), "dynamic_depth", None)
    if dd is None or num_tokens != 1 or not req.output_token_ids or token_start != req.num_tokens - 1:
        return 0, 0
    return expected_layers(req, num_layers), dd.min_layers(num_layers)


@dataclass(frozen=True)
class ExitCost:
    """What dynamic depth adds to the price of the decode tokens that may exit, beyond the layers
    they run: the one owner of that rule, for the plans' price
    (:class:`laser.core.pricing.PlanCost`, through ``LatencyModel.exit_cost``) and the
    simulator's clock (:class:`laser.sim.instance.SimDepth`).

    A token expected to run ``d`` layers whose min depth is ``m`` is checked by the exit head at
    every exit layer ``k`` with ``m <= k <= d`` (``k < N``: the exits it passes, and the one it
    leaves by), each check ``head_fraction`` x the LM head's time per row (a batched check of
    ``r`` rows: ``head_fraction * lm.head_time(r)``); one that leaves at ``d < N`` skips the LM
    head and fills the K/V of its ``N - d`` skipped layers, ``fill_fraction`` x a layer's
    stateless time per layer (:meth:`laser.model.runner.ModelRunner.early_exit`).
    ``exit_layers``: the layers with an exit head (1..N-1).
    """

    exit_layers: frozenset[int]
    head_fraction: float = 0.0
    fill_fraction: float = 0.0

    def check_layers(self, depth: int, exit_from: int, num_layers: int) -> list[int]:
        """The exit layers a token of expected ``depth`` and min depth ``exit_from`` is checked at."""
        return sorted(k for k in self.exit_layers if exit_from <= k <= depth and k < num_layers)

    def check_time(self, lm, rows: int) -> float:
        """One exit layer's check of ``rows`` rows (seconds; 0.0 for none)."""
        return self.head_fraction * lm.head_time(rows) if rows else 0.0

    def fill_time(self, lm, skipped: int, rows: int) -> float:
        """The K/V fill of ``skipped`` layers for ``rows`` rows that left together (seconds)."""
        return self.fill_fraction * skipped * lm.stateless_time(rows) if rows and skipped else 0.0

    def price(self, lm, num_layers: int, works) -> float:
        """The exit checks and fills of ``works`` (:class:`laser.core.plan.Work` s; those with
        ``exit_from`` count), seconds: per exit layer, one batched check of the works checked
        there; per expected depth ``d < N``, one fill of the works leaving there."""
        rows: Counter = Counter()
        leave: Counter = Counter()
        for w in works:
            if not w.exit_from:
                continue
            d = w.priced_end
            rows.update(self.check_layers(d, w.exit_from, num_layers))
            if d < num_layers:
                leave[d] += 1
        return (sum(self.check_time(lm, r) for _, r in sorted(rows.items()))
                + sum(self.fill_time(lm, num_layers - d, c) for d, c in sorted(leave.items())))
