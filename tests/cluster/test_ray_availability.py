"""A 1P1D cluster of real Ray actors that stays available (issue 28 items 5, 5b): a prefill actor
killed while the cluster is idle is restarted by Ray and rejoins without a request; the decode
actor killed mid-stream (no restarts) leaves the prefill actor serving as mixed, with the
same greedy fp32 tokens as a run without the failure. One small local Ray session (shut down after).
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

from laser.cluster import ray_actors  # noqa: E402
from laser.cluster.engine import ClusterEngine  # noqa: E402
from laser.controller import get_controller  # noqa: E402
from laser.core.config import SchedulerConfig  # noqa: E402
from laser.core.request import SamplingParams  # noqa: E402
from laser.core.slo import SLOClasses  # noqa: E402
from laser.frontend.engine import Engine  # noqa: E402
from laser.model.loader import load_config, load_tokenizer  # noqa: E402

SCHED = SchedulerConfig(max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def actors(tiny_llama):
    """Prefill 0 (Ray restarts it once), decode 1 (no restarts)."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False)
    kw = dict(model=str(tiny_llama), policy="laser", dtype="float32", scheduler=SCHED, seed=0)
    handles = ray_actors.start_instances([(0, "prefill")], kw, threads=1, call_timeout_s=30.0, max_restarts=1)
    handles += ray_actors.start_instances([(1, "decode")], kw, threads=1, call_timeout_s=30.0)
    yield handles
    ray.shutdown()


def _front(tiny_llama, handles):
    cl = ClusterEngine(handles, get_controller("laser")(), load_tokenizer(str(tiny_llama)), load_config(str(tiny_llama)),
                       "tiny", SLOClasses.load())
    cl.availability.health_probe_s = cl.recovery.rejoin_probe_s = 0.2
    return cl


def _reference(tiny_llama, prompts):
    engine = Engine(model=str(tiny_llama), dtype="float32", scheduler=SCHED)
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, req_id=str(i))
    out = {}
    while engine.has_unfinished():
        out.update({o.req_id: o.token_ids for o in engine.step() if o.finished})
    return out


def _collect(outs, streams, done):
    for o in outs:
        streams.setdefault(o.req_id, []).extend(o.new_token_ids)
        if o.finished:
            done[o.req_id] = o.token_ids


PROMPTS = [[(7 * i + 3 * j) % 400 + 5 for j in range(9 * (i + 1))] for i in range(4)]


def test_idle_prefill_actor_killed_is_restarted_and_rejoins(tiny_llama, actors):
    """Idle, the prefill actor is killed and Ray restarts it: the idle probe notices (a failed
    ping or a new boot id) and it rejoins without any request; then a request is served."""
    ref = _reference(tiny_llama, PROMPTS[:1])
    cl = _front(tiny_llama, actors)
    cl.handles[0].kill(restart=True)
    deadline = time.monotonic() + 120
    while not (cl.stats.rejoins == 1 and cl.can_serve()):
        assert time.monotonic() < deadline, f"no rejoin: alive {cl.alive()}"
        time.sleep(cl.poll_idle())
    assert cl.stats.instance_failures == 1
    cl.add_request(PROMPTS[0], GREEDY, slo="chat", req_id="0")
    streams, done = {}, {}
    _collect(cl.drain(60), streams, done)
    assert done == ref
    cl.check_integrity(expect_empty=True)


def test_decode_actor_killed_mid_stream_prefill_serves_as_mixed(tiny_llama, actors):
    """The only decode actor dies (no restarts) while four streams decode there: the prefill
    actor serves as mixed, each stream continues with the tokens of a no-failure run (none
    twice), and a new request is served too."""
    ref = _reference(tiny_llama, PROMPTS + PROMPTS[:1])
    cl = _front(tiny_llama, actors)
    for i, p in enumerate(PROMPTS):
        cl.add_request(p, GREEDY, slo="chat", req_id=str(i))
    streams, done = {}, {}
    deadline = time.monotonic() + 60
    while not all(cl.requests[r].owner == 1 and len(streams.get(r, ())) >= 3 for r in cl.requests):
        _collect(cl.step(), streams, done)
        assert time.monotonic() < deadline
    cl.handles[1].kill()
    _collect(cl.drain(120), streams, done)
    assert cl.handles[0].role == "mixed" and not cl.handles[1].alive
    cl.add_request(PROMPTS[0], GREEDY, slo="chat", req_id="4")
    _collect(cl.drain(60), streams, done)
    assert done == ref
    assert all(streams[k] == v for k, v in done.items())
    assert not cl.take_failed()
    cl.check_integrity(expect_empty=True)
