"""vLLM's offline API details: ``SamplingParams(n=...)`` gives ``n`` choices per prompt in
``LLM.generate`` / ``LLM.chat`` (``output.outputs``; choice ``j`` of a seeded request is the ``n=1``
answer of ``seed + j``, as the server's choices), and ``LLM.chat`` honours the chat template
switches the server takes (``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``), rendered by the one renderer both use."""

from __future__ import annotations

import httpx
import pytest

from laser.core.request import InvalidRequestError, SamplingParams
from laser.frontend.async_engine import AsyncEngine
from laser.frontend.llm import LLM
from laser.server.app import build_app
from laser.server.cli import LiveServer

MSGS = [{"role": "user", "content": "Tell me a story"}]
# SmolLM2's template plus one variable, as Qwen3's enable_thinking
EXTRA = "{% if greeting is defined %}{{ greeting }}{% endif %}"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=512)
    tok = llm.engine.inputs.tokenizer
    tok.chat_template = tok.chat_template + EXTRA
    return llm


def test_n_choices_per_prompt(llm):
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, n=3)
    outs = llm.generate(["Once upon a time", "The sea"], sp)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    assert outs[0].outputs[0] is outs[0]
    texts = [c.text for c in outs[0].outputs]
    assert len(set(texts)) == 3, texts  # each choice its own stream
    for j, c in enumerate(outs[0].outputs):  # choice j is the n=1 answer of seed + j
        alone = llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=1.0, seed=7 + j,
                                                                ignore_eos=True))[0]
        assert alone.token_ids == c.token_ids and len(alone.outputs) == 1
    chat = llm.chat(MSGS, SamplingParams(max_tokens=4, temperature=0, n=2))
    assert len(chat) == 1 and [c.token_ids for c in chat[0].outputs] == [chat[0].token_ids] * 2  # greedy
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError, match="n must be"):
            SamplingParams(n=bad)
    with pytest.raises(InvalidRequestError, match="n=2"):  # an engine request is one choice
        llm.engine.add_request("hi", SamplingParams(n=2))
    assert not llm.engine.has_unfinished()


def test_chat_template_switches(llm):
    inputs = llm.engine.inputs
    sp = SamplingParams(max_tokens=2, temperature=0)
    assert llm.chat(MSGS, sp)[0].prompt_token_ids == inputs.apply_chat_template(MSGS)
    closed = llm.chat(MSGS, sp, add_generation_prompt=False)[0].prompt_token_ids
    assert closed == inputs.apply_chat_template(MSGS, add_generation_prompt=False)
    assert closed != inputs.apply_chat_template(MSGS)
    partial = MSGS + [{"role": "assistant", "content": "Once upon"}]
    cont = llm.chat(partial, sp, add_generation_prompt=False, continue_final_message=True)[0]
    assert llm.engine.tokenizer.decode(cont.prompt_token_ids).endswith("Once upon")
    hello = llm.chat(MSGS, sp, chat_template_kwargs={"greeting": "HELLO-THERE"})[0]
    assert llm.engine.tokenizer.decode(hello.prompt_token_ids).endswith("HELLO-THERE")
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        llm.chat(MSGS, sp, continue_final_message=True)
    for bad in ({"tokenize": False}, {"add_generation_prompt": False}, ["greeting"]):
        with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
            llm.chat(MSGS, sp, chat_template_kwargs=bad)
    assert not llm.engine.has_unfinished()


def test_server_renders_chat_template_kwargs_as_llm_chat(llm):
    with LiveServer(build_app(AsyncEngine(llm.engine), served_model_names=["tiny"])) as srv:
        body = {"messages": MSGS, "chat_template_kwargs": {"greeting": "HELLO-THERE"}}
        r = httpx.post(srv.url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == llm.engine.inputs.apply_chat_template(MSGS, chat_template_kwargs=body[
            "chat_template_kwargs"])
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            llm.engine.inputs.apply_chat_template(MSGS, chat_template_kwargs=body["chat_template_kwargs"]))
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"messages": MSGS, "chat_template_kwargs": {"tokenize": False}})
        assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs", r.text  # (main: "messages")
