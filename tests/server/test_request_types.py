"""A field in the wrong JSON type is a 400 naming it, as OpenAI's validation answers it (issue 26,
fresh-user round 7): pydantic's lax mode used to serve ``"stream": "yes"`` as a stream,
``"max_tokens": "5"`` or ``true`` as a count and ``"temperature": "0"`` as greedy. The server
keeps serving everyone else; a Batch API line in the wrong type fails alone."""

from __future__ import annotations

import httpx
import pytest

from laser.core.config import CacheConfig
from laser.frontend.engine import Engine
from serverutil import serving

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def live(tiny_llama):
    yield from serving(Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                              max_model_len=128))


def _post(live, path, body):
    return httpx.post(live.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path,base,field,value", [
    ("/v1/chat/completions", CHAT, "stream", "yes"),
    ("/v1/chat/completions", CHAT, "stream", 1),
    ("/v1/chat/completions", CHAT, "max_tokens", "5"),
    ("/v1/chat/completions", CHAT, "max_tokens", 5.0),
    ("/v1/chat/completions", CHAT, "max_tokens", True),
    ("/v1/chat/completions", CHAT, "temperature", "0"),
    ("/v1/chat/completions", CHAT, "n", "2"),
    ("/v1/chat/completions", CHAT, "logprobs", "yes"),
    ("/v1/completions", CMPL, "echo", "true"),
    ("/v1/completions", CMPL, "ignore_eos", 1),
    ("/v1/completions", CMPL, "seed", "7"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, "stream", "yes"),
    ("/v1/responses", {"input": "hi"}, "max_output_tokens", "2"),
])
def test_a_field_in_the_wrong_json_type_is_a_400_naming_it(live, path, base, field, value):
    r = _post(live, path, {**base, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: "), err


def test_json_numbers_keep_working(live):
    """An integer is a number (``"temperature": 0``, ``"top_p": 1``); ``null`` is the default."""
    r = _post(live, "/v1/chat/completions", {**CHAT, "temperature": 0, "top_p": 1, "stream": False, "n": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text


def test_a_list_location_is_written_with_brackets(live):
    """OpenAI writes ``messages[0].role``; pydantic's ``messages.0.role`` was passed through."""
    r = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "bot"}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"].startswith("messages[1].role: Input should be 'system'"), err
