"""The goodput search: the one place that decides which rates to probe and what the goodput is.

Goodput (paper §9, DistServe's definition) is the highest request rate (req/s) at which at
least ``attainment_target`` (0.9) of the requests meet their SLO. Attainment is assumed
non-increasing in rate, so the passing rates form an interval and a knee exists between
the highest passing and the lowest failing probe.

:func:`search_goodput` finds that knee for several targets at once, interleaved (each
round runs every target that still needs a probe, rotating who goes first), so a noisy
machine shifts them alike:

1. **Grid.** ``grid_points`` geometric rates over ``[lo, hi]``, ascending; a target stops
   climbing after two failing grid rates in a row (unless ``full_grid``).
2. **Extend until every target has failed and passed a probe.** A target that passed
   every rate is first probed with the whole workload arriving at once (rate ``inf``, a
   burst): a finite workload that passes even then has no knee (``unbounded``: every rate
   passes). Otherwise it is probed at twice its highest rate, again and again, until it
   fails; one that failed its lowest rate is probed at half of it until it passes. This
   goes on until a cap is hit: the wall-time cap ``time_cap_s``, or ``max_doublings``
   each way; a target whose attainment did not rise over ``FLAT_HALVINGS`` halvings in a row
   stops halving (its misses do not depend on the rate: "below range", with that reason).
3. **Bisect** each target's bracket (highest passing rate with every lower probe passing,
   lowest failing rate) for at most ``bisect_steps`` rounds, until
   ``hi - lo <= rel_tol * hi``.

A goodput is reported as a lower bound ("≥ x") only when a cap stopped the search before
that target failed a probe, and the result then says which cap (:attr:`GoodputResult.capped`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

# Doublings (and halvings) per target before the search gives up: 2**30 times the range.
DEFAULT_MAX_DOUBLINGS = 30
# A target failing its lowest rate stops halving once this many halvings in a row left its
# attainment where it was: its misses do not depend on the rate (each halving doubles a probe).
FLAT_HALVINGS = 2


class ProbeLike(Protocol):
    """What the search needs of a probe: its rate (req/s) and its SLO attainment in [0, 1]."""

    rate: float

    @property
    def attainment(self) -> float: ...


@dataclass
class GoodputResult:
    """Goodput of one target: the highest probed rate that passes with every lower probe passing.

    ``goodput_rps`` is in req/s. Exactly one of these holds:

    * ``bracket`` is set: the knee lies in ``(bracket[0], bracket[1]]`` (a measured goodput);
    * ``lower_bound``: every probe passed and a cap (``capped`` says which) stopped the
      search before a failing rate was found — the true goodput is ≥ ``goodput_rps``;
    * ``below_range``: every probe failed down to the lowest probed rate (``goodput_rps``
      is 0.0; the true goodput is below ``min(probed rates)``);
    * ``unbounded``: the workload passed even as one burst (rate ``inf``): every rate
      passes, and ``goodput_rps`` is the highest finite rate probed.
    """

    label: str
    goodput_rps: float
    lower_bound: bool = False
    below_range: bool = False
    bracket: tuple[float, float] | None = None  # (highest passing, lowest failing)
    probes: list = field(default_factory=list, repr=False)
    # why the search stopped early for this target (time cap, doubling limit); None if it did not
    capped: str | None = None
    unbounded: bool = False

    def display(self, nd: int = 3, notes: bool = True) -> str:
        """This goodput as text: see :func:`format_goodput`."""
        return format_goodput(self.goodput_rps, lower_bound=self.lower_bound, below_range=self.below_range,
                              unbounded=self.unbounded, capped=self.capped,
                              lowest_rate=min((p.rate for p in self.probes if p.rate is not None), default=None),
                              nd=nd, notes=notes)

    def to_json(self) -> dict:
        """The ``goodput_*`` fields of a policy's JSON block (read back by :func:`display_goodput_json`)."""
        return {"goodput_rps": self.goodput_rps, "goodput_lower_bound": self.lower_bound,
                "goodput_below_range": self.below_range,
                # why the search stopped before this policy failed a probe (then goodput is a lower bound)
                "goodput_capped": self.capped,
                # even the whole workload arriving at once passed: every rate passes (no knee)
                "goodput_unbounded": self.unbounded,
                "goodput_bracket_rps": list(self.bracket) if self.bracket else None}

    def class_goodput(self, target: float) -> dict[str, float]:
        """Per class: the highest probed rate at which the class's attainment passes, with
        the class passing at every lower probed rate (0.0 if the lowest fails)."""
        out: dict[str, float] = {}
        classes = sorted({c for p in self.probes for c in p.summary.per_class})
        for c in classes:
            g = 0.0
            for p in sorted(self.probes, key=lambda p: p.rate or 0.0):
                a = p.class_attainment().get(c)
                if a is None:
                    continue
                if a + 1e-12 < target:
                    break
                g = p.rate or 0.0
            out[c] = g
        return out


# the ``goodput_*`` fields of a policy block with no goodput search
NO_GOODPUT_JSON = {"goodput_rps": None, "goodput_lower_bound": False, "goodput_below_range": False,
                   "goodput_capped": None, "goodput_unbounded": False, "goodput_bracket_rps": None}


def format_goodput(goodput_rps: float | None, *, lower_bound: bool = False, below_range: bool = False,
                   unbounded: bool = False, capped: str | None = None, lowest_rate: float | None = None,
                   nd: int = 3, notes: bool = True) -> str:
    """The one text of a goodput (req/s) for every report: ``laser bench``'s summary and
    comparison table, the Markdown tables of the end-to-end benchmarks, the JSON of
    ``benchmarks/robustness.py`` and of a ``:best`` budget sweep.

    * ``"unbounded (no knee: ...)"``: the workload passed even as one burst (no rate fails);
    * ``">=1.234 (cap: time cap 900 s)"``: a cap stopped the search before a probe failed;
    * ``"<0.100 (every probe failed)"``: every probe failed, down to ``lowest_rate``
      (``"below range"`` when that rate is not known);
    * ``"1.234"``: a measured goodput; ``"-"``: no goodput (no search ran).

    ``notes=False`` drops the parenthesised notes, for a table that explains the marks under it.
    The flags are those of :class:`GoodputResult` (at most one of them holds).
    """
    if unbounded:
        return "unbounded" + (" (no knee: the whole workload at once passes)" if notes else "")
    if below_range:
        if lowest_rate is None or not math.isfinite(lowest_rate):
            return "below range"
        return f"<{lowest_rate:.{nd}f}" + (f" (every probe failed{'; ' + capped if capped else ''})" if notes else "")
    if goodput_rps is None:
        return "-"
    if lower_bound:
        return f">={goodput_rps:.{nd}f}" + (f" (cap: {capped})" if notes and capped else "")
    return f"{goodput_rps:.{nd}f}"


def display_goodput_json(block: dict, nd: int = 3, notes: bool = True) -> str:
    """:func:`format_goodput` of a policy's JSON block (``laser bench --json``: the fields of
    :meth:`GoodputResult.to_json`, the lowest rate from its ``probes``' ``rate_rps``)."""
    rates = [p["rate_rps"] for p in block.get("probes") or () if p.get("rate_rps") is not None]
    return format_goodput(block.get("goodput_rps"), lower_bound=bool(block.get("goodput_lower_bound")),
                          below_range=bool(block.get("goodput_below_range")),
                          unbounded=bool(block.get("goodput_unbounded")), capped=block.get("goodput_capped"),
                          lowest_rate=min(rates, default=None), nd=nd, notes=notes)


def geometric_grid(lo: float, hi: float, n: int) -> list[float]:
    """``n`` rates from ``lo`` to ``hi`` (inclusive), equally spaced in log scale, rounded to 4 digits."""
    if not (0 < lo <= hi) or n < 1:
        raise ValueError(f"need 0 < lo <= hi and n >= 1, got {lo}, {hi}, {n}")
    if n == 1 or lo == hi:
        return [float(f"{hi:.4g}")]
    return sorted({float(f"{x:.4g}") for x in np.geomspace(lo, hi, n)})


def _round(rate: float) -> float:
    return float(f"{rate:.4g}")


def search_goodput(
    probe: Callable[[str, float], ProbeLike],
    labels: Sequence[str],
    lo: float,
    hi: float,
    *,
    attainment_target: float = 0.9,
    grid_points: int = 4,
    bisect_steps: int = 2,
    rel_tol: float = 0.02,
    full_grid: bool = False,
    max_doublings: int = DEFAULT_MAX_DOUBLINGS,
    time_cap_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, GoodputResult]:
    """Goodput of every target in ``labels`` (see the module docstring for the search).

    Args:
        probe: ``probe(label, rate)`` runs target ``label`` at ``rate`` req/s and returns
            its probe (``.rate``, ``.attainment``).
        lo, hi: the initial grid range (req/s), ``0 < lo <= hi``.
        max_doublings: at most this many doublings (halvings) per target beyond the grid.
        time_cap_s: wall seconds (by ``clock``) after which no new probe starts; None = no cap.

    Raises:
        ValueError: on a bad range, tolerance or empty ``labels``.
    """
    if not (0 < lo <= hi) or not np.isfinite(hi):
        raise ValueError(f"need 0 < lo <= hi < inf, got lo={lo}, hi={hi}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be > 0, got {rel_tol}")
    labels = list(labels)
    if not labels:
        raise ValueError("no targets")
    search = _Search(probe, labels, attainment_target, clock, time_cap_s)
    search.grid(geometric_grid(lo, hi, grid_points), full_grid)
    search.extend(max_doublings)
    search.bisect(bisect_steps, rel_tol)
    return search.results()


class _Search:
    """The state of one :func:`search_goodput`: every target's probes so far and whether the time
    cap stopped it; its three phases in order (grid, extend, bisect), then the results."""

    def __init__(self, probe, labels: list[str], attainment_target: float, clock, time_cap_s: float | None):
        self.probe, self.labels, self.target = probe, labels, attainment_target
        self.clock, self.time_cap_s = clock, time_cap_s
        self.start = clock()
        self.mine: dict[str, list[ProbeLike]] = {lb: [] for lb in labels}
        self.cap_hit: str | None = None
        self.limit_hit: dict[str, str] = {}
        self.burst: dict[str, bool] = {}  # label -> whether the whole workload at once passed

    def passes(self, p: ProbeLike) -> bool:
        return p.attainment + 1e-12 >= self.target

    def run_round(self, todo: list[tuple[str, float]], rotate: int) -> None:
        if todo:
            k = rotate % len(todo)
            todo = todo[k:] + todo[:k]
        for lb, r in todo:
            if self.time_cap_s is not None and self.clock() - self.start >= self.time_cap_s:
                self.cap_hit = f"time cap {self.time_cap_s:g} s"
                return
            self.mine[lb].append(self.probe(lb, r))

    def bracket(self, lb: str) -> tuple[float | None, float | None]:
        """(highest passing finite rate with every lower probe passing, lowest failing finite rate)."""
        best, fail = None, None
        for p in sorted((p for p in self.mine[lb] if p.rate < math.inf), key=lambda p: p.rate):
            if self.passes(p):
                best = p.rate
            else:
                fail = p.rate
                break
        return best, fail

    def grid(self, rates: list[float], full_grid: bool) -> None:
        """1. The grid, every target at each rate; a target stops after two failures in a row
        (unless ``full_grid``)."""
        mine, labels = self.mine, self.labels
        fails_in_row = {lb: 0 for lb in labels}
        for k, r in enumerate(rates):
            if self.cap_hit:
                break
            active = [lb for lb in labels if full_grid or fails_in_row[lb] < 2]
            n0 = {lb: len(mine[lb]) for lb in active}
            self.run_round([(lb, r) for lb in active], k)
            for lb in active:
                if len(mine[lb]) > n0[lb]:
                    fails_in_row[lb] = 0 if self.passes(mine[lb][-1]) else fails_in_row[lb] + 1

    def extend(self, max_doublings: int) -> None:
        """2. Extend until every target has failed a probe (and passed one)."""
        mine, burst = self.mine, self.burst
        moves = {lb: 0 for lb in self.labels}
        # halvings in a row that did not raise a target's attainment: misses that do not depend
        # on the rate (a request that misses even alone); halving on would only double each probe
        flat = {lb: 0 for lb in self.labels}
        for e in range(max_doublings + 2):
            if self.cap_hit:
                break
            todo = []
            for lb in self.labels:
                a, b = self.bracket(lb)
                finite = [p.rate for p in mine[lb] if p.rate < math.inf]
                if b is None and a is not None:
                    if lb not in burst:
                        todo.append((lb, math.inf))
                    elif burst[lb]:
                        continue  # no knee: every rate passes
                    elif moves[lb] >= max_doublings:
                        self.limit_hit[lb] = f"{max_doublings} doublings"
                    else:
                        moves[lb] += 1
                        todo.append((lb, _round(2 * max(finite))))
                elif a is None and finite and flat[lb] >= FLAT_HALVINGS:
                    self.limit_hit[lb] = f"attainment did not rise over {FLAT_HALVINGS} halvings of the rate"
                elif a is None and finite and moves[lb] < max_doublings:
                    moves[lb] += 1
                    todo.append((lb, _round(0.5 * min(finite))))
            if not todo:
                break
            before = {lb: self._lowest(lb).attainment for lb, r in todo if r < math.inf and self.bracket(lb)[0] is None}
            self.run_round(todo, e)
            for lb, r in todo:
                if r == math.inf and mine[lb] and mine[lb][-1].rate == math.inf:
                    burst[lb] = self.passes(mine[lb][-1])
                elif lb in before and mine[lb] and mine[lb][-1].rate == r:
                    flat[lb] = flat[lb] + 1 if mine[lb][-1].attainment <= before[lb] + 1e-12 else 0

    def _lowest(self, lb: str) -> ProbeLike:
        """The probe of ``lb`` at its lowest finite rate."""
        return min((p for p in self.mine[lb] if p.rate < math.inf), key=lambda p: p.rate)

    def bisect(self, bisect_steps: int, rel_tol: float) -> None:
        """3. Bisect every bracket wider than ``rel_tol``."""
        for step in range(bisect_steps):
            if self.cap_hit:
                break
            todo = []
            for lb in self.labels:
                a, b = self.bracket(lb)
                if a is not None and b is not None and b - a > rel_tol * b:
                    mid = _round(0.5 * (a + b))
                    if a < mid < b:
                        todo.append((lb, mid))
            if not todo:
                break
            self.run_round(todo, step)

    def results(self) -> dict[str, GoodputResult]:
        out = {}
        for lb in self.labels:
            mine = self.mine[lb]
            a, b = self.bracket(lb)
            unbounded = b is None and self.burst.get(lb, False)
            lower = a is not None and b is None and not unbounded
            out[lb] = GoodputResult(lb, a or 0.0, lower_bound=lower, below_range=a is None and bool(mine),
                                    bracket=(a, b) if a is not None and b is not None else None,
                                    probes=sorted(mine, key=lambda p: p.rate),
                                    capped=(self.limit_hit.get(lb) or self.cap_hit)
                                    if lower or not mine or (a is None and lb in self.limit_hit) else None,
                                    unbounded=unbounded)
        return out
