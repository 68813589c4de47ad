"""vLLM's ``SamplingParams`` fields beyond the sampling controls (session 23's fresh-user round):
``allowed_token_ids`` and ``bad_words`` (the sampler's masks, vLLM's v1 order and its multi-token
rule: a bad word's last token is banned only after its other tokens), ``skip_special_tokens`` /
``spaces_between_special_tokens`` / ``detokenize`` (the output path), ``truncate_prompt_tokens``
and ``max_tokens=None`` (the input path), ``best_of`` and ``logits_processors`` (refused as vLLM
V1 refuses them), and ``LLM.chat(chat_template=...)``. A tiny random-weight Llama, greedy fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from laser.core.request import InvalidRequestError, Request, SamplingParams
from laser.frontend.llm import LLM
from laser.model.sampler import Sampler

MSGS = [{"role": "user", "content": "Tell me a story"}]
PROMPT = [(7 * i + 3) % 500 + 100 for i in range(30)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), policy="vllm", dtype="float32", max_model_len=64)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 6, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids must be non-negative"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a list"),
    (dict(bad_words=["ok", "  "]), "bad_words must be non-blank"),
    (dict(bad_words=[3]), "bad_words must be a string"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be"),
    (dict(best_of=3), "not supported .vLLM V1"),
    (dict(n=2, best_of=1), "best_of must be >= n"),
    (dict(best_of=0), "best_of must be an integer >= 1"),
    (dict(logits_processors=[lambda ids, row: row]), "logits_processors: per-request"),
    (dict(detokenize=False, stop=["x"]), "need detokenize=True"),
    (dict(skip_special_tokens="yes"), "skip_special_tokens must be true or false"),
    (dict(spaces_between_special_tokens=1), "spaces_between_special_tokens must be"),
    (dict(detokenize=None), "detokenize must be"),
    (dict(max_tokens=None, min_tokens=-1), "min_tokens must be"),
    (dict(dynamic_depth=True, temperature=0, allowed_token_ids=[1]), "dynamic_depth needs"),
])
def test_bad_values_are_refused_naming_the_field(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def test_unset_fields_leave_the_fast_path():
    sp = SamplingParams(best_of=1, logits_processors=[], skip_special_tokens=True, max_tokens=None)
    assert not sp.processes_logits and SamplingParams(temperature=0).plain_greedy
    assert SamplingParams(allowed_token_ids=[1]).processes_logits and SamplingParams(bad_words="x").processes_logits
    assert SamplingParams(bad_words="x").bad_words == ("x",)


def _row(V: int = 16, top: int = 5) -> torch.Tensor:
    row = torch.arange(V, dtype=torch.float32) / V
    row[top] = 10.0
    return row


def test_bad_words_ban_the_last_token_after_its_prefix_only():
    """vLLM's ``apply_bad_words``: a word [7, 5] bans 5 only when the output ends with 7; a
    one-token word is banned everywhere; the drafts of a speculative step count as output."""
    sp = SamplingParams(temperature=0, bad_words=["w"], bad_words_token_ids=((7, 5), (9,)))
    sampler = Sampler()
    req = Request([1, 2, 3], sp)
    row = _row()
    row[9] = 20.0
    assert sampler.process_logits(row.clone(), req)[9] == float("-inf")  # one token: always
    assert sampler.process_logits(_row(), req).argmax() == 5  # no output yet: 5 is free
    req.output_token_ids = [4, 7]
    assert sampler.process_logits(_row(), req)[5] == float("-inf")
    req.output_token_ids = [7, 4]
    assert sampler.process_logits(_row(), req).argmax() == 5
    assert sampler.process_logits(_row(), req, extra=[7])[5] == float("-inf")  # a draft ends with 7
    req.output_token_ids = []
    assert sampler.process_logits(_row(), req, extra=[3, 7])[5] == float("-inf")
    assert sampler.sample(_row()[None].clone(), [req]) == [5]
    req.output_token_ids = [7]
    assert sampler.sample(_row()[None].clone(), [req]) != [5]
    with pytest.raises(RuntimeError, match="bad_words need their token ids"):
        sampler.process_logits(_row(), Request([1], SamplingParams(bad_words=["w"])))


def test_allowed_token_ids_mask_and_a_mask_that_would_leave_nothing():
    sampler = Sampler()
    req = Request([1, 2], SamplingParams(temperature=0, allowed_token_ids=[2, 11]))
    row = sampler.process_logits(_row(), req)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [2, 11] and row[11] == _row()[11]
    # the only allowed token is a bad word: nothing would be left, the step keeps the row as it was
    both = Request([1, 2], SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[2], bad_words=["x"],
                                          bad_words_token_ids=((2,),)))
    plain = Request([1, 2], SamplingParams(temperature=1.0, seed=2))
    toks = sampler.sample(torch.stack([_row(), _row()]), [both, plain])  # no NaN, no failed step
    assert len(toks) == 2


def test_allowed_token_ids_and_bad_words_in_generation(llm):
    free = llm.generate(PROMPT, greedy())[0].token_ids
    allowed = llm.generate(PROMPT, greedy(allowed_token_ids=[free[1], 300]))[0].token_ids
    assert set(allowed) <= {free[1], 300}
    inputs = llm.engine.inputs
    tok = llm.engine.tokenizer
    t = next(t for t in free if (t,) in inputs.bad_words_ids((tok.decode([t]),)))  # a token that is its own word
    banned = llm.generate(PROMPT, greedy(bad_words=[tok.decode([t])]))[0].token_ids
    assert t not in banned and banned[:free.index(t)] == free[:free.index(t)]
    with pytest.raises(InvalidRequestError, match="allowed_token_ids: token id"):
        llm.generate(PROMPT, greedy(allowed_token_ids=[10**6]))
    assert llm.generate(PROMPT, greedy())[0].token_ids == free  # unset: unchanged
    assert not llm.engine.has_unfinished()


def test_text_switches(llm):
    tok = llm.engine.tokenizer
    special = next(t for t in tok.all_special_ids if t != tok.eos_token_id)
    sp = greedy(max_tokens=2, allowed_token_ids=[special, 300])
    kept, skipped = (llm.generate(PROMPT, dataclasses.replace(sp, skip_special_tokens=s))[0]
                     for s in (False, True))
    assert kept.token_ids == skipped.token_ids and special in kept.token_ids
    assert tok.convert_ids_to_tokens(special) in kept.text and tok.convert_ids_to_tokens(special) not in skipped.text
    ids_only = llm.generate(PROMPT, greedy(detokenize=False))[0]
    assert ids_only.text == "" and ids_only.token_ids == llm.generate(PROMPT, greedy())[0].token_ids
    spaced = llm.generate(PROMPT, greedy(spaces_between_special_tokens=False))[0]  # a fast tokenizer: no change
    assert spaced.text == llm.generate(PROMPT, greedy())[0].text


def test_truncate_prompt_tokens_and_max_tokens_none(llm):
    cut = llm.generate(PROMPT, greedy(truncate_prompt_tokens=8))[0]
    assert cut.prompt_token_ids == PROMPT[-8:]
    assert cut.token_ids == llm.generate(PROMPT[-8:], greedy())[0].token_ids
    assert llm.generate(PROMPT, greedy(truncate_prompt_tokens=50))[0].prompt_token_ids == PROMPT  # shorter: as is
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens: 65 is more than"):
        llm.generate(PROMPT, greedy(truncate_prompt_tokens=65))
    long = PROMPT * 3  # 90 tokens, more than the context: -1 keeps its last 64, still no room to generate
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate(long, greedy(truncate_prompt_tokens=-1))
    assert llm.generate(long, greedy(truncate_prompt_tokens=40))[0].prompt_token_ids == long[-40:]
    rest = llm.generate(PROMPT, greedy(max_tokens=None))[0]
    assert len(rest.token_ids) == 64 - len(PROMPT) and rest.finish_reason == "length"
    assert rest.request.sampling_params.max_tokens == 64 - len(PROMPT)


def test_best_of_equal_to_n_and_chat_template(llm):
    outs = llm.generate(PROMPT, SamplingParams(max_tokens=3, n=2, best_of=2, seed=3))
    assert len(outs[0].outputs) == 2
    with pytest.raises(InvalidRequestError, match="best_of: 3 > n=2"):
        llm.generate(PROMPT, SamplingParams(n=2, best_of=3))
    sp = greedy(max_tokens=2)
    own = llm.chat(MSGS, sp, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")[0]
    assert llm.engine.tokenizer.decode(own.prompt_token_ids) == "[Tell me a story]"
    assert llm.chat(MSGS, sp)[0].prompt_token_ids == llm.engine.inputs.apply_chat_template(MSGS)
    for bad in ("", 5):
        with pytest.raises(InvalidRequestError, match="chat_template must be"):
            llm.chat(MSGS, sp, chat_template=bad)
