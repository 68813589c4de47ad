"""Per-layer KV streaming (issue 13) on an in-process 1P1D cluster: the same instance workers as
the Ray actors, driven through local handles, so it runs without Ray.

Greedy fp32 output must not depend on whether the KV was streamed layer by layer during the
final prefill chunk or sent at the hand-off.
"""

from __future__ import annotations

import pytest
import torch

from laser.cluster.launch import start_cluster
from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.engine import Engine
from laser.instance.kv_stream import InboundKV
from laser.model.kv_cache import KVCache
from laser.model.loader import load_config
from laser.core.request import SamplingParams

SCHED = SchedulerConfig(max_num_batched_tokens=32)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _run(cl, prompts):
    for i, p in enumerate(prompts):
        cl.add_request(p, GREEDY, slo=("chat", "code", None)[i % 3], req_id=str(i))
    # done at its first token, on the prefill instance: what was streamed for it is dropped
    cl.add_request(prompts[0], SamplingParams(max_tokens=1, temperature=0.0), slo="chat", req_id="one")
    done = {o.req_id: o.token_ids for o in cl.drain(120) if o.finished}
    assert len(done.pop("one")) == 1
    return done


def test_streamed_and_sent_kv_give_single_engine_output(tiny_llama):
    prompts = [[(5 + 3 * i + j) % 500 + 3 for j in range(9 * (i + 1))] for i in range(4)]
    single = Engine(model=str(tiny_llama), dtype="float32", scheduler=SCHED)
    for i, p in enumerate(prompts):
        single.add_request(p, GREEDY, req_id=str(i))
    ref = {}
    while single.has_unfinished():
        ref.update({o.req_id: o.token_ids for o in single.step() if o.finished})
    kw = dict(model=str(tiny_llama), dtype="float32", scheduler=SCHED, use_ray=False)
    for stream in (True, False):
        cl = start_cluster("laser", 1, 1, stream_kv=stream, **kw)
        assert _run(cl, prompts) == ref
        assert cl.stats.transfers == 4 and cl.stats.streamed_transfers == (4 if stream else 0)
        assert len(cl.stats.handoff_seconds) == 4
        cl.check_integrity(expect_empty=True)
        if stream:
            _check_gauges(cl)


def _check_gauges(cl):
    """/metrics' cluster collector: per-instance gauges from the instances' last reports."""
    from types import SimpleNamespace

    from laser.server.metrics import _ClusterCollector

    fams = {f.name: f for f in _ClusterCollector(SimpleNamespace(async_engine=SimpleNamespace(engine=cl),
                                                                 model_name="tiny")).collect()}
    roles = {s.labels["instance"]: s.labels["role"] for s in fams["laser:instance_queue_length"].samples}
    assert roles == {"0": "prefill", "1": "decode"}
    assert all(s.value == 0 for s in fams["laser:instance_kv_cache_usage_perc"].samples)  # idle: all freed
    assert [s.value for s in fams["laser:kv_transfers_streamed"].samples] == [4]
    assert "laser:instance_t_g_seconds" in fams and "laser:instance_iteration_seconds" in fams


def test_stale_stream_pieces_are_dropped(tiny_llama):
    """Pieces of an abandoned attempt (old key) never reach the KV pool; a re-sent layer is
    overwritten in place; a dropped stream frees the blocks written for it."""
    cfg = load_config(str(tiny_llama))
    kv = KVCache(cfg, CacheConfig(num_blocks=8, block_size=4), torch.float32)
    inb = InboundKV(kv, cfg.num_layers)
    shape = (6, cfg.num_kv_heads, cfg.head_dim)
    piece = [(torch.randn(shape), torch.randn(shape)) for _ in range(cfg.num_layers)]
    inb.expect("r", (1, 0))
    inb.receive("r", (0, 0), 0, *piece[0])  # the lost attempt's layer: dropped
    inb.drain()
    assert kv.block_manager.num_free(0) == 8 and not inb.complete("r")
    for layer in reversed(range(cfg.num_layers)):  # any order
        inb.receive("r", (1, 0), layer, *piece[layer])
    inb.receive("r", (1, 0), 1, piece[1][0] * 2, piece[1][1])  # re-sent: overwrites, no new blocks
    inb.drain()
    assert inb.complete("r") and inb.kv_for_adopt("r") == [None] * cfg.num_layers
    assert torch.equal(kv.export_layer("r", 1, 6)[0], piece[1][0] * 2)
    assert torch.equal(kv.export_layer("r", 0, 6)[1], piece[0][1])
    assert kv.block_manager.num_free(1) == 8 - 2
    assert inb.drop("r") and not inb.pending()
    kv.block_manager.check_integrity(expect_empty=True)


def test_the_prefill_instance_hands_off_to_the_decode_instance_chosen_at_routing(tiny_llama, monkeypatch):
    """Issue 27 item 2: the decode instance is chosen once, at routing, and the prefill instance
    hands the request (and the KV it did not stream) to it by itself. The front end waits on no call
    of the hand-off (``take_handoff``, ``adopt``, ``confirm``: before, three front-end rounds per
    hand-off) and asks no second choice (``at_handoff``); it learns the adoption from the decode
    instance's step answers (and then confirms as well, fire and forget: the decode instance's own
    confirm dies with it)."""
    from laser.cluster.handles import LocalHandle, LocalKVSink

    peer_calls, front_calls = [], []  # (method, instance id): instance to instance, front end to instance
    call, peer_call = LocalHandle.call, LocalKVSink._call

    def recording_call(self, method, *args, timeout=None):
        front_calls.append((method, self.instance_id))
        return call(self, method, *args, timeout=timeout)

    def peer(self, method, *args):
        peer_calls.append((method, self.handle.instance_id))
        return peer_call(self, method, *args)

    monkeypatch.setattr(LocalHandle, "call", recording_call)
    monkeypatch.setattr(LocalKVSink, "_call", peer)
    prompts = [[(7 + 5 * i + j) % 400 + 3 for j in range(6 + 11 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for stream in (True, False):
        cl = start_cluster("laser", 1, 1, stream_kv=stream, model=str(tiny_llama), dtype="float32", scheduler=SCHED,
                           use_ray=False)
        monkeypatch.setattr(cl.controller, "at_handoff", lambda *a: pytest.fail("decode instance chosen twice"))
        peer_calls.clear(), front_calls.clear()
        for i, p in enumerate(prompts):
            cl.add_request(p, sp, slo="chat", req_id=str(i))
        done = {o.req_id: o.token_ids for o in cl.drain(120) if o.finished}
        assert sorted(done) == ["0", "1", "2"] and all(len(v) == 4 for v in done.values())
        assert cl.stats.transfers == 3 and cl.stats.streamed_transfers == (3 if stream else 0)
        assert not {m for m, _ in front_calls} & {"take_handoff", "adopt"}
        assert peer_calls.count(("adopt", 1)) == 3 and peer_calls.count(("confirm", 0)) == 3
        # the front end's own confirm, fire and forget, once it reads each adoption (the decode
        # instance's may die with it)
        assert front_calls.count(("confirm", 0)) == 3
        cl.check_integrity(expect_empty=True)


def test_a_stale_confirm_of_a_direct_hand_off_is_ignored():
    """A direct hand-off's confirm names its attempt: one that reaches the prefill instance after
    the request was routed there again (a re-prefill, a later attempt) keeps the new attempt's
    route and copy; a confirm of the current attempt or the front end's own (no attempt) drops them."""
    from laser.instance.handoff import DirectRoute, Outbox

    class H:  # a hand-off's shape as the outbox reads it
        def __init__(self, rid):
            self.request = type("R", (), {"req_id": rid})()
            self.kv = []

    box = Outbox()
    box.route("r", DirectRoute(dst=3, peer=None, reply=None, attempt=2))
    box.put(H("r"))
    box.confirm("r", 1)  # a stale attempt's
    assert "r" in box and "r" in box.routes
    box.confirm("r", 2)
    assert "r" not in box and not box.routes
    box.put(H("s"))  # pulled by the front end: no route here
    box.confirm("s", 0)  # a direct hand-off's confirm cannot name it
    assert "s" in box
    box.confirm("s")
    assert "s" not in box
