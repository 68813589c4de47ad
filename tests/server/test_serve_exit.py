"""``laser serve``'s exit on SIGTERM: the server drains and ``run`` returns, so the command exits 0
(or its own status), as vLLM's. uvicorn raises a handled signal again after its shutdown, under the
handler it found before: Ray's driver installs ``sys.exit(signum)``, which made a cluster server exit
with status 15 (and the default handler kills a single-instance server with -15)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx
import uvicorn

from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import make_server


def test_sigterm_drains_and_returns_under_rays_handler(tiny_llama):
    ae = AsyncEngine(Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=32),
                            max_model_len=128))
    config = uvicorn.Config(build_app(ae, served_model_names=["tiny"]), host="127.0.0.1", port=0,
                            log_level="warning")
    server = make_server(config, ae, drain_s=5.0)
    seen = {}

    def rays_handler(signum, frame):  # ray._private.worker's driver handler
        raise SystemExit(signum)

    def client():
        deadline = time.monotonic() + 120
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        seen["status"] = r.status_code
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, rays_handler)
    try:
        t = threading.Thread(target=client, daemon=True)
        t.start()
        server.run()  # returns: it raised SystemExit(15) before
        t.join(timeout=30)
        assert signal.getsignal(signal.SIGTERM) is rays_handler  # uvicorn put it back
    finally:
        signal.signal(signal.SIGTERM, old)
    assert seen == {"status": 200} and not ae.running
    assert sys.exc_info() == (None, None, None)
