"""The server process's Python heap: its cyclic garbage collections timed, and the startup heap frozen.

A served engine shares one interpreter with the event loop, and CPython's cyclic collector runs on
whichever thread crosses an allocation threshold, holding the GIL: while it runs, the engine
thread's step and the event loop both stop. A young-generation collection looks at the objects
allocated since the last one (tens of microseconds), but a full (generation-2) collection walks
every container object the process holds. After ``laser serve`` has built its engine, the heap
is ~580k objects (torch, the model, the tokenizer, FastAPI/pydantic): one full collection took
340-380 ms on the issue's CPU kind (AMD EPYC, 1 thread), and a served run allocates enough
(request objects, token lists, SSE chunks) to trigger several -- each a stall of a whole step or
more for every request in flight (issue 26 item 4: served code requests at 189-758 ms TTFT
against 110-160 ms simulated).

:func:`freeze_heap` moves everything alive after startup into the collector's permanent
generation (``gc.freeze``, Python 3.7+), which later collections skip: a full collection then
walks only what the server allocated since. vLLM does the same after its engine starts
(``gc.freeze()`` in its engine core and API server); SGLang too. The frozen objects are never
collected (they are the engine, the model and the libraries, alive for the process's life).
``$LASER_GC_FREEZE`` = ``1`` (the default) or ``0`` (leave the heap as it is; for A/B runs).

:class:`GcPauses` times every collection through ``gc.callbacks``: count, seconds and the
longest, by generation (``/metrics``: ``laser:gc_collections``, ``laser:gc_pause_seconds``;
``GET /engine/steps``: ``"gc"``).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Callable

#: The collector's generations (0 youngest; 2 the full collection).
GENERATIONS = (0, 1, 2)


def gc_freeze_enabled() -> bool:
    """``$LASER_GC_FREEZE``: ``1`` (the default) or ``0``. Raises ValueError on another value."""
    mode = os.environ.get("LASER_GC_FREEZE", "1")
    if mode not in ("0", "1"):
        raise ValueError(f"LASER_GC_FREEZE={mode!r}: use 0 or 1")
    return mode == "1"


def freeze_heap() -> int:
    """Collect what is garbage now, then move every object still alive into the permanent
    generation (``gc.freeze``), which the cyclic collector no longer walks. Call once startup is
    done (engine built and warmed up, app built). Returns the number of frozen objects
    (``gc.get_freeze_count()``). Idempotent: a second call freezes what was allocated since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Time this process's cyclic garbage collections, by generation (``gc.callbacks``).

    ``counts[g]``: collections of generation ``g`` (a generation-``g`` collection also walks the
    younger ones); ``seconds[g]``: their wall time summed; ``longest[g]``: the longest one (s).
    The callbacks run on the thread that triggered the collection, under the GIL, so the fields
    are written by one thread at a time; read anywhere. ``clock``: the timer (seconds;
    ``time.perf_counter`` by default).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        """The ``gc.callbacks`` hook: ``phase`` "start" or "stop"; ``info["generation"]`` 0-2."""
        if phase == "start":
            self._start = self.clock()
            return
        if self._start is None:  # installed during a collection: its start was not seen
            return
        dt, self._start = self.clock() - self._start, None
        g = info.get("generation", 2)
        self.counts[g] += 1
        self.seconds[g] += dt
        self.longest[g] = max(self.longest[g], dt)

    def install(self) -> "GcPauses":
        """Start timing (once: a second call does nothing). Returns self."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        """Stop timing (the counts stay)."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def to_json(self) -> dict:
        """``{"counts": [g0, g1, g2], "seconds": [...], "longest": [...], "frozen": objects in the
        permanent generation}`` (seconds)."""
        return {"counts": list(self.counts), "seconds": list(self.seconds), "longest": list(self.longest),
                "frozen": gc.get_freeze_count()}


#: The process's timer: installed by :func:`laser.server.app.build_app`, read by ``/metrics``.
GC_PAUSES = GcPauses()
