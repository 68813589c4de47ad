"""HTTP details that clients of vLLM / SGLang servers rely on: ``HEAD /health`` and ``/metrics``, ``GET
/v1/models/{id}`` (the official client's ``models.retrieve``), and an unhandled error in a
handler answered as an OpenAI-style JSON 500 that keeps a keep-alive connection open."""

from __future__ import annotations

import time
import warnings

import httpx
import openai
import pytest

from laser.frontend.async_engine import AsyncEngine
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer

NAMES = ["tiny", "org/tiny-chat"]  # a served name with a slash, as Hugging Face ids have


class _Boom(RuntimeError):
    """What the failing route raises: an error no handler of the app knows."""


@pytest.fixture(scope="module")
def live(tiny_llama):
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                    max_model_len=128)
    app = build_app(AsyncEngine(engine), served_model_names=NAMES)

    # a route with a bug: an exception nothing in the app handles
    @app.get("/test/unhandled")
    async def unhandled():
        raise _Boom("a bug in a handler")

    srv = LiveServer(app)
    yield srv
    srv.stop()


def test_head_health_answers_200_without_a_body(live):
    r = httpx.head(live.url + "/health")
    assert r.status_code == 200 and r.content == b""
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id
        live.app.openapi_schema = None
        ops = live.app.openapi()["paths"]["/health"]
    assert set(ops) == {"get", "head"} and ops["get"]["operationId"] != ops["head"]["operationId"]


def test_head_metrics_answers_200_as_get_does(live):
    """aiperf 0.13 probes the Prometheus endpoint with ``HEAD /metrics`` before it scrapes it (a
    405 made it log a failed probe and retry with GET); HEAD answers what GET would, without a body."""
    r = httpx.head(live.url + "/metrics")
    assert r.status_code == 200 and r.content == b""
    g = httpx.get(live.url + "/metrics")
    assert g.status_code == 200 and r.headers["content-type"] == g.headers["content-type"]
    assert "laser:num_requests_running" in g.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id
        live.app.openapi_schema = None
        ops = live.app.openapi()["paths"]["/metrics"]
    assert set(ops) == {"get", "head"}


def test_retrieve_model_returns_the_model_card(live):
    listed = httpx.get(live.url + "/v1/models").json()["data"]
    for name in NAMES:
        r = httpx.get(f"{live.url}/v1/models/{name}")
        assert r.status_code == 200, r.text
        card = r.json()
        assert card["id"] == name and card["object"] == "model" and card["owned_by"] == "laser"
        assert card["max_model_len"] == 128
        assert {k: v for k, v in card.items() if k != "created"} == \
            {k: v for k, v in next(m for m in listed if m["id"] == name).items() if k != "created"}
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert client.models.retrieve("org/tiny-chat").id == "org/tiny-chat"


@pytest.mark.parametrize("name", ["nope", "org/nope", "tiny/extra"])
def test_retrieve_unknown_model_is_an_openai_404(live, name):
    r = httpx.get(f"{live.url}/v1/models/{name}")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and err["type"] == "not_found_error"
    assert repr(name) in err["message"] and "tiny" in err["message"]
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)


def _client_port(r: httpx.Response) -> int:
    """The local port of the connection ``r`` came over (the same port: the same connection)."""
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_unhandled_error_is_a_json_500_and_keeps_the_connection(live, caplog):
    with httpx.Client(base_url=live.url, timeout=30) as h:
        first = h.get("/health")
        assert first.status_code == 200
        ports = [_client_port(first)]
        with caplog.at_level("ERROR", logger="laser.server.app"):
            r = h.get("/test/unhandled")
        ports.append(_client_port(r))
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "internal server error: _Boom", "type": "internal_error",
                                      "param": None, "code": "internal_error"}}
        assert r.headers.get("connection", "").lower() != "close"
        # logged once, with its traceback, by the app
        recs = [x for x in caplog.records if x.name == "laser.server.app" and x.exc_info]
        assert len(recs) == 1 and recs[0].exc_info[0] is _Boom
        time.sleep(0.3)  # give a closing server time to close: the next request must not need a new connection
        nxt = h.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert nxt.status_code == 200, nxt.text
        ports.append(_client_port(nxt))
        assert ports[0] == ports[1] == ports[2], f"a new connection after the 500: local ports {ports}"
