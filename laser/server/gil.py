"""The server process's GIL switch interval: how soon the event loop gets the interpreter back.

``laser serve`` runs two busy Python threads in one interpreter: the engine thread (the scheduler,
the runner's Python between torch calls) and the event loop (HTTP parse, admission, handing each
step's outputs to their streams, SSE writes). CPython's GIL (``Python/ceval_gil.c``) gives a
thread that wants the lock to another thread only when the holder releases it on its own (a torch
op, a blocking call) *and* the waiter wakes before the holder takes it back, or when the waiter
has waited one *switch interval* (``sys.setswitchinterval``; 5 ms by default) and asks the holder
to drop it. The engine thread releases the lock for microseconds at a time (one torch op), shorter
than a waiter takes to wake on a busy 2-vCPU host, so under load the event loop mostly gets the
lock by asking: up to 5 ms for each of the several hops a request makes (the request read, the
tokenizer thread and back, the hop of each step's outputs, the SSE write), and the engine thread
likewise waits up to 5 ms whenever the event loop holds it. (Inductor's C++ kernels, and Laser's
own C++ attention kernels loaded the same way, run with the GIL held -- torch's
``CppPythonBindingsCodeCache`` binding does not release it -- so a waiter also waits for the kernel
to return, whatever the interval.)

Measured on the issue's CPU kind (AMD EPYC, AVX512-BF16, 2 vCPUs; SmolLM2 bf16, 1 thread; 40-prompt
served runs at 0.8x of the knee, 0.5 ms and 5 ms interleaved, four each): 0.5 ms shortens the
hop of a first token from the engine thread to the event loop (median 1.0-1.5 -> 0.75-1.0 ms) but
slows the engine's steps (mean step 41 -> 46 ms, the engine thread's GIL / core wait 0.9 -> 1.5 ms a
step) and served attainment fell with it; so ``laser serve`` leaves CPython's interval unless told.

``$LASER_SWITCH_INTERVAL_MS``: the interval in milliseconds; unset: the interpreter's own (5 ms).
"""

from __future__ import annotations

import math
import os
import sys


def switch_interval_s() -> float | None:
    """``$LASER_SWITCH_INTERVAL_MS`` in seconds; None when unset or empty (keep the interpreter's).

    Raises:
        ValueError: not a finite number of milliseconds > 0.
    """
    raw = os.environ.get("LASER_SWITCH_INTERVAL_MS", "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"LASER_SWITCH_INTERVAL_MS={raw!r}: want milliseconds > 0 (CPython's default is 5)")
    return ms / 1e3


def set_switch_interval() -> float:
    """Set the process's GIL switch interval to :func:`switch_interval_s` when one is given; returns
    the previous one (seconds). Raises ValueError for a bad ``$LASER_SWITCH_INTERVAL_MS``."""
    old, new = sys.getswitchinterval(), switch_interval_s()
    if new is not None:
        sys.setswitchinterval(new)
    return old
