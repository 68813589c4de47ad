"""What a new user meets first (issue 26, fresh-user round): null message content, ``/version``,
the OpenAI endpoints Laser does not serve, ``max_tokens`` past the context -- on the server and
in ``laser generate`` / ``LLM.chat``, which share the input path's rules."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import openai
import pytest

from laser import __version__, cli
from laser.core.config import CacheConfig
from laser.core.request import InvalidRequestError, SamplingParams
from laser.frontend.engine import Engine
from laser.frontend.llm import LLM
from serverutil import openai_client, serving

MAX_MODEL_LEN = 128


def _engine(model_dir) -> Engine:
    return Engine(str(model_dir), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=64),
                  max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def live(tiny_llama):
    yield from serving(_engine(tiny_llama), api_key="k")


@pytest.fixture(scope="module")
def client(live):
    return openai_client(live, api_key="k")


def _post(live, path, body):
    return httpx.post(live.url + path, json=body, headers={"authorization": "Bearer k"}, timeout=60)


@pytest.mark.parametrize("role", ["user", "system", "tool", "assistant"])
def test_null_content_is_a_400_except_an_assistant_tool_call(live, role):
    """OpenAI: ``content`` may be null only on an assistant message with ``tool_calls``; it used
    to be rendered as an empty turn and served."""
    msg = {"role": role, "content": None}
    if role == "tool":
        msg["tool_call_id"] = "call_1"
    r = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, msg], "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["message"].startswith("messages[1].content: "), err
    assert "null content is only valid for an assistant message with tool_calls" in err["message"]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    assert _post(live, "/v1/chat/completions", {"messages": ok, "max_tokens": 2}).status_code == 200


def test_an_empty_content_part_list_is_a_400(live):
    r = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": []}], "max_tokens": 2})
    assert r.status_code == 400 and "messages[0].content: an empty list of content parts" in r.text, r.text


def test_llm_chat_refuses_null_content_too(tiny_llama):
    llm = LLM.__new__(LLM)
    llm.engine = _engine(tiny_llama)
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content: a user message needs content"):
        llm.chat([{"role": "user", "content": None}], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_version_needs_no_key(live):
    r = httpx.get(live.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
    assert httpx.head(live.url + "/version").status_code == 200


def test_embeddings_say_what_is_served(live, client):
    r = _post(live, "/v1/embeddings", {"model": "tiny", "input": "hi"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_endpoint" and "not an embedding" in err["message"], err
    assert "POST /v1/chat/completions" in err["message"]
    with pytest.raises(openai.NotFoundError, match="not supported"):  # not retried as a server error
        client.embeddings.create(model="tiny", input="hi")


def test_cli_generate_refuses_an_empty_prompt_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(cli, "build_engine", lambda *a, **k: pytest.fail("loaded the model first"))
    assert cli.main(["generate", "--prompt", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["laser: error: --prompt is empty: give the text to complete (vLLM refuses an empty prompt too)"]


def test_cli_generate_max_tokens_past_the_context(tiny_llama, capsys, monkeypatch):
    """An explicit ``--max-tokens`` that does not fit is refused as the server refuses it (it used
    to run to the context's end silently); without the flag the output fits the context."""
    engine = _engine(tiny_llama)
    monkeypatch.setattr(cli, "build_engine", lambda *a, **k: engine)
    assert cli.main(["generate", "--prompt", "hi", "--raw", "--max-tokens", str(MAX_MODEL_LEN)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "laser: error: this model's context is 128 tokens" in err and "lower --max-tokens" in err
    assert not engine.has_unfinished()
    long_prompt = "hello " * 60  # > MAX_MODEL_LEN - 128 tokens: the default 128 would not fit
    assert cli.main(["generate", "--prompt", long_prompt, "--raw"]) == 0
    assert "tokens in" in capsys.readouterr().err


def test_null_for_a_field_with_a_default_is_that_default(live):
    """OpenAI's fields are nullable: a client that serialises its unset options sends
    ``"n": null``, ``"stream": null``, ``"echo": null``; they were 400s (``n: Input should be a
    valid integer``). A required field stays required."""
    r = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                              "n": None, "stream": None, "ignore_eos": None,
                                              "add_generation_prompt": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = _post(live, "/v1/completions", {"prompt": "hi", "max_tokens": None, "n": None, "echo": None, "stream": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16, r.text
    r = _post(live, "/v1/chat/completions", {"messages": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_a_client_request_id_names_the_response(live):
    """vLLM's convention: the client's ``X-Request-Id`` becomes the response id
    (``chatcmpl-<id>``), so a trace id the client logs finds the server's answer; an id with
    other characters is replaced by a random one."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"authorization": "Bearer k", "x-request-id": "trace-42.a:b_c"})
    assert r.json()["id"] == r.headers["x-request-id"] == "chatcmpl-trace-42.a:b_c", r.text
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"authorization": "Bearer k", "x-request-id": "two words"})
    assert r.status_code == 200 and "two" not in r.json()["id"] and r.json()["id"] == r.headers["x-request-id"]


def test_text_too_long_for_the_context_is_refused_before_tokenizing(live, tiny_llama, monkeypatch):
    """A 16 MB prompt took the one tokenizer thread ~14 s (every other request's tokenization
    waited); text longer than the context's tokens can cover (the longest token's characters x
    the context, x2) is now refused without tokenizing, with the same code as a long prompt."""
    engine = _engine(tiny_llama)
    calls = []
    monkeypatch.setattr(engine.inputs.tokenizer, "encode", lambda *a, **k: calls.append(a) or [1])
    for prompt in ("a" * 200_000, [{"role": "user", "content": "a" * 200_000}]):
        with pytest.raises(InvalidRequestError, match=r"has 200\d+ characters, more tokens than this model's "
                                                      r"context of 128 tokens holds"):
            engine.inputs.encode_prompt(prompt)
    assert calls == []
    assert engine.inputs.encode_prompt("a" * 100) == [1]  # short text still tokenized
    # many short messages: the chat template rendered 300 000 of them in ~7 s
    with pytest.raises(InvalidRequestError, match="conversation has 257 messages, more than this model's context"):
        engine.inputs.encode_prompt([{"role": "user", "content": "a"}] * (2 * MAX_MODEL_LEN + 1))
    r = _post(live, "/v1/completions", {"prompt": "a" * 200_000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["message"].startswith("prompt: the prompt has 200000 characters"), r.text


def _admissions(live) -> float:
    """The server's admission decisions so far (``laser:admission_decisions``, every class and outcome)."""
    text = httpx.get(live.url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("laser:admission_decisions_total{"))


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_bad_word_is_a_400_before_admission(live, route):
    """A bad word the tokenizer cannot take (an unpaired surrogate) was a 400 only once the engine
    thread tokenized it at the request's add: the request had been admitted (counted, queued,
    priced) first, and every bad word of every request was tokenized on the engine thread. Now
    the words are tokenized on the tokenizer thread before admission."""
    body = {"max_tokens": 2, "bad_words": ["fine", "SURROGATE"]}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    before = _admissions(live)
    raw = json.dumps(body).replace("SURROGATE", "\\ud800x")  # JSON's escape of an unpaired surrogate
    r = httpx.post(live.url + route, content=raw, timeout=60,
                   headers={"authorization": "Bearer k", "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "bad_words" and "bad_words is not valid Unicode text" in err["message"], err
    assert _admissions(live) == before
    body["bad_words"] = ["fine"]
    assert _post(live, route, body).status_code == 200
    assert _admissions(live) == before + 1


def test_truncate_prompt_tokens_tokenizes_only_the_text_it_keeps(live, tiny_llama, monkeypatch):
    """With ``truncate_prompt_tokens`` K a text prompt is cut, before tokenizing, to the characters
    that surely hold more than K tokens (2 x K x the longest token's characters): the kept tokens
    are the whole text's last K, a megabyte prompt is not tokenized whole, and text longer than
    the context can cover is served, not refused (main: 400 context_length_exceeded although the
    client asked for truncation; it tokenized 1 MB of text to keep 100 tokens)."""
    engine = _engine(tiny_llama)
    inputs = engine.inputs
    text = " ".join(f"w{i % 97} x{i % 13}" for i in range(2_000))
    assert len(text) > inputs.text_chars(10) and len(text) < inputs.text_chars(MAX_MODEL_LEN)
    whole = inputs.tokenizer.encode(text)
    for keep in (1, 10, 100):
        assert inputs.tokenize(text, keep) == whole[-keep:]
    assert inputs.text_to_keep(text, 10) == text[-inputs.text_chars(10):]
    assert inputs.text_to_keep("short", 10) == "short" and inputs.text_to_keep(text, 0) == text  # (refused later)
    seen = []
    encode = inputs.tokenizer.encode
    monkeypatch.setattr(inputs.tokenizer, "encode", lambda t, *a, **k: seen.append(len(t)) or encode(t, *a, **k))
    inputs.tokenize(text * 40, 10)  # past the context's characters: served
    assert seen == [inputs.text_chars(10)]
    r = _post(live, "/v1/completions", {"prompt": text * 40, "max_tokens": 2, "truncate_prompt_tokens": 5,
                                        "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5 and r.json()["choices"][0]["prompt_token_ids"] == whole[-5:]
    r = _post(live, "/v1/completions", {"prompt": text * 40, "max_tokens": 2, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    r = _post(live, "/v1/completions", {"prompt": text * 40, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_tokenize_of_long_text_does_not_hold_prompts_behind_it(tiny_llama):
    """``/tokenize`` takes text of any length (vLLM's does), but a few megabytes took the one
    tokenizer thread ~1 s a MB, and every prompt waited behind it (also text just under the length
    prompts are refused at). ``/tokenize`` now runs on a thread of its own: while a long call is
    held, completions are served; once it goes on, it answers with every token."""
    engine = _engine(tiny_llama)
    tok = engine.inputs.tokenizer
    encode, gate, entered = tok.encode, threading.Event(), threading.Event()
    long_chars = engine.inputs.text_chars(MAX_MODEL_LEN) + 1

    def held_encode(text, *a, **k):
        if len(text) >= long_chars:
            entered.set()
            assert gate.wait(60)
        return encode(text, *a, **k)

    tok.encode = held_encode
    gen = serving(engine, api_key="k")
    live = next(gen)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(_post, live, "/tokenize", {"prompt": "ab " * (long_chars // 3 + 1)})
            assert entered.wait(60)
            for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "ab " * 5, "max_tokens": 1}):
                r = _post(live, "/v1/completions", body)
                assert r.status_code == 200, r.text
            r = _post(live, "/tokenize", {"messages": [{"role": "user", "content": "ab ab"}]})  # chat: the prompts' thread
            assert r.status_code == 200 and r.json()["count"] > 0
            assert not long.done()
            gate.set()
            r = long.result(timeout=60)
        assert r.status_code == 200 and r.json()["count"] > MAX_MODEL_LEN, r.text
        assert r.json()["tokens"] == encode("ab " * (long_chars // 3 + 1))
    finally:
        gate.set()
        gen.close()
