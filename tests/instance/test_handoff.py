"""The hand-off's instance-side state (:mod:`laser.instance.handoff`): the prefill side's outbox,
the decode side's adopt-in-order queue and its fences -- one module used by the in-process pair,
both simulators and the cluster instance."""

from __future__ import annotations

import math

import pytest

from laser.core.config import SchedulerConfig
from laser.core.request import Phase, Request, SamplingParams
from laser.instance.core import Handoff
from laser.instance.handoff import AdoptQueue, DirectRoute, Outbox, StaleHandoff
from laser.latency import SimpleLatencyModel
from laser.sim import SimInstance

LM = SimpleLatencyModel(num_layers=4, per_layer=2e-4, per_token=2e-6, per_context=1e-8)


def _handoff(rid: str, tokens: int, at: float = 0.0) -> Handoff:
    r = Request([1] * tokens, SamplingParams(max_tokens=4, ignore_eos=True), req_id=rid, arrival_time=at)
    r.num_computed_tokens = tokens
    r.output_token_ids, r.token_times, r.phase = [0], [at], Phase.DECODE
    return Handoff(r, None, at)


def _decode(num_blocks: int) -> SimInstance:
    return SimInstance("laser", 4, LM, SchedulerConfig(role="decode"), num_blocks=num_blocks, block_size=16)


def test_adopts_in_delivery_order_and_a_hand_off_that_does_not_fit_blocks_the_ones_behind():
    d, q = _decode(num_blocks=4), AdoptQueue()
    for rid, n in (("a", 16), ("big", 50), ("small", 1)):  # blocks: 1, 4, 1 of 4
        q.deliver(_handoff(rid, n))
    assert [r.req_id for r in q.adopt_ready(d.adopt)] == ["a"]  # "small" fits but must not overtake "big"
    assert q.num_waiting() == 2 and [r.req_id for r in q.requests()] == ["big", "small"]
    d.abort("a")
    assert [r.req_id for r in q.adopt_ready(d.adopt)] == ["big"]  # 4 blocks free now; "small" still waits
    assert q.num_waiting() == 1


def test_hand_offs_due_later_wait_until_their_time_then_queue_in_time_order():
    d, q = _decode(num_blocks=64), AdoptQueue()
    q.deliver(_handoff("late", 16), at=2.0)
    q.deliver(_handoff("early", 16), at=1.0)
    assert q.adopt_ready(d.adopt, now=0.5) == [] and q.next_due() == 1.0 and q.next_due(after=1.0) == 2.0
    assert q.earliest() == 1.0 and q.num_waiting() == 0
    assert [r.req_id for r in q.adopt_ready(d.adopt, now=3.0)] == ["early", "late"]
    assert not q and q.next_due() == math.inf


def test_a_hand_off_not_ready_stops_the_queue_until_it_is():
    q, ready = AdoptQueue(), set()
    for rid in ("s", "t"):
        q.deliver(_handoff(rid, 8))
    adopt = lambda h: h.request if h.request.req_id in ready else None  # noqa: E731 - layers on their way
    assert q.adopt_ready(adopt) == []
    ready.add("t")
    assert q.adopt_ready(adopt) == []  # "t" is ready but "s" is first
    ready.add("s")
    assert [r.req_id for r in q.adopt_ready(adopt)] == ["s", "t"]


def test_fences_refuse_a_stale_attempt_and_an_older_epoch():
    q = AdoptQueue()
    q.deliver(_handoff("r", 8))
    assert q.drop("r", fence=1) and not q  # re-prefilled as attempt 1
    with pytest.raises(StaleHandoff, match="attempt 0 < 1"):
        q.deliver(_handoff("r", 8), attempt=0)
    q.deliver(_handoff("r", 8), attempt=1)
    q.reset(epoch=3)
    assert not q and q.fences.epoch == 3 and q.fences.stale_epoch(2) and not q.fences.stale_epoch(None)
    with pytest.raises(KeyError, match="instance fenced"):  # (StaleHandoff is a KeyError)
        q.deliver(_handoff("r", 8), epoch=2)
    q.deliver(_handoff("r", 8), attempt=0, epoch=3)  # the reset forgot the attempt fence
    assert len(q) == 1


def test_outbox_keeps_a_hand_off_until_confirmed_and_leaves_out_kv_streamed_to_the_taker():
    box = Outbox()
    h = Handoff(_handoff("r", 8).request, [("k", "v")], 0.0)
    box.route("r", DirectRoute(2, peer=None, reply=None, attempt=0, epoch=0, stream_key=(0, 1)))
    route, sent = box.direct(h)  # kept, and what goes to the decode instance chosen at routing
    assert route.dst == 2 and sent.kv is None  # the layers went there already
    assert box.take("r", 2).kv is None and box.take("r", 3).kv == [("k", "v")] and box.take("r").kv
    assert "r" in box  # taking keeps it: a decode instance that dies mid-transfer costs a re-send
    box.confirm("r")
    assert "r" not in box and not box.streamed_to and not box.routes
    with pytest.raises(KeyError):
        box.take("r")
    box.route("r", DirectRoute(2, None, None))  # not streamed: the whole KV goes with the hand-off
    assert box.direct(h)[1].kv == [("k", "v")]
    assert box.drop("r") and not box and not box.routes and not box.drop("r")
    assert box.direct(h) is None  # no route (e.g. a migration): the front end pulls it
