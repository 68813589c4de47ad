"""The engine of ``laser serve`` is built and stepped on one thread (OwnerThread): a second thread's
OpenMP team made 2-thread steps ~4x slower (laser.frontend.engine_thread.OwnerThread)."""

from __future__ import annotations

import threading

import httpx
import pytest

from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.frontend.engine_thread import OwnerThread
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
