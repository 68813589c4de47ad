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
likewise waits up to 5 ms whenever the event loop holds it.

Measured on the issue's CPU kind (AMD EPYC, AVX512-BF16, 2 vCPUs; SmolLM2 bf16, 1 thread; a
40-prompt served run at 0.8x of the knee, probe timestamps in the server): the engine's step end
-> the event loop has the first token 2.2 ms (mean 2.3) at 5 ms, 1.3 ms (mean 1.6) at 0.5 ms; the
client's TTFT minus the server's 11 ms -> 8 ms. vLLM's API server and engine live in separate
processes (no shared GIL); this is the single-process server's equivalent.

``$LASER_SWITCH_INTERVAL_MS``: the interval in milliseconds (default :data:`DEFAULT_MS`;
``5`` restores CPython's default, for A/B runs).
"""

from __future__ import annotations

import math
import os
import sys

#: ``laser serve``'s switch interval, milliseconds (CPython's default is 5).
DEFAULT_MS = 0.5


def switch_interval_s() -> float:
    """``$LASER_SWITCH_INTERVAL_MS`` in seconds (default :data:`DEFAULT_MS` ms).

    Raises:
        ValueError: not a finite number of milliseconds > 0.
    """
    raw = os.environ.get("LASER_SWITCH_INTERVAL_MS", str(DEFAULT_MS))
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise ValueError(f"LASER_SWITCH_INTERVAL_MS={raw!r}: want milliseconds > 0 (CPython's default is 5)")
    return ms / 1e3


def set_switch_interval() -> float:
    """Set the process's GIL switch interval to :func:`switch_interval_s`; returns the previous
    one (seconds). Raises ValueError for a bad ``$LASER_SWITCH_INTERVAL_MS``."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s())
    return old
