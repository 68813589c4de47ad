"""The local Ray node itself dies (issue 28 item 5, second half): its raylet is killed, so every
instance actor dies with it. A server whose process started that Ray cluster starts it again
with its instances and serves; meanwhile a request gets 503 with ``Retry-After`` (never a 500).
One small local Ray session (1P1D, two CPUs), shut down after.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from laser.cluster.launch import start_cluster  # noqa: E402
from laser.core.config import SchedulerConfig  # noqa: E402
from laser.frontend.async_engine import AsyncEngine  # noqa: E402
from laser.server.app import build_app  # noqa: E402
from laser.server.cli import LiveServer  # noqa: E402

BODY = {"model": "tiny", "prompt": [5, 17, 29, 41, 53, 65, 77, 89], "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True}


def _kill_raylet() -> int:
    """SIGKILL this process's local raylet (Ray fate-shares the node's workers with it)."""
    from ray._private import ray_constants, worker

    proc = worker.global_worker.node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    os.kill(proc.pid, signal.SIGKILL)
    return proc.pid


@pytest.fixture
def server(tiny_llama):
    if ray.is_initialized():  # (another module's session): this test starts its own
        ray.shutdown()
    cl = start_cluster("laser", prefill=1, decode=1, model=str(tiny_llama), dtype="float32",
                       scheduler=SchedulerConfig(max_num_batched_tokens=64), call_timeout_s=10.0)
    cl.availability.health_probe_s = 0.2
    srv = LiveServer(build_app(AsyncEngine(cl), served_model_names=["tiny"]))
    yield srv, cl
    srv.stop()
    ray.shutdown()


def test_killed_local_ray_node_is_started_again_and_serves(server):
    srv, cl = server
    assert cl.node_restart.node is not None and cl.node_restart.node.owned
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        before = c.post("/v1/completions", json=BODY)
        assert before.status_code == 200, before.text
        first_actor_ids = {h.actor._actor_id for h in cl.handles.values()}
        _kill_raylet()
        deadline = time.monotonic() + 300  # (a hang guard: Ray notices in seconds)
        while not cl.node_restart.restarting:  # the idle pings find every instance dead, then the node gone
            assert time.monotonic() < deadline, f"node loss not noticed: alive {cl.alive()}"
            time.sleep(0.05)
        during = c.post("/v1/completions", json=BODY)  # the node starts again in the background
        assert during.status_code == 503, during.text
        assert int(during.headers["retry-after"]) >= 1
        assert c.get("/health").status_code == 503
        while cl.node_restart.restarting or not cl.can_serve():
            assert time.monotonic() < deadline, "the node was not started again"
            time.sleep(0.05)
        after = c.post("/v1/completions", json=BODY)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]  # greedy fp32
        assert c.get("/health").status_code == 200
    assert cl.stats.node_restarts == 1
    assert not first_actor_ids & {h.actor._actor_id for h in cl.handles.values()}  # new actors
