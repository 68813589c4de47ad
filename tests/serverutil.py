"""Shared helpers for tests that talk to a live server (``pythonpath = ["tests"]``): one way to serve
an engine on a background uvicorn thread and one OpenAI client against it."""

from __future__ import annotations

from collections.abc import Iterator

import openai

from laser.frontend.async_engine import AsyncEngine
from laser.server.app import build_app
from laser.server.cli import LiveServer


def serving(engine, **app_kwargs) -> Iterator[LiveServer]:
    """Yield ``engine`` served as model ``tiny`` (``build_app`` keywords pass through, e.g.
    ``api_key``); stopped when the generator is closed. Use as the body of a module fixture."""
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"], **app_kwargs))
    try:
        yield srv
    finally:
        srv.stop()


def openai_client(live: LiveServer, api_key: str = "unused", timeout: float = 60) -> openai.OpenAI:
    """The ``openai`` client on ``live``'s ``/v1`` without retries (a test sees the first answer)."""
    return openai.OpenAI(base_url=live.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
