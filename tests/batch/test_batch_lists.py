"""OpenAI's list routes of the Batch API: ``GET /v1/files`` (``after``, ``limit``, ``order``,
``purpose``) and ``GET /v1/batches`` (``after``, ``limit`` 1-100) page by cursor as OpenAI's API
does, so the official client's auto-pagination walks every object once; an unknown ``after`` is a
400 on ``after`` (not the first page again, which would make a paging client loop)."""

from __future__ import annotations

import io
import json

import httpx
import openai
import pytest

from laser.core.config import CacheConfig
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.engine import Engine
from laser.server.app import build_app
from laser.server.cli import LiveServer


@pytest.fixture(scope="module")
def live(tiny_llama, tmp_path_factory):
    engine = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                    max_model_len=128)
    srv = LiveServer(build_app(AsyncEngine(engine), served_model_names=["tiny"],
                               data_dir=tmp_path_factory.mktemp("lists")))
    yield srv
    srv.stop()


def _upload(client, i: int):
    body = {"model": "tiny", "prompt": f"item {i}", "max_tokens": 1}
    line = json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return client.files.create(file=(f"in{i}.jsonl", io.BytesIO(line.encode() + b"\n")), purpose="batch")


def test_file_and_batch_lists_page_by_cursor(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    files = [_upload(client, i) for i in range(3)]
    ids = [f.id for f in files]
    page = client.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == ids[:2] and page.has_more
    page = client.files.list(limit=2, order="asc", after=ids[1])
    assert [f.id for f in page.data] == ids[2:] and not page.has_more
    assert [f.id for f in client.files.list(limit=1)] == ids[::-1]  # auto-pagination, newest first
    assert [f.id for f in client.files.list(purpose="batch")] == ids[::-1]
    assert client.files.list(purpose="fine-tune").data == []
    for bad in ({"limit": 0}, {"limit": 10001}, {"order": "up"}, {"after": "file-nope"}):
        r = httpx.get(live.url + "/v1/files", params=bad)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", (bad, r.text)
        assert r.json()["error"]["param"] == next(iter(bad)), r.text

    batches = [client.batches.create(input_file_id=i, endpoint="/v1/completions", completion_window="24h").id
               for i in ids]
    assert [b.id for b in client.batches.list(limit=1)] == batches[::-1]  # auto-pagination, newest first
    page = client.batches.list(limit=2, after=batches[2])
    assert [b.id for b in page.data] == batches[1::-1] and not page.has_more
    with pytest.raises(openai.BadRequestError, match="after"):
        client.batches.list(after="batch_nope")
    # a deleted file is no cursor any more: the client is told, not sent back to the first page
    client.files.delete(ids[1])
    with pytest.raises(openai.BadRequestError, match="no file"):
        client.files.list(after=ids[1])
