"""The engine of ``laser serve`` is built and stepped on one thread (OwnerThread): a second thread's
OpenMP team made 2-thread steps ~4x slower (laser.core.owner_thread.OwnerThread)."""

from __future__ import annotations

import threading

import httpx
import pytest

from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.core.owner_thread import OwnerThread
from laser.server.app import build_app
from laser.server.cli import LiveServer


def test_the_thread_that_built_the_engine_steps_it(tiny_llama):
    threads = {}

    def build():
        threads["build"] = threading.get_ident()
        engine = Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=64),
                        max_model_len=128)
        step = engine.step

        def recorded_step():
            threads.setdefault("steps", set()).add(threading.get_ident())
            return step()

        engine.step = recorded_step
        return engine

    owner = OwnerThread(build)
    engine = owner.engine()
    assert threads["build"] != threading.get_ident()
    with LiveServer(build_app(AsyncEngine(engine, owner=owner), served_model_names=["tiny"])) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    assert threads["steps"] == {threads["build"]}


def test_a_failed_build_raises_in_the_caller():
    def build():
        raise ValueError("no such model")

    owner = OwnerThread(build)
    for _ in range(2):  # the same answer every time
        with pytest.raises(ValueError, match="no such model"):
            owner.engine()


def test_jobs_run_in_order_on_the_thread_that_built_the_engine():
    """An instance actor's steps and commands are jobs of its OwnerThread (InstanceWorker own_thread)."""
    owner = OwnerThread(lambda: threading.get_ident(), name="owner-test")
    built_on = owner.engine()
    order = []
    futs = [owner.submit(lambda i=i: order.append((i, threading.get_ident()))) for i in range(5)]
    assert owner.call(lambda: owner.call(threading.get_ident)) == built_on  # re-entrant: no deadlock
    with pytest.raises(KeyError, match="gone"):
        owner.call(lambda: {}["gone"])
    assert all(f.done() for f in futs) and order == [(i, built_on) for i in range(5)]
    owner.close()
    owner.thread.join(10)
    assert not owner.thread.is_alive()
