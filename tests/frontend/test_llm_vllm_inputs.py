"""vLLM's offline call shapes that a user brings over: prompt dicts (``TextPrompt`` /
``TokensPrompt``) in ``LLM.generate``, OpenAI content-part lists in ``LLM.chat`` (the server joins
them the same way), ``LLM.get_tokenizer()``, and ``RequestOutput.request_id`` /
``cumulative_logprob``, ``LLM(max_num_seqs=..., max_num_batched_tokens=...)``. On main the dicts
raised a bare ``KeyError: 0``, the content parts a template error, the scheduler keywords a
TypeError naming ``ModelInstance``, and the rest an AttributeError."""

from __future__ import annotations

import math

import pytest

from laser.core.config import SchedulerConfig
from laser.core.request import InvalidRequestError, SamplingParams
from laser.frontend.llm import LLM

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=256)


def test_prompt_dicts_as_vllm(llm):
    ids = llm.get_tokenizer().encode("Once upon a time")
    assert ids == llm.engine.inputs.tokenizer.encode("Once upon a time")
    want = llm.generate("Once upon a time", GREEDY)[0].token_ids
    assert llm.generate({"prompt": "Once upon a time"}, GREEDY)[0].token_ids == want  # TextPrompt
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].token_ids == want       # TokensPrompt
    mixed = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The sea"}, "The sea"], GREEDY)
    assert mixed[0].token_ids == want and mixed[1].token_ids == mixed[2].token_ids
    assert mixed[0].prompt_token_ids == ids
    for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"multi_modal_data": {}}, {}):
        with pytest.raises(InvalidRequestError, match="prompt dict"):
            llm.generate(bad, GREEDY)
    assert not llm.engine.has_unfinished()


def test_chat_content_parts_as_text(llm):
    plain = [{"role": "user", "content": "Hi there\nHow are you?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"},
                                          {"type": "text", "text": "How are you?"}]}]
    a, b = llm.chat(plain, GREEDY)[0], llm.chat(parts, GREEDY)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.token_ids == b.token_ids
    for content in ([], [{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text"}]):
        with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.content"):
            llm.chat([{"role": "user", "content": content}], GREEDY)
    assert not llm.engine.has_unfinished()


def test_output_request_id_and_cumulative_logprob(llm):
    out = llm.generate("The sea", SamplingParams(max_tokens=3, temperature=0, logprobs=1, ignore_eos=True))[0]
    assert out.request_id == out.req_id and out.request_id
    assert math.isclose(out.cumulative_logprob, sum(t.logprob for t in out.logprobs), rel_tol=1e-6)
    assert out.cumulative_logprob < 0
    assert llm.generate("The sea", GREEDY)[0].cumulative_logprob is None  # logprobs not asked, as vLLM


def test_vllm_engine_keywords(tiny_llama):
    llm = LLM(str(tiny_llama), policy="sarathi", dtype="float32", max_model_len=256, max_num_seqs=3,
              max_num_batched_tokens=32)
    cfg = llm.engine.scheduler_config
    assert (cfg.policy, cfg.max_num_seqs, cfg.max_num_batched_tokens) == ("sarathi", 3, 32)
    outs = llm.generate([f"Prompt {i}" for i in range(5)], GREEDY)  # more prompts than seats: all served
    assert [len(o.token_ids) for o in outs] == [4] * 5
    mine = SchedulerConfig(policy="laser", best_effort_share=0.5)
    cfg = LLM(str(tiny_llama), dtype="float32", max_model_len=256, scheduler=mine, max_num_seqs=2).engine.scheduler_config
    assert (cfg.best_effort_share, cfg.max_num_seqs) == (0.5, 2)
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'gpu_memory_utilization' "
                                        r"\(size the KV pool with cache=CacheConfig"):
        LLM(str(tiny_llama), gpu_memory_utilization=0.9)
    with pytest.raises(TypeError, match="'tokenizer'; it takes .*max_num_seqs"):
        LLM(str(tiny_llama), tokenizer=str(tiny_llama))
