"""Fuzzing the HTTP API: zero 5xx answers, whatever the body or headers.

* schemathesis generates valid (positive) and schema-violating (negative) requests from the
  app's OpenAPI schema, for every operation;
* hypothesis mutates valid bodies field by field with arbitrary JSON values.

The context is tiny (48 tokens) so every accepted request finishes quickly. Examples are
derandomized: the test is reproducible and bounded (well under 30 s).
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laser.frontend.async_engine import AsyncEngine
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer
from laser.server.protocol import ChatCompletionRequest, CompletionRequest

FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=256),
                    max_model_len=48)
    ae = AsyncEngine(engine, max_waiting=1024)
    srv = LiveServer(build_app(ae, served_model_names=["tiny"]))
    yield srv
    srv.stop()


def _assert_clean(srv):
    ae = srv.app.state.async_engine
    assert ae.num_step_errors == 0 and ae.dead is None
    srv.call(ae.check_integrity())


def test_schemathesis_no_5xx(fuzz_server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    srv = fuzz_server
    schema = schemathesis.openapi.from_dict(srv.app.openapi())
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    seen: dict[int, int] = {}
    for op in ops:
        post = op.method.upper() == "POST"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if post else (GenerationMode.POSITIVE,):

            @settings(max_examples=30 if post else 3, **FUZZ_SETTINGS)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                resp = case.call(base_url=srv.url, timeout=60)
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (case.body, case.headers, resp.text)
                if resp.status_code >= 400:
                    assert "error" in resp.json(), resp.text

            run()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    _assert_clean(srv)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
NUMBERS = st.integers(-5, 60) | st.floats(-2, 3, allow_nan=False)


def _mutated(valid: dict, fields: list[str]):
    """A valid body with a few fields replaced by arbitrary (often wrong) values, or dropped."""
    value = st.one_of(JSON, NUMBERS, st.text(max_size=30), st.lists(st.integers(-3, 70000), max_size=5))
    edits = st.dictionaries(st.sampled_from(fields + ["junk_field"]), st.none() | value, max_size=3)
    return edits.map(lambda e: {k: v for k, v in {**valid, **e}.items() if not (v is None and k in valid)})


@pytest.mark.parametrize(
    "path,valid,model",
    [
        ("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4}, CompletionRequest),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
         ChatCompletionRequest),
    ],
)
def test_mutated_bodies_no_5xx(fuzz_server, path, valid, model):
    srv = fuzz_server
    fields = sorted(model.model_fields)
    codes: dict[int, int] = {}
    with httpx.Client(base_url=srv.url, timeout=60) as h:

        @settings(max_examples=60, **FUZZ_SETTINGS)
        @given(body=_mutated(valid, fields),
               headers=st.dictionaries(st.sampled_from(["x-slo-class", "x-slo-ttft-ms", "x-slo-tbt-ms"]),
                                       st.sampled_from(["chat", "code", "nope", "", "10", "-1", "1e309", "nan", "0"]),
                                       max_size=2))
        def run(body, headers):
            r = h.post(path, json=body, headers=headers)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (body, headers, r.text)
            if r.status_code == 400:
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["message"]

        run()
    assert codes.get(200, 0) > 0 and codes.get(400, 0) > 0, codes
    _assert_clean(srv)
