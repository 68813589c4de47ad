"""Admission control, overload, API keys, engine faults and shutdown of the server.

* a TTFT target the latency model calls infeasible is queued, rejected (429 with the
  predicted TTFT; 400 when it is missed even on an idle instance) or demoted to the strictest
  class it meets, else best_effort (said in a header), per ``on_infeasible``;
* a full bounded queue answers 429s and never a 5xx;
* ``--api-key`` guards ``/v1``;
* an engine step that raises fails only the requests in flight; the server keeps serving;
* the engine thread does not spin when idle;
* SIGTERM drains short requests and aborts long ones cleanly (``laser serve`` subprocess).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from laser.frontend.async_engine import AsyncEngine, predicted_prefill_seconds
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.latency import SimpleLatencyModel
from laser.server.app import build_app
from laser.server.cli import LiveServer

REPO = Path(__file__).resolve().parents[2]


def _engine(model_dir, **kw) -> Engine:
    return Engine(str(model_dir), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=256),
                  max_model_len=256, **kw)


def _post(url, body, **kw):
    return httpx.post(url, json=body, timeout=60, **kw)


# -- TTFT feasibility -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_model_server(tiny_llama):
    """The latency model says a prefill takes ~0.4 s: chat (0.25 s) and code (0.125 s) are
    infeasible, summarization (2 s) is not."""
    lm = SimpleLatencyModel(num_layers=4, per_layer=0.1)
    ae = AsyncEngine(_engine(tiny_llama, latency_model=lm))
    srv = LiveServer(build_app(ae, served_model_names=["tiny"]))
    yield srv
    srv.stop()


def test_predicted_prefill_uses_latency_model(slow_model_server):
    ae = slow_model_server.app.state.async_engine
    assert predicted_prefill_seconds(ae.engine, 10) == pytest.approx(4 * (0.1 + 1e-5 * 10))


@pytest.mark.parametrize("mode", ["queue", "reject", "demote"])
def test_on_infeasible(slow_model_server, mode):
    srv = slow_model_server
    ae = srv.app.state.async_engine
    ae.on_infeasible = mode
    try:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "slo_class": "chat"}
        t0 = time.perf_counter()
        r = _post(srv.url + "/v1/completions", body)
        # the prediction counts from the HTTP arrival: the prefill (400 ms) plus the time spent in the
        # server before admission, which the client's own wall time bounds (any machine speed)
        upper_ms = 400.0 + 1e3 * (time.perf_counter() - t0)
        if mode == "reject":  # missed even on an idle instance: no retry can meet it -> 400, no retry-after
            assert r.status_code == 400 and "retry-after" not in r.headers
            err = r.json()["error"]
            assert err["code"] == "slo_infeasible" and err["type"] == "invalid_request_error"
            assert "even on an idle instance" in err["message"], err
            m = re.search(r"predicted time to first token (\d+\.\d) ms", err["message"])
            assert m and 400.0 <= float(m.group(1)) <= upper_ms, err
            assert 400.0 <= float(r.headers["x-laser-predicted-ttft-ms"]) <= upper_ms
        elif mode == "demote":  # the strictest class it meets (summarization, 2 s), not best effort
            assert r.status_code == 200
            assert r.headers["x-slo-demoted"] == "warm"
            assert r.headers["x-slo-class"] == "summarization" and r.headers["x-slo-requested-class"] == "chat"
            assert r.json()["slo"]["demoted"] is True and r.json()["slo"]["slo_class"] == "summarization"
        else:
            assert r.status_code == 200 and r.headers["x-slo-class"] == "chat"
            assert "x-slo-demoted" not in r.headers
            assert 400.0 <= r.json()["slo"]["predicted_ttft_ms"] <= upper_ms
        # feasible targets and best effort are never refused
        for cls in ("summarization", "best_effort"):
            r = _post(srv.url + "/v1/completions", {**body, "slo_class": cls})
            assert r.status_code == 200 and r.headers["x-slo-class"] == cls
        # the same through the openai client, streaming (headers decided before the stream starts)
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        if mode == "reject":
            with pytest.raises(openai.BadRequestError):
                c.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                                     extra_body={"slo_class": "code"})
        else:
            raw = c.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                                                         extra_body={"slo_class": "code"})
            assert raw.headers.get("x-slo-demoted") == ("warm" if mode == "demote" else None)
            list(raw.parse())
    finally:
        ae.on_infeasible = "queue"
    text = httpx.get(srv.url + "/metrics").text
    assert 'laser:predicted_slack_seconds_count{model_name="tiny",slo_class="chat"}' in text
    if mode == "reject":
        assert 'laser:request_rejected_total{model_name="tiny",reason="slo_infeasible"}' in text
    if mode == "demote":
        assert 'laser:request_demoted_total{model_name="tiny",slo_class="chat"}' in text


# -- overload ---------------------------------------------------------------------------------------------


def test_overload_gives_429_never_5xx(tiny_llama):
    engine = _engine(tiny_llama)
    step = engine.step

    def slow_step():  # a slower engine makes the burst overrun the queue deterministically
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    ae = AsyncEngine(engine, max_waiting=3)
    with LiveServer(build_app(ae, served_model_names=["tiny"])) as srv:

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as h:
                async def one(i):
                    body = {"prompt": f"Request {i} says", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                            "stream": i % 2 == 0}
                    r = await h.post("/v1/completions", json=body)
                    return r.status_code, r.text, r.headers

                return await asyncio.gather(*(one(i) for i in range(24)))

        res = asyncio.run(burst())
        codes = [c for c, _, _ in res]
        assert all(c in (200, 429) for c in codes), codes
        assert codes.count(429) >= 1 and codes.count(200) >= 3
        for c, text, headers in res:
            if c == 429:
                err = json.loads(text)["error"]
                assert err["code"] == "queue_full" and "retry" in err["message"]
                assert headers["retry-after"] == "1"
            elif text.startswith("data:"):
                assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
        assert srv.call(ae.run_in_engine(lambda e: e.has_unfinished())) is False
        srv.call(ae.check_integrity(expect_empty=True))
        assert ae.num_queued == 0
        # and it serves normally afterwards
        assert _post(srv.url + "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_more_choices_than_the_queue_bound_is_a_400_not_a_retry(tiny_llama, tmp_path):
    """A request of more prompts x n than --max-waiting could never be admitted: it used to get the
    full queue's 429 "retry later" (with 0 waiting), which clients retry in vain, and a Batch API
    line of that width was retried until its job's window expired (24 h by default)."""
    import io

    ae = AsyncEngine(_engine(tiny_llama), max_waiting=3)
    with LiveServer(build_app(ae, served_model_names=["tiny"], data_dir=tmp_path)) as srv:
        for body in ({"prompt": ["a", "b", "c", "d"]}, {"prompt": ["a", "b"], "n": 2}):
            r = _post(srv.url + "/v1/completions", {**body, "max_tokens": 1})
            assert r.status_code == 400 and "retry-after" not in r.headers, r.text
            err = r.json()["error"]
            assert err["param"] == "prompt" and "at most 3 requests at once" in err["message"], err
        assert _post(srv.url + "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1}).status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        lines = [{"custom_id": "wide", "body": {"prompt": ["a"] * 4, "max_tokens": 1}},
                 {"custom_id": "ok", "body": {"prompt": "a", "max_tokens": 1}}]
        data = "\n".join(json.dumps({**ln, "method": "POST", "url": "/v1/completions"}) for ln in lines).encode()
        f = c.files.create(file=("w.jsonl", io.BytesIO(data)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
        deadline = time.monotonic() + 60
        while (b := c.batches.retrieve(b.id)).status != "completed":
            assert b.status == "in_progress" and time.monotonic() < deadline, b
            time.sleep(0.1)
        assert (b.request_counts.completed, b.request_counts.failed) == (1, 1)
        err = json.loads(c.files.content(b.error_file_id).text)
        assert err["custom_id"] == "wide" and err["response"]["status_code"] == 400, err


# -- API key ------------------------------------------------------------------------------------------------


def test_api_key(tiny_llama):
    ae = AsyncEngine(_engine(tiny_llama))
    with LiveServer(build_app(ae, served_model_names=["tiny"], api_key="sekret")) as srv:
        body = {"prompt": "x", "max_tokens": 2}
        r = _post(srv.url + "/v1/completions", body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = _post(srv.url + "/v1/completions", body, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # probes stay open, as in vLLM
        assert httpx.get(srv.url + "/metrics").status_code == 200
        for path in ("/docs", "/openapi.json", "/redoc"):  # the API's documentation stays open, as in vLLM
            assert httpx.get(srv.url + path).status_code == 200, path
        # the extra routes run the tokenizer: they need the key too (SGLang guards every route)
        assert _post(srv.url + "/tokenize", {"prompt": "hi"}).status_code == 401
        assert _post(srv.url + "/detokenize", {"tokens": [1]}).status_code == 401
        assert httpx.get(srv.url + "/tokenizer_info").status_code == 401
        r = _post(srv.url + "/tokenize", {"prompt": "hi"}, headers={"authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["count"] > 0
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


# -- faults -------------------------------------------------------------------------------------------------


def test_engine_step_error_fails_only_requests_in_flight(tiny_llama):
    engine = _engine(tiny_llama)
    step = engine.step
    boom = {"armed": False}

    def flaky_step():
        if boom["armed"] and any(r.num_output_tokens >= 2 for r in engine.scheduler.requests.values()):
            boom["armed"] = False
            raise RuntimeError("injected fault")
        return step()

    engine.step = flaky_step
    ae = AsyncEngine(engine)
    with LiveServer(build_app(ae, served_model_names=["tiny"])) as srv:
        boom["armed"] = True
        r = _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        boom["armed"] = True
        r = _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 8, "ignore_eos": True, "stream": True})
        assert '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert ae.num_step_errors == 2 and ae.dead is None
        # everyone after keeps being served, and nothing leaked
        r = _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        srv.call(ae.check_integrity(expect_empty=True))


def test_idle_engine_does_not_spin(tiny_llama):
    # idle sleeps of up to an hour: a request answered within the 60 s client timeout proves the
    # engine woke at once for it (no wall-clock bound that a slow machine could miss)
    ae = AsyncEngine(_engine(tiny_llama), idle_wait_s=3600.0)
    with LiveServer(build_app(ae, served_model_names=["tiny"])) as srv:
        assert _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
        time.sleep(0.2)
        steps = ae.num_steps
        cpu = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - cpu < 0.25  # a spinning thread would burn ~1 s
        assert ae.num_steps == steps
        # and it wakes at once for a new request (not after its hour-long idle sleep)
        assert _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_async_engine_generate_and_stop(tiny_llama):
    """The AsyncEngine alone (no HTTP): generate() streams, an early exit aborts, stop() is clean."""
    ae = AsyncEngine(_engine(tiny_llama))

    async def main():
        ae.start()
        from laser.core.request import SamplingParams

        outs = [o async for o in ae.generate("Hello", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))]
        assert len(outs) == 5 and outs[-1].finished and outs[-1].finish_reason == "length"
        assert "".join(o.delta_text for o in outs) == outs[-1].text
        agen = ae.generate("Hello", SamplingParams(max_tokens=100, ignore_eos=True), slo="chat")
        async for o in agen:
            assert o.slo.name == "chat"
            break
        await agen.aclose()  # early exit aborts the request
        await asyncio.sleep(0.05)
        assert await ae.run_in_engine(lambda e: e.has_unfinished()) is False
        await ae.check_integrity(expect_empty=True)
        # a long request in flight at shutdown ends with finish_reason "abort": from here every
        # step takes >= 20 ms, so its 200 tokens outlast the 0.1 s drain on any machine
        step = ae.engine.step

        def slow_step():
            time.sleep(0.02)
            return step()

        await ae.run_in_engine(lambda e: setattr(e, "step", slow_step))
        agen = ae.generate("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        first = await agen.__anext__()
        assert not first.finished
        await ae.shutdown(drain_timeout=0.1)
        rest = [o async for o in agen]
        assert rest and rest[-1].finish_reason == "abort"
        ae.engine.check_integrity(expect_empty=True)
        assert not ae.running

    asyncio.run(main())


# -- shutdown of a real `laser serve` process -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The "long" stream must not be able to finish inside --shutdown-timeout on ANY machine: its length is
# bounded only by a context of LONG_CONTEXT tokens (a tiny model decodes a few thousand tokens/s on a
# fast CPU, and each step slows as the context grows), not by a max_tokens a fast CPU gets through in
# 2 s (a 1,000-token stream did, on a faster CPU: finish reason `length`, not `abort`).
LONG_CONTEXT = 131072


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory, smollm2_dir):
    """The tiny llama with a 131,072-position context (its RoPE table is 8 MiB)."""
    from conftest import make_tiny_model

    d = tmp_path_factory.mktemp("tiny-llama-long")
    make_tiny_model("llama", d, smollm2_dir, max_position_embeddings=LONG_CONTEXT)
    return d


def test_sigterm_drains_short_and_aborts_long(long_context_llama, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "laser.cli", "serve", "--model", str(long_context_llama), "--policy", "sarathi",
         "--dtype", "float32", "--kv-cache-gib", "0.13", "--max-model-len", str(LONG_CONTEXT), "--port", str(port),
         "--shutdown-timeout", "2", "--threads", "1", "--log-level", "warning",
         "--data-dir", str(tmp_path / "batches")],  # its own Batch API store: a server on the default one may run
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # a hang guard, not a speed bound: a first start profiles the latency model (tens of
        # seconds on a quiet machine, minutes on a busy one)
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        results = {}
        started = threading.Barrier(3)

        def stream(name, max_tokens):
            body = {"prompt": "Go", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            started.wait()
            results[name] = events

        threads = [threading.Thread(target=stream, args=("short", 12)), threading.Thread(target=stream, args=("long", LONG_CONTEXT - 16))]
        for t in threads:
            t.start()
        started.wait(timeout=60)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # draining: no new work is accepted
            r = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
            assert r.status_code == 503
        except httpx.HTTPError:
            pass  # or the listener is already closed
        for t in threads:
            t.join(timeout=30)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out  # drained: a clean exit, as vLLM's (uvicorn used to re-raise the signal)
    assert "Traceback" not in out, out

    def finish(events):
        assert events[-1] == "[DONE]"
        reasons = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
        return [x for x in reasons if x]

    assert finish(results["short"]) == ["length"]  # drained: finished normally
    assert finish(results["long"]) == ["abort"]  # past --shutdown-timeout: aborted cleanly


# -- queue-aware admission (issue 11 item 4) ----------------------------------------------------------------


def test_burst_is_admitted_by_queue_position(tiny_llama):
    """40 simultaneous chat requests (100-token prompts, a 50 ms prefill each by the fake latency
    model, 250 ms target): the first few are admitted (predicted feasible behind the ones
    before them), the rest get 429 with their predicted TTFT; /metrics counts each decision."""
    lm = SimpleLatencyModel(num_layers=4, per_layer=0.0025, per_token=1e-4)
    # the engine's clock moves only with its steps: the time the event loop takes to reach each
    # handler of the burst (counted from the HTTP arrival since srv23) depends on the host, and
    # on a loaded one it alone passed the target before the first request was decided
    now = [0.0]
    engine = _engine(tiny_llama, latency_model=lm, clock=lambda: now[0])
    step = engine.step

    def slow_step():  # the engine lags behind the burst, as a loaded CPU would: 50 ms a step
        time.sleep(0.05)
        now[0] += 0.05
        return step()

    engine.step = slow_step
    ae = AsyncEngine(engine, on_infeasible="reject")
    with LiveServer(build_app(ae, served_model_names=["tiny"])) as srv:

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as h:
                async def one(i):
                    body = {"prompt": [5 + i] * 100, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "slo_class": "chat"}
                    r = await h.post("/v1/completions", json=body)
                    return r.status_code, r.json(), r.headers

                return await asyncio.gather(*(one(i) for i in range(40)))

        res = asyncio.run(burst())
        ok = [b for c, b, _ in res if c == 200]
        rejected = [(b, h) for c, b, h in res if c == 429]
        assert len(ok) + len(rejected) == 40
        assert 1 <= len(ok) <= 8 and len(rejected) >= 32, [c for c, _, _ in res]
        for b in ok:
            assert b["slo"]["predicted_ttft_ms"] <= 250.0
        for b, h in rejected:
            assert b["error"]["code"] == "slo_infeasible" and "queued ahead" in b["error"]["message"]
            assert float(h["x-laser-predicted-ttft-ms"]) > 250.0 and h["retry-after"] == "1"  # the queue: retry
        text = httpx.get(srv.url + "/metrics").text
        assert (f'laser:admission_decisions_total{{model_name="tiny",outcome="rejected_infeasible",slo_class="chat"}} '
                f'{float(len(rejected))}') in text
        assert (f'laser:admission_decisions_total{{model_name="tiny",outcome="admitted",slo_class="chat"}} '
                f'{float(len(ok))}') in text
