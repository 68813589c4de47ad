"""CORS as vLLM's server does it (a fresh user's finding: a browser's preflight ``OPTIONS`` got
405): ``laser serve --allowed-origins / --allowed-methods / --allowed-headers /
--allow-credentials``, by default every origin, method and header; a preflight needs no API key."""

from __future__ import annotations

import httpx
import pytest

from laser.cli import build_parser
from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer, cors_options

PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


def _server(tiny_llama, *flags: str) -> LiveServer:
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                    max_model_len=128)
    args = build_parser().parse_args(["serve", *flags])
    return LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"], api_key="k",
                                cors=cors_options(args)))


def test_default_cors_answers_a_preflight_for_any_origin_without_the_api_key(tiny_llama):
    with _server(tiny_llama) as srv:
        r = httpx.options(srv.url + "/v1/chat/completions", headers=PREFLIGHT)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        # the actual request carries the header too (an error answer included)
        r = httpx.post(srv.url + "/v1/chat/completions", headers={"Origin": "https://ui.example"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_and_credentials_are_honoured(tiny_llama):
    with _server(tiny_llama, "--allowed-origins", '["https://ui.example"]', "--allow-credentials") as srv:
        ok = httpx.options(srv.url + "/v1/models", headers=PREFLIGHT)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        bad = httpx.options(srv.url + "/v1/models", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_bad_cors_flag_is_a_usage_error():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "*"])
