"""Online serving of a timed request stream on an in-process engine (trace replay).

Requests are released at their arrival times (relative to the start) *while steps run*:
the engine's arrival hook is polled at every layer boundary, so a layer-level policy can
react to an arrival mid-iteration exactly as it would in a server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..core.request import SLO, SamplingParams


@dataclass
class TimedRequest:
    """One request of a stream: released ``arrival`` seconds after the start."""

    arrival: float
    prompt: Any  # str, token ids or chat messages
    sampling_params: SamplingParams
    slo: SLO | str | None = None
    req_id: str | None = None


def run_online(engine, stream: list[TimedRequest], clock: Callable[[], float] = time.monotonic,
               on_output: Callable | None = None, timeout_s: float | None = None) -> list:
    """Serve ``stream`` in real time on ``engine`` (an Engine or DisaggregatedPair).

    Returns the finished :class:`~laser.core.request.Request` objects in stream order. A
    request's ``arrival_time`` is its scheduled release time, so queueing delay inside the
    engine counts toward its TTFT. Requests still unfinished after ``timeout_s`` are aborted.
    Raises InvalidRequestError for a malformed request when it is released; the requests
    released before it are aborted first, so nothing of the stream stays in the engine.
    """
    items = sorted(stream, key=lambda r: r.arrival)
    reqs: list = [None] * len(items)
    order = sorted(range(len(stream)), key=lambda i: stream[i].arrival)
    pos = 0
    t0 = clock()

    def release():
        nonlocal pos
        now = clock()
        while pos < len(items) and t0 + items[pos].arrival <= now:
            it = items[pos]
            reqs[pos] = engine.add_request(it.prompt, it.sampling_params, it.slo, req_id=it.req_id,
                                           arrival_time=t0 + it.arrival)
            pos += 1

    def abort_released():
        for r in reqs:
            if r is not None and not r.is_finished:
                engine.abort(r.req_id)

    hooks = [e for e in (getattr(engine, "prefill", None), getattr(engine, "decode", None)) if e is not None] or [engine]
    for e in hooks:
        e.arrival_hook = release
    try:
        while pos < len(items) or engine.has_unfinished():
            release()
            if not engine.has_unfinished():
                if pos < len(items):
                    time.sleep(max(0.0, t0 + items[pos].arrival - clock()))
                continue
            outs = engine.step()
            if on_output is not None:
                for o in outs:
                    on_output(o)
            if timeout_s is not None and clock() - t0 > timeout_s:
                abort_released()
                break
    except BaseException:
        abort_released()
        raise
    finally:
        for e in hooks:
            e.arrival_hook = None
    resolve = getattr(engine, "resolve", lambda r: r)
    by_pos = {i: resolve(reqs[k]) for k, i in enumerate(order)}
    return [by_pos[i] for i in range(len(stream))]
