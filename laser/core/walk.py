"""The one layer-by-layer plan walker: every layer-boundary rule of a step lives here.

A :class:`~laser.core.plan.StepPlan` runs layer ``j`` for every work with
``layer_start <= j < layer_end``. The torch executor (:class:`laser.model.runner.ModelRunner`)
and the simulated one (:class:`laser.sim.instance.SimExecutor`) differ only in what a layer
call *is* (tensor maths vs. a latency-model prediction); which works run where, when a stop
pauses what, which works park in the intermediate cache and which resume from it is decided
here, once, so the simulator cannot drift from the engine.

Rules, at each boundary ``j`` (in this order):

1. Works whose ``layer_end == j`` leave the batch (parked at ``j`` when ``j < N``).
2. ``stop_at(j)`` is asked (not at the first layer, and never again once it said True). A
   stop pauses every prefill work at ``j``; decode works run on to their ``layer_end``
   (:meth:`~laser.core.plan.Work.reached`). With nothing left to run, the step ends.
3. Works whose ``layer_start == j`` join (embedded at 0, restored from the intermediate cache
   otherwise) -- after a stop, only those that :meth:`~laser.core.plan.Work.reached` still lets run.
4. The layer runs for the active works (a gap between works runs nothing).

At the end, works still active either finish the last layer (sampled) or park at it.

Early exits (dynamic depth, :mod:`laser.core.depth`): an executor whose ``exit_layers`` (a set,
for this plan; empty or absent: none) holds boundary ``j`` is asked ``early_exit(active, j)``
after layer ``j - 1`` ran (``j`` below the model's last layer); the works it returns as gone
left the model there (the executor produced their tokens and filled their later layers' KV),
and the batch is composed anew at ``j``.

Prepared compositions: an executor with ``prepare(compositions)`` is handed, before the first layer,
the compositions the step goes through when nothing stops it and no token exits
(:func:`compositions`), so it can build their per-composition state in one burst while its code is
still cache-warm (the torch executor's attention metadata); ``compose`` still comes at each change
and must check that the batch is the prepared one (a stop or an exit changes it).

Segment mode: with no ``stop_at``, no early exits and an executor that has ``run_layers(layers, active)``,
the walker visits only the boundaries where the batch changes and hands the executor each
constant-composition segment at once (the simulator prices it with one latency-model call).
The rules and their order are the same; the torch executor has no ``run_layers``.

Span mode: an executor with ``run_span(start, end, active, stop_at)`` (and no early exits) runs each
constant-composition span ``start..end-1`` itself, asking ``stop_at(k)`` before each layer ``k``
after the first (``stop_at`` None: it asks nothing) -- the very calls, in the same order, the
layer-by-layer loop makes -- and returns ``end``, or the first ``k`` where ``stop_at(k)`` said True
(layers ``start..k-1`` ran); the walker then applies rules 2-4 at ``k`` with that answer. The torch
executor runs the layers of a span from one tight loop: the Python between two layer calls, cache
cold after each, is a few lines instead of the walker's boundary checks and a ``run_layer`` frame.
Torch-free.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from .plan import StepPlan, Work


class LayerExecutor(Protocol):
    """What the walker needs from an executor. It keeps the active works' states (hidden rows or
    nothing) and may reorder the active list; the walker keeps the list it returns."""

    def park(self, active: list[Work], leaving: Sequence[Work], layer: int) -> list[Work]:
        """Move ``leaving`` (a subset of ``active``) out of the batch; their hidden states go to
        the intermediate cache at ``layer`` (``layer < N``). Returns the works still active."""

    def join(self, active: list[Work], joining: Sequence[Work]) -> list[Work]:
        """Add ``joining`` works (embed at layer 0, restore from the intermediate cache otherwise).
        Returns the new active list (any order)."""

    def compose(self, active: list[Work], layers: range) -> None:
        """The batch changed to ``active`` and stays so over ``layers`` unless a stop intervenes
        (the torch executor builds attention metadata here, once for all those layers)."""

    def run_layer(self, layer: int, active: list[Work]) -> None:
        """Run one layer call for ``active``. When it returns, layer ``layer``'s K/V of every
        work in ``active`` is written: the point where the torch executor streams a finished
        layer of a final prefill chunk to its decode instance (``ModelRunner.kv_streams``)."""

    def finish(self, active: list[Work], layer: int) -> None:
        """Works active at the plan's last layer: sample (``layer == N``) or park at ``layer``."""

    # optional: exit_layers (a set of boundaries) and
    # early_exit(active, layer) -> the works still active (the others left the model at ``layer``);
    # prepare(compositions) -> None: the step's compositions ahead of time (:func:`compositions`)


def walk(plan: StepPlan, ex: LayerExecutor, stop_at: Callable[[int], bool] | None = None) -> int:
    """Run ``plan`` on ``ex`` layer by layer. Returns the stopped layer: ``plan.last_layer`` when
    nothing stopped the step, else the boundary ``j`` where ``stop_at(j)`` said True.

    Cost at a boundary where nothing changes: one set lookup (plus ``stop_at``).
    """
    if not plan.works:
        return 0
    starts, ends = plan.boundaries()
    change_points = sorted(set(starts) | set(ends))
    run_layers = getattr(ex, "run_layers", None)
    if stop_at is None and run_layers is not None and not getattr(ex, "exit_layers", None):
        return _walk_segments(plan, ex, starts, ends, change_points, run_layers)
    changes = set(change_points)
    exits = getattr(ex, "exit_layers", None)
    prepare = getattr(ex, "prepare", None)
    if prepare is not None and not exits:
        prepare(compositions(plan, starts, ends, change_points))
    run_span = None if exits else getattr(ex, "run_span", None)
    active: list[Work] = []
    first, last = plan.first_layer, plan.last_layer
    stopped: int | None = None
    asked = False  # run_span already asked stop_at(j), and it said True
    j = first
    while j < last:
        if exits and j in exits and active:
            kept = ex.early_exit(active, j)
            if len(kept) != len(active):
                active = kept
                changes.add(j)  # composed anew below (nothing joins or leaves otherwise)
        changed = j in changes
        if changed:
            leaving = [w for w in ends.get(j, ()) if w in active]  # (a stop may have parked it)
            if leaving:
                active = ex.park(active, leaving, j)
        if stopped is None and j > first and stop_at is not None and (asked or stop_at(j)):
            stopped, changed, asked = j, True, False
            paused = [w for w in active if w.reached(j) == j]
            if paused:
                active = ex.park(active, paused, j)
            if not active and not plan.starts_after_stop(j):
                return j
        if changed:
            joining = starts.get(j, ())
            if stopped is not None:
                joining = [w for w in joining if w.reached(stopped) > j]
            if joining:
                active = ex.join(active, joining)
            if active:
                ex.compose(active, range(j, next((c for c in change_points if c > j), last)))
        if active and run_span is not None:
            end = next((c for c in change_points if c > j), last)
            k = run_span(j, end, active, stop_at if stopped is None else None)
            asked = k < end
            j = k
            continue
        if active:
            ex.run_layer(j, active)
        j += 1
    if exits and last in exits and active:
        active = ex.early_exit(active, last)
    if active:
        ex.finish(active, last)
    return last if stopped is None else stopped


def compositions(plan: StepPlan, starts, ends, change_points) -> list[tuple[int, list[Work], Sequence[Work], range]]:
    """The compositions of ``plan`` when nothing stops it and no token exits: one
    ``(j, leaving, joining, layers)`` per change point ``j`` below the last layer (rules 1 and 3:
    ``leaving`` park at ``j``, then ``joining`` join; the batch then runs ``layers``, up to the
    next change point). ``starts``/``ends``: :meth:`StepPlan.boundaries`; ``change_points``:
    their layers, sorted."""
    out = []
    active: list[Work] = []
    last = plan.last_layer
    for k, j in enumerate(change_points):
        if j >= last:
            break
        leaving = [w for w in ends.get(j, ()) if w in active]
        joining = starts.get(j, ())
        if leaving:
            active = [w for w in active if w not in leaving]
        active = active + list(joining)
        out.append((j, leaving, joining, range(j, change_points[k + 1])))
    return out


def _walk_segments(plan: StepPlan, ex: LayerExecutor, starts, ends, change_points, run_layers) -> int:
    """:func:`walk` without a stop: rules 1, 3 and 4 at the change points only (:func:`compositions`),
    each constant-composition segment run by one ``run_layers(range, active)`` call."""
    active: list[Work] = []
    for j, leaving, joining, seg in compositions(plan, starts, ends, change_points):
        if leaving:
            active = ex.park(active, leaving, j)
        if joining:
            active = ex.join(active, joining)
        if active:
            ex.compose(active, seg)
            run_layers(seg, active)
    if active:
        ex.finish(active, plan.last_layer)
    return plan.last_layer
