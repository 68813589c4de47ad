"""The walker's span mode (an executor with ``run_span``: the torch runner's) makes the very calls,
in the same order, that the layer-by-layer walk makes: parks, joins, compositions, layer calls and
``stop_at`` questions, on random plans with a stop at a random boundary (or none)."""

from __future__ import annotations

import random

import pytest

from laser.core.walk import walk
from simutil import random_plan

N = 12


class Recorder:
    """An executor that records every walker call (layer by layer: no ``run_span``)."""

    def __init__(self, stop: int | None):
        self.log: list[tuple] = []
        self.stop = stop
        self.spans = 0

    def stop_at(self, j: int) -> bool:
        self.log.append(("ask", j))
        return j == self.stop

    def park(self, active, leaving, layer):
        self.log.append(("park", layer, tuple(w.req_id for w in leaving)))
        gone = {id(w) for w in leaving}
        return [w for w in active if id(w) not in gone]

    def join(self, active, joining):
        self.log.append(("join", tuple(w.req_id for w in joining)))
        return list(active) + list(joining)

    def compose(self, active, layers):
        self.log.append(("compose", tuple(w.req_id for w in active), layers))

    def run_layer(self, layer, active):
        self.log.append(("layer", layer, tuple(w.req_id for w in active)))

    def finish(self, active, layer):
        self.log.append(("finish", layer, tuple(w.req_id for w in active)))


class SpanRecorder(Recorder):
    """The same executor with ``run_span`` (the walker's span mode)."""

    def run_span(self, start, end, active, stop_at):
        self.spans += 1
        k = start
        while True:
            self.run_layer(k, active)
            k += 1
            if k == end or (stop_at is not None and stop_at(k)):
                return k


@pytest.mark.parametrize("seed", range(300))
def test_span_mode_makes_the_layer_by_layer_calls(seed):
    rng = random.Random(seed)
    plan = random_plan(rng, N)
    stop = rng.choice([None, rng.randint(1, N - 1), rng.randint(1, N - 1)])
    ref, span = Recorder(stop), SpanRecorder(stop)
    asks = rng.random() < 0.8  # else no stop_at at all
    got_ref = walk(plan, ref, ref.stop_at if asks else None)
    got = walk(plan, span, span.stop_at if asks else None)
    assert got == got_ref
    assert span.log == ref.log
    assert span.spans > 0
