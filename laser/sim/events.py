"""A discrete-event queue: one virtual clock for many simulated instances.

Torch-free. Events are ``(time, seq, kind, data)``; ``seq`` keeps insertion order among
equal times, so a run is deterministic. Each handler takes ``(time, data)`` and returns
the events it causes as ``(time, kind, data)`` tuples (possibly none).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable, Iterable

Handler = Callable[[float, Any], Iterable[tuple[float, str, Any]] | None]


class EventQueue:
    """Min-heap of events by time; ``now`` is the time of the last popped event (s)."""

    def __init__(self):
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.processed = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, time: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), kind, data))

    def pop(self) -> tuple[float, str, Any]:
        t, _, kind, data = heapq.heappop(self._heap)
        self.now = max(self.now, t)
        self.processed += 1
        return t, kind, data

    def run(self, handlers: dict[str, Handler], until: float = float("inf"), max_events: int = 10**9) -> None:
        """Pop events in time order and dispatch them by kind until the queue is empty or
        the next event is past ``until``. Raises KeyError for an event kind without a
        handler, RuntimeError past ``max_events``."""
        for _ in range(max_events):
            if not self._heap or self._heap[0][0] > until:
                return
            t, kind, data = self.pop()
            for ev in handlers[kind](t, data) or ():
                self.push(*ev)
        raise RuntimeError(f"simulation did not finish within {max_events} events")
