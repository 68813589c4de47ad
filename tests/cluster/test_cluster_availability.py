"""A cluster that stays available (issue 28 items 5, 5b), on in-process instances (local handles:
the same workers as the Ray actors, calls run synchronously; a "restart" builds a fresh worker,
as Ray does for an actor with restarts left).

* an instance that dies or restarts while the cluster is idle is noticed and rejoins without a
  request (idle probing);
* a request that meets an outage waits, bounded, for the instance to return and is then served;
  when nothing may return it fails with a 503 and ``Retry-After`` -- never a 500 --, and a
  stream that cannot continue ends with an error event the ``openai`` client raises;
* losing the only decode instance: the prefill instance serves as mixed (greedy fp32: the same
  tokens as without the failure) and hands its requests back when a decode instance returns.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from laser.cluster.launch import start_cluster
from laser.cluster.state import ClusterError
from laser.core.config import SchedulerConfig
from laser.core.request import SamplingParams
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer
from simutil import random_prompts

SCHED = SchedulerConfig(max_num_batched_tokens=32)
SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def single(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", scheduler=SCHED)


def _reference(engine, prompts, sp=SP):
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, req_id=f"ref{i}")
    out = {}
    while engine.has_unfinished():
        out.update({o.req_id.removeprefix("ref"): o.token_ids for o in engine.step() if o.finished})
    return out


def _cluster(tiny_llama, restarts=0):
    cl = start_cluster("laser", 1, 1, model=str(tiny_llama), dtype="float32", scheduler=SCHED, use_ray=False,
                       max_restarts=restarts)
    cl.availability.health_probe_s = cl.recovery.rejoin_probe_s = 0.0
    return cl


def _run(cl, streams, done, until=lambda: False, steps=2000):
    for _ in range(steps):
        if until() or not cl.has_unfinished():
            return
        for o in cl.step(wait_s=0.0):
            streams.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.req_id] = (o.token_ids, o.finish_reason)
    raise AssertionError("did not finish: " + "; ".join(cl.describe_unfinished()))


def _poll_until(cl, cond, polls=50):
    for _ in range(polls):
        if cond():
            return
        cl.poll_idle()
    raise AssertionError(f"not reached after {polls} idle polls: alive {cl.alive()}, probes {cl.recovery.probed()}")


@pytest.mark.parametrize("how", ["killed", "restarted fast"])
def test_instance_lost_while_idle_rejoins_without_a_request(tiny_llama, single, how):
    """Idle 1P1D, the prefill instance dies and its host restarts it: seen at the next idle ping
    (a failed ping, or -- restarted before the ping -- a new boot id), it rejoins empty and the
    next request is served with its no-failure tokens."""
    prompts = random_prompts(1, 5)
    ref = _reference(single, prompts)
    cl = _cluster(tiny_llama, restarts=1)
    h = cl.handles[0]
    if how == "killed":
        h.kill(restart=True)  # the next call fails, the one after reaches the new process
    else:
        h.worker = h._restart()  # a new process answers the very next call
    _poll_until(cl, lambda: cl.stats.rejoins == 1 and h.alive)
    assert cl.stats.instance_failures == 1 and cl.can_serve()
    cl.add_request(prompts[0], SP, slo="chat", req_id="0")
    streams, done = {}, {}
    _run(cl, streams, done)
    assert done["0"] == (ref["0"], "length")
    cl.check_integrity(expect_empty=True)


def test_request_during_an_outage_waits_for_the_instance_then_is_served(tiny_llama, single):
    """The prefill instance is down (its host will restart it): a request arriving meanwhile is
    accepted and waits instead of failing; once the instance answers again it rejoins and the
    request completes with its no-failure tokens."""
    prompts = random_prompts(2, 8)
    ref = _reference(single, prompts)
    cl = _cluster(tiny_llama, restarts=1)
    h = cl.handles[0]
    h.kill()  # down: every call fails until the test brings it back
    cl.add_request(prompts[0], SP, slo="chat", req_id="0")  # before: ClusterError (HTTP 500)
    assert not h.alive and not cl.can_serve() and cl.has_unfinished()
    streams, done = {}, {}
    for _ in range(5):  # still down: it keeps waiting
        assert not cl.step(wait_s=0.0)
    assert not done and cl.has_unfinished()
    h._killed, h.worker = False, h._restart()
    cl.add_request(prompts[1], SP, slo="code", req_id="1")
    _run(cl, streams, done)
    assert cl.stats.rejoins == 1
    assert {k: v for k, (v, _) in done.items()} == ref
    assert all(streams[k] == v for k, (v, _) in done.items())
    cl.check_integrity(expect_empty=True)


def test_a_wait_that_runs_out_fails_with_an_error_not_an_abort(tiny_llama):
    """Nothing returns within ``outage_wait_s``: the waiting request is given up with a
    ClusterError its client gets (take_failed), not only a final ``abort``; with nothing that
    may return at all, a new request is refused at once with a ClusterError (HTTP 503)."""
    cl = _cluster(tiny_llama, restarts=1)
    cl.availability.outage_wait_s = 1e-3
    cl.handles[0].kill()
    cl.add_request([5, 6, 7], SP, req_id="w")
    streams, done = {}, {}
    _run(cl, streams, done)
    assert done == {"w": ([], "abort")}
    (rid, err), = cl.take_failed()
    assert rid == "w" and isinstance(err, ClusterError) and "came back" in str(err)
    cl2 = _cluster(tiny_llama)
    cl2.handles[0].kill()
    with pytest.raises(ClusterError):
        cl2.add_request([5, 6, 7], SP, req_id="x")
    assert not cl2.has_unfinished()


@pytest.mark.parametrize("tokens_before", [0, 3])
def test_decode_lost_prefill_serves_as_mixed(tiny_llama, single, tokens_before):
    """1P1D without restarts, the only decode instance dies (before any hand-off, or with its
    requests mid-decode): the prefill instance serves as mixed -- the interrupted requests are
    re-prefilled from prompt + tokens so far, or adopted from its own outbox -- and every one
    completes with its no-failure tokens (greedy fp32), none streamed twice; new requests are
    served too."""
    prompts = random_prompts(5, 11)
    ref = _reference(single, prompts)
    cl = _cluster(tiny_llama)
    for i, p in enumerate(prompts[:4]):
        cl.add_request(p, SP, slo=["chat", "code", None, "summarization"][i], req_id=str(i))
    streams, done = {}, {}
    _run(cl, streams, done, until=lambda: all(len(streams.get(str(i), ())) >= tokens_before for i in range(4)))
    cl.handles[1].kill()
    _run(cl, streams, done, until=lambda: not cl.handles[1].alive)
    assert cl.handles[0].role == "mixed" and cl.can_serve()  # before: stranded, every stream aborted
    cl.add_request(prompts[4], SP, slo="chat", req_id="4")
    _run(cl, streams, done)
    assert {k: v for k, (v, _) in done.items()} == ref
    assert all(streams[k] == v for k, (v, _) in done.items())
    assert not cl.take_failed()
    cl.check_integrity(expect_empty=True)


def test_decode_returns_and_the_prefill_instance_hands_its_requests_back(tiny_llama, single):
    """The decode instance is down for a while (its host restarts it): the prefill instance
    serves as mixed meanwhile; when the decode instance rejoins, the requests decoding on the
    prefill instance move to it with their KV (no re-prefill) and finish with their no-failure
    tokens; the prefill instance is a prefill instance again."""
    prompts = random_prompts(3, 13)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = _reference(single, prompts, sp)
    cl = _cluster(tiny_llama, restarts=1)
    for i, p in enumerate(prompts):
        cl.add_request(p, sp, slo="chat", req_id=str(i))
    streams, done = {}, {}
    _run(cl, streams, done, until=lambda: all(len(streams.get(str(i), ())) >= 2 for i in range(3)))
    d = cl.handles[1]
    d.kill()
    _run(cl, streams, done, until=lambda: cl.handles[0].role == "mixed"
         and all(len(streams.get(str(i), ())) >= 5 for i in range(3)))
    recoveries = cl.stats.recoveries
    d._killed, d.worker = False, d._restart()
    _run(cl, streams, done, until=lambda: d.alive and cl.handles[0].role == "prefill")
    _run(cl, streams, done)
    assert cl.stats.recoveries == recoveries and cl.stats.transfers >= 3  # moved with their KV
    assert {k: v for k, (v, _) in done.items()} == ref
    assert all(streams[k] == v for k, (v, _) in done.items())
    cl.add_request(prompts[0], sp, slo="chat", req_id="again")
    _run(cl, streams, done)
    assert done["again"][0] == ref["0"] and cl.stats.transfers >= 4  # the disaggregated path again
    cl.check_integrity(expect_empty=True)


# -- through the server -------------------------------------------------------------------------------
@pytest.fixture
def served(tiny_llama):
    cl = _cluster(tiny_llama, restarts=1)
    srv = LiveServer(build_app(AsyncEngine(cl, idle_wait_s=0.05), served_model_names=["tiny"]))
    yield srv, cl
    srv.stop()


def test_outage_answers_503_with_retry_after_and_streams_end_with_an_error(served):
    """The only prefill instance is gone and does not return in time: a non-streaming request
    gets a 503 JSON error with ``Retry-After`` (before: 500 ``internal server error:
    ClusterError``), a streaming one an SSE error event that the ``openai`` client raises; once
    it returns the server serves again and /health says ok."""
    srv, cl = served
    cl.availability.outage_wait_s = 0.2
    cl.handles[0].kill()
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "unavailable"
    assert httpx.get(srv.url + "/health").status_code == 503
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIError, match="cannot continue"):
        for _ in client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3, stream=True):
            pass
    h = cl.handles[0]
    h._killed, h.worker = False, h._restart()
    for _ in range(600):
        if httpx.get(srv.url + "/health").status_code == 200:
            break
        time.sleep(0.05)
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


class _Node:
    """Stands in for the Ray node of in-process instances (laser.cluster.node; the real one:
    tests/cluster/test_ray_node_restart.py): gone once every instance is killed; ``restart``
    builds fresh workers, as RayNode.restart relaunches the actors on a new Ray session."""

    def __init__(self, cl, owned: bool):
        self.cl, self.owned, self.asked = cl, owned, 0

    def lost(self):
        self.asked += 1
        return "its raylet process exited" if all(h._killed for h in self.cl.handles.values()) else None

    def restart(self):
        from laser.cluster.handles import LocalHandle

        return [LocalHandle(h._restart(), h.call_timeout_s, restart=h._restart) for h in self.cl.handles.values()]


@pytest.mark.parametrize("owned", [True, False])
def test_lost_node_is_started_again_or_reported(tiny_llama, single, owned):
    """Every instance dies with their node (a request in flight): a node this process started is
    started again -- a request meanwhile gets a ClusterError (503), the one in flight ends with
    one, and after the restart a request is served with its no-failure tokens; a node it joined
    is reported through ``on_node_lost`` (the server exits). The node is asked only when no
    instance is alive."""
    prompts = random_prompts(2, 8)
    ref = _reference(single, prompts)
    cl = _cluster(tiny_llama)
    node, lost = _Node(cl, owned), []
    cl.node_restart.node, cl.node_restart.on_node_lost = node, lost.append
    cl.add_request(prompts[0], SP, slo="chat", req_id="0")
    cl.handles[1].kill()
    streams, done = {}, {}
    _run(cl, streams, done, until=lambda: not cl.handles[1].alive)
    assert node.asked == 0  # the prefill instance serves as mixed
    cl.handles[0].kill()
    _run(cl, streams, done)
    assert done["0"][1] == "abort" and [rid for rid, _ in cl.take_failed()] == ["0"]
    with pytest.raises(ClusterError):
        cl.add_request(prompts[1], SP, slo="chat", req_id="1")
    if not owned:
        assert not cl.node_restart.restarting and len(lost) == 1 and "did not start it" in lost[0]
        return
    deadline = time.monotonic() + 60
    while cl.stats.node_restarts == 0:
        assert time.monotonic() < deadline and not lost
        time.sleep(cl.poll_idle())
    assert cl.can_serve() and all(h.alive for h in cl.handles.values())
    cl.add_request(prompts[1], SP, slo="chat", req_id="1")
    _run(cl, streams, done)
    assert done["1"] == (ref["1"], "length")
    cl.check_integrity(expect_empty=True)


def test_server_exits_for_its_supervisor_when_the_node_is_lost(capsys):
    """``laser serve`` over a cluster it cannot start again: the node loss (``on_node_lost``)
    prints why and stops the server with SIGTERM (it drains), and ``laser serve`` then exits with
    ``EXIT_NODE_LOST`` (non-zero) so that a supervisor restarts it."""
    import signal
    import types

    from laser.server.cli import EXIT_NODE_LOST, exit_when_node_lost

    got = []
    old = signal.signal(signal.SIGTERM, lambda *a: got.append(a[0]))
    try:
        engine = types.SimpleNamespace(node_restart=types.SimpleNamespace())
        lost = exit_when_node_lost(engine)
        engine.node_restart.on_node_lost("the Ray node of this cluster is gone (its raylet process exited)")
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert got == [signal.SIGTERM] and lost and EXIT_NODE_LOST != 0
    err = capsys.readouterr().err
    assert "raylet process exited" in err and f"exiting with status {EXIT_NODE_LOST}" in err
