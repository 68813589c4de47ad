"""OpenAI Batch API, SLO tiers and demotion against a live server on the tiny random Llama.

* the official ``openai`` client: upload, create, poll to ``completed``, download; every
  ``custom_id`` once; malformed lines and rejected bodies in the error file; outputs equal to
  the same requests sent one by one (greedy fp32);
* bad input: unknown file, wrong purpose, invalid JSONL, bad or zero window, unsupported
  endpoint, cancel of a finished batch -- clear 4xx, and the server keeps serving;
* a window the latency model says cannot be met is refused with the predicted time (or run
  with a warning when accepted);
* demotion: demotable hot requests under predicted pressure are served as warm with
  ``x-slo-demoted: warm``; non-demotable ones never are;
* crash recovery: SIGKILL a ``laser serve`` mid-batch, restart it on the same ``--data-dir``:
  the batch completes with exactly one result per line, and results finished before the kill
  are kept as they were.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from laser.frontend.async_engine import AsyncEngine
from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from laser.latency import SimpleLatencyModel
from laser.server.app import build_app
from laser.server.cli import LiveServer

REPO = Path(__file__).resolve().parents[2]


def _engine(model_dir, **kw) -> Engine:
    return Engine(str(model_dir), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=256),
                  max_model_len=256, **kw)


def _line(cid, prompt, max_tokens=4, url="/v1/completions", **body):
    if url == "/v1/completions":
        b = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    else:
        b = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True}
    b.update(body)
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": b})


def _jsonl(lines) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _wait(client, bid, statuses=("completed", "failed", "expired", "cancelled"), timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(bid)
        if b.status in statuses:
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def live(tiny_llama, tmp_path_factory):
    ae = AsyncEngine(_engine(tiny_llama))
    srv = LiveServer(build_app(ae, served_model_names=["tiny"], data_dir=tmp_path_factory.mktemp("batches")))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_round_trip(live, client):
    prompts = [f"Item {i}: the quick brown fox" for i in range(6)]
    lines = [_line(f"req-{i}", p, max_tokens=3 + i % 3) for i, p in enumerate(prompts)]
    lines.insert(2, '{"custom_id": "broken", "method": "POST", "url": "/v1/completions", "body": {')  # bad JSON
    lines.append(_line("bad-body", "x", max_tokens=-1))  # the endpoint answers 400
    lines.append(_line("req-0", "duplicate id"))  # custom_ids must be unique
    f = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(_jsonl(lines))
    assert client.files.retrieve(f.id).id == f.id
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="30m",
                              metadata={"job": "round-trip"})
    assert b.object == "batch" and b.status == "in_progress" and b.completion_window == "30m"
    assert b.expires_at - b.created_at == 1800 and b.metadata == {"job": "round-trip"}
    b = _wait(client, b.id)
    assert b.status == "completed" and b.completed_at is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (9, 6, 3)
    assert b.id in [x.id for x in client.batches.list(limit=100).data]

    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == [f"req-{i}" for i in range(6)]
    errs = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    by_id = {r["custom_id"]: r for r in errs}
    assert set(by_id) == {None, "bad-body", "req-0"} and len(errs) == 3
    assert by_id[None]["error"]["code"] == "invalid_request" and "line 3" in by_id[None]["error"]["message"]
    assert by_id["bad-body"]["response"]["status_code"] == 400
    assert "max_tokens" in json.dumps(by_id["bad-body"]["response"]["body"])
    assert "duplicate custom_id" in by_id["req-0"]["error"]["message"]
    # each output is what the endpoint answers to the same body sent alone (greedy fp32)
    for r in out:
        i = int(r["custom_id"].split("-")[1])
        assert r["response"]["status_code"] == 200 and r["error"] is None and r["id"].startswith("batch_req_")
        body = r["response"]["body"]
        assert body["object"] == "text_completion" and body["slo"]["slo_class"] == "batch"
        direct = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=3 + i % 3, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert body["choices"][0]["text"] == direct.choices[0].text
    text = httpx.get(live.url + "/metrics").text
    assert f'laser:batch_requests{{batch_id="{b.id}",model_name="tiny",state="completed"}} 6.0' in text
    assert 'laser:batch_jobs_total{model_name="tiny",outcome="met_deadline"}' in text
    assert f'laser:batch_deadline_met{{batch_id="{b.id}",model_name="tiny"}} 1.0' in text
    # DELETE /v1/files/{id}: gone for retrieve and content, a second delete is a 404; the batch stays
    d = client.files.delete(f.id)
    assert d.id == f.id and d.deleted
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert client.batches.retrieve(b.id).status == "completed"
    assert client.files.content(b.output_file_id).text.count("\n") == 6


def test_chat_batch(client):
    lines = [_line(f"c{i}", f"Hello number {i}", url="/v1/chat/completions") for i in range(3)]
    f = client.files.create(file=("chat.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    b = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 3 and b.error_file_id is None
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert all(r["response"]["body"]["object"] == "chat.completion" for r in out)


def test_bad_input_is_a_clear_4xx(live, client):
    good = _jsonl([_line("a", "Hi")])
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(good)), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="invalid JSONL"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"not json\n{also not\n")), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not UTF-8"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"\xff\xfe\x00")), purpose="batch")
    with pytest.raises(openai.NotFoundError, match="no file"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError, match="no batch"):
        client.batches.retrieve("batch_nope")
    f = client.files.create(file=("x.jsonl", io.BytesIO(good)), purpose="batch")
    for window in ("0s", "soon", "-1h", "24", ""):
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window=window)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    out_file = None
    b = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                            completion_window="4h").id)
    assert b.status == "completed"
    out_file = b.output_file_id
    with pytest.raises(openai.BadRequestError, match="completed"):
        client.batches.cancel(b.id)
    with pytest.raises(openai.BadRequestError, match="purpose 'batch_output'"):  # an output file is no input
        client.batches.create(input_file_id=out_file, endpoint="/v1/completions", completion_window="4h")
    # nothing else disturbed
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].text is not None
    assert client.batches.retrieve(b.id).status == "completed"


def test_cancel_in_progress(client):
    lines = [_line(f"k{i}", "Count slowly", max_tokens=40) for i in range(30)]
    f = client.files.create(file=("k.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    b = _wait(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at is not None
    assert b.request_counts.completed < 30


# -- latency model that predicts slow steps: infeasible windows and demotion --------------------------------


@pytest.fixture(scope="module")
def slow(tiny_llama, tmp_path_factory):
    """Predicted prefill ~0.4 s (4 layers x 0.1 s): chat (TTFT 0.25 s) is under pressure at once."""
    lm = SimpleLatencyModel(num_layers=4, per_layer=0.1)
    ae = AsyncEngine(_engine(tiny_llama, latency_model=lm))
    srv = LiveServer(build_app(ae, served_model_names=["tiny"], data_dir=tmp_path_factory.mktemp("slow")))
    yield srv
    srv.stop()


def test_impossible_window_rejected_with_prediction(slow):
    c = openai.OpenAI(base_url=slow.url + "/v1", api_key="x", max_retries=0)
    f = c.files.create(file=("x.jsonl", io.BytesIO(_jsonl([_line(f"r{i}", "Hi", 4) for i in range(10)]))),
                       purpose="batch")
    with pytest.raises(openai.BadRequestError, match="predicts") as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="2s")
    assert e.value.code == "window_infeasible"
    predicted = float(e.value.response.headers["x-laser-predicted-completion-s"])
    assert predicted == pytest.approx(10 * (0.4 + 3 * 0.4 / 8), rel=0.05)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="2s",
                         extra_body={"accept_infeasible": True})
    assert "cannot finish" in b.model_extra["laser"]["warning"]
    assert _wait(c, b.id).status in ("completed", "expired")


def test_demotion_under_pressure(slow):
    url = slow.url + "/v1/completions"
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "slo_class": "chat"}
    r = httpx.post(url, json={**body, "slo_demotable": True}, timeout=60)
    assert r.status_code == 200 and r.headers["x-slo-demoted"] == "warm"
    assert r.headers["x-slo-class"] == "summarization" and r.headers["x-slo-requested-class"] == "chat"
    slo = r.json()["slo"]
    assert slo["demoted"] is True and slo["demoted_to"] == "warm" and slo["slo_class"] == "summarization"
    # the header form, streamed: the final chunk says so too
    events = []
    with httpx.stream("POST", url, json={**body, "slo_class": "code", "stream": True},
                      headers={"x-slo-demotable": "true"}, timeout=60) as r:
        assert r.headers["x-slo-demoted"] == "warm"
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert final and final[-1]["slo"]["demoted_to"] == "warm" and final[-1]["slo"]["requested_slo_class"] == "code"
    assert all("slo" not in e for e in events if e not in final)
    # not demotable: never demoted, under the same pressure
    for extra, headers in (({}, {}), ({"slo_demotable": False}, {"x-slo-demotable": "true"})):
        r = httpx.post(url, json={**body, **extra}, headers=headers, timeout=60)
        assert r.status_code == 200 and "x-slo-demoted" not in r.headers and r.headers["x-slo-class"] == "chat"
        assert r.json()["slo"]["demoted"] is False
    # only hot classes may be demotable
    r = httpx.post(url, json={**body, "slo_class": "summarization", "slo_demotable": True}, timeout=60)
    assert r.status_code == 400 and "only hot classes" in r.json()["error"]["message"]
    text = httpx.get(slow.url + "/metrics").text
    assert 'laser:request_demoted_total{model_name="tiny",slo_class="chat"} 1.0' in text
    assert 'laser:request_demoted_total{model_name="tiny",slo_class="code"} 1.0' in text


def test_no_demotion_without_pressure(client):
    r = client.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=2,
                                                    extra_body={"slo_class": "chat", "slo_demotable": True})
    assert "x-slo-demoted" not in r.headers and r.headers["x-slo-class"] == "chat"


# -- crash recovery ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir, data_dir, port):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "laser.cli", "serve", "--model", str(model_dir), "--policy", "sarathi",
         "--dtype", "float32", "--kv-cache-gib", "0.02", "--max-model-len", "512", "--port", str(port),
         "--threads", "1", "--log-level", "warning", "--no-warmup", "--data-dir", str(data_dir),
         "--served-model-name", "tiny",
         "--batch-concurrency", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def test_sigkill_mid_batch_then_restart(tiny_llama, tmp_path):
    n = 16
    port = _free_port()
    proc = _serve(tiny_llama, tmp_path, port)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        lines = [_line(f"job-{i}", f"Document {i} says", max_tokens=24) for i in range(n)]
        f = c.files.create(file=("big.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
        deadline = time.monotonic() + 120
        while (counts := c.batches.retrieve(b.id).request_counts).completed < 3:
            assert time.monotonic() < deadline and counts.failed == 0, counts
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # what the store held when the process died
        import sqlite3

        db = sqlite3.connect(tmp_path / "laser.sqlite3")
        before = dict(db.execute("SELECT custom_id, record FROM requests WHERE state = 'completed'").fetchall())
        db.close()
        assert 3 <= len(before) < n, "kill the server mid-batch"
        proc = _serve(tiny_llama, tmp_path, port)
        b = _wait(c, b.id, timeout=180)
        assert b.status == "completed" and b.request_counts.completed == n and b.request_counts.failed == 0
        out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == sorted(f"job-{i}" for i in range(n))  # each exactly once
        by_id = {r["custom_id"]: r for r in out}
        for cid, rec in before.items():
            assert by_id[cid] == json.loads(rec)  # finished before the kill: kept as it was
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("body,tokens", [
    ({"prompt": "Hi", "max_tokens": 4}, 4),
    ({"prompt": "Hi", "max_tokens": None}, 16),  # null: the endpoint's default, not the rest of the context
    ({"prompt": "Hi"}, 16),
    ({"prompt": ["Hi", "Yo"], "max_tokens": 4, "n": 2}, 16),  # 2 prompts x n 2
    ({"prompt": "Hi", "max_tokens": 0}, 0),  # rejected at once by the endpoint
    ({"prompt": "Hi", "max_tokens": 1000}, 0),  # past the context: rejected
    ({"prompt": "Hi", "max_tokens": 4, "n": 0}, 0),
    ({"max_tokens": 4}, 0),  # no prompt
])
def test_work_estimate_prices_lines_as_the_endpoint_runs_them(body, tokens):
    """A job of one good 2-token line beside one line with ``max_tokens: 0`` (which the endpoint
    rejects at once) was refused as ``window_infeasible`` for a 10-minute window on SmolLM2: the
    estimate priced the bad line at the rest of the context (8191 decode tokens, 1737 s). Also
    ``max_tokens: null`` (the endpoint generates 16) and ``max_tokens`` past the context. Lines
    are now priced as the endpoint resolves them; a line it rejects costs no decode."""
    from laser.batch.jobs import max_tokens_of

    assert max_tokens_of(body, "/v1/completions", prompt_tokens=10, max_model_len=256) == tokens


def test_work_estimate_of_chat_lines():
    from laser.batch.jobs import max_tokens_of

    msgs = [{"role": "user", "content": "Hi"}]
    assert max_tokens_of({"messages": msgs}, "/v1/chat/completions", 10, 256) == 246  # the rest of the context
    assert max_tokens_of({"messages": msgs, "max_completion_tokens": 3, "max_tokens": 9},
                         "/v1/chat/completions", 10, 256) == 3
    assert max_tokens_of({"messages": msgs, "max_tokens": 0}, "/v1/chat/completions", 10, 256) == 0
    assert max_tokens_of({"messages": []}, "/v1/chat/completions", 10, 256) == 0
