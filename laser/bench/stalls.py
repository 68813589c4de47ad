"""Stalls of a served engine during a run, from its step log and its garbage-collection counters.

A served run can miss TTFT targets its simulated twin meets although the engine's mean speed
matches the twin's (issue 26 item 4): a few steps took far longer than their price. What ran
then is in ``GET /engine/steps`` (``laser serve --step-log N``): each step's wall time beside the
scheduler's price of it and when it ended, and the process's cyclic garbage collections by
generation (:class:`laser.server.heap.GcPauses`). :func:`stall_summary` condenses one run's worth.
"""

from __future__ import annotations

#: A step slower than this many times its price counts as stalled.
STALL_FACTOR = 2.0


def stall_summary(timed, gc_before: dict | None, gc_after: dict | None, factor: float = STALL_FACTOR) -> dict:
    """One run's stalls.

    Args:
        timed: the run's steps as (ended, seconds, predicted) (:meth:`laser.bench.serve_proc.
            Server.engine_steps`' ``"timed"``; seconds; ``predicted`` None: a step cut short or
            an unpriced plan, not judged against a price).
        gc_before, gc_after: the server's ``"gc"`` counters (:meth:`laser.server.heap.GcPauses.
            to_json`) before and after the run; None: not reported (no GC figures).
        factor: a step over ``factor`` x its price is a stall.

    Returns:
        ``{"steps": priced steps, "stalled": steps over factor x price, "excess_s": their seconds
        past the price, summed, "worst": (ended, seconds, predicted) of the step furthest past its
        price or None, "longest": (ended, seconds) of the longest step, priced or not, or None,
        "gc_counts": [g0, g1, g2] collections during the run, "gc_s": their
        seconds by generation, "gc_longest_s": the longest collection by generation since the
        server started}`` (GC fields None without counters).
    """
    priced = [(e, s, p) for e, s, p in timed if p is not None and p > 0]
    stalled = [(e, s, p) for e, s, p in priced if s > factor * p]
    worst = max(priced, key=lambda t: t[1] - t[2], default=None)
    longest = max(((e, s) for e, s, _ in timed), key=lambda t: t[1], default=None)
    out = {"steps": len(priced), "stalled": len(stalled), "excess_s": sum(s - p for _, s, p in stalled),
           "worst": worst, "longest": longest, "gc_counts": None, "gc_s": None, "gc_longest_s": None}
    if gc_before is not None and gc_after is not None:
        out["gc_counts"] = [a - b for a, b in zip(gc_after["counts"], gc_before["counts"])]
        out["gc_s"] = [a - b for a, b in zip(gc_after["seconds"], gc_before["seconds"])]
        out["gc_longest_s"] = list(gc_after["longest"])
    return out


def format_stalls(s: dict) -> str:
    """One line of :func:`stall_summary`'s figures (ms)."""
    line = (f"  serve stalls: {s['stalled']} of {s['steps']} steps over {STALL_FACTOR:g}x their price "
            f"(+{1e3 * s['excess_s']:.0f} ms past it)")
    if s["worst"] is not None:
        _, secs, pred = s["worst"]
        line += f", furthest {1e3 * secs:.1f} ms against {1e3 * pred:.1f} ms priced"
    if s["longest"] is not None:
        line += f", longest step {1e3 * s['longest'][1]:.1f} ms"
    if s["gc_counts"] is not None:
        c, t, lo = s["gc_counts"], s["gc_s"], s["gc_longest_s"]
        line += ("; garbage collections gen 0/1/2: " + " / ".join(str(n) for n in c)
                 + f" ({' / '.join(f'{1e3 * x:.1f}' for x in t)} ms; longest full collection since start "
                 f"{1e3 * lo[2]:.0f} ms)")
    return line
