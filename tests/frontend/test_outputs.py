"""Incremental detokenization (SmolLM2's byte-level BPE) and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from laser.core.config import CacheConfig
from laser.frontend.outputs import IncrementalDetokenizer, find_stop
from laser.frontend.engine import Engine
from laser.model.loader import load_tokenizer
from laser.core.request import SamplingParams

TEXTS = [
    "Café naïve résumé — déjà vu, Ångström, São Paulo, Dvořák.",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "emoji 😀🎉👍🏽 ok 👨‍👩‍👧 family 🇫🇷 flag",
    "mixed: Ωmega ü ß ½ € ∑ 🚀!\n\tnew line",
    "🙂",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def stream(tok, prompt_ids: list[int], ids: list[int]) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, prompt_ids)
    return [det.add(t) for t in ids], det


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_one_shot(tok, text):
    ids = tok.encode(text)
    prompt = tok.encode("User: repeat this.\nAssistant:")
    deltas, det = stream(tok, prompt, ids)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected == det.text
    assert not any("\ufffd" in d for d in deltas), deltas


def test_multibyte_characters_are_held_back_until_complete(tok):
    """An emoji split over several byte tokens yields nothing until its last byte arrives
    (this is the path the U+FFFD checks above rely on)."""
    ids = tok.encode("a😀")
    assert len(ids) > 2  # the emoji takes several tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # a lone piece is not valid UTF-8
    deltas, _ = stream(tok, [], ids)
    assert deltas[0] == "a"
    assert deltas[1:-1] == [""] * (len(ids) - 2)
    assert deltas[-1] == "😀"


def test_special_tokens_are_skipped(tok):
    text_ids = tok.encode("Hello wörld 🎉")
    special = sorted(tok.all_special_ids)
    assert special
    ids = text_ids[:2] + [special[0]] + text_ids[2:] + special
    deltas, det = stream(tok, tok.encode("x"), ids)
    assert det.text == tok.decode(ids, skip_special_tokens=True) == tok.decode(text_ids)
    assert all(deltas[i] == "" for i, t in enumerate(ids) if t in special)


def test_prompt_context_does_not_leak_or_change_leading_space(tok):
    prompt = tok.encode("The answer is")
    ids = tok.encode(" forty-two")
    deltas, det = stream(tok, prompt, ids)
    assert det.text == " forty-two"
    assert deltas[0].startswith(" ")


# Unassigned/private-use code points are excluded: the tokenizer itself cannot round-trip them.
text_st = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cn", "Co"), blacklist_characters="\ufffd"),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=text_st, text=text_st)
def test_incremental_equals_one_shot_random_text(tok, prompt, text):
    ids = tok.encode(text)
    assume(tok.decode(ids) == text)
    deltas, det = stream(tok, tok.encode(prompt), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


# -- stop strings ------------------------------------------------------------------------------------


def test_find_stop():
    assert find_stop("hello world", ("wor",), 3) == 6
    assert find_stop("hello world", ("xyz",), 11) is None
    # the earliest of several stop strings wins, whatever their order
    assert find_stop("abc STOP def END", ("END", "STOP"), 16) == 4
    # a stop string straddling old text and the new characters is found
    assert find_stop("xxST" + "OP", ("STOP",), 2) == 2
    # ... but one entirely inside text already checked is not searched again
    assert find_stop("ab STOP cd" + "e", ("STOP",), 1) is None
    # the stop string is the whole text
    assert find_stop("END", ("END",), 3) == 0
    # multi-byte characters: indices are in characters
    assert find_stop("日本語😀です", ("😀",), 3) == 3


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=64))


def run(engine, stop=(), n=24):
    req = engine.add_request("Once upon a time", SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop=stop))
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.req_id == req.req_id)
    engine.check_integrity(expect_empty=True)
    return req, outs


def test_engine_cuts_text_exactly_before_stop_string(engine):
    req, outs = run(engine)
    full = outs[-1].text
    deltas = [o.delta_text for o in outs]
    assert "".join(deltas) == full and outs[-1].finish_reason == "length"
    # a stop string that straddles two tokens (completed by the later one), and one
    # that lies inside a single token
    k = next(i for i in range(3, len(deltas) - 1) if len(deltas[i]) >= 2 and len(deltas[i + 1]) >= 2)
    straddling = deltas[k][-2:] + deltas[k + 1][:2]
    inner = deltas[k + 1][1:]
    for stop in (straddling, inner):
        cut = full.find(stop)
        assert cut > 0
        req2, outs2 = run(engine, stop=(stop, "never-appears-here"))
        final = outs2[-1]
        assert final.finished and final.finish_reason == "stop"
        assert final.text == full[:cut], (stop, final.text)
        assert stop not in final.text
        # streamed deltas never leak the start of the stop string: they add up to the final text
        assert "".join(o.delta_text for o in outs2) == final.text
        assert all(o.text == "".join(x.delta_text for x in outs2[: i + 1]) for i, o in enumerate(outs2))
        # generation stopped at the token that completed the stop string
        assert req2.output_token_ids == req.output_token_ids[: len(req2.output_token_ids)]
        n = len(req2.output_token_ids)
        completed = engine.tokenizer.decode(req.output_token_ids[:n], skip_special_tokens=True)
        before = engine.tokenizer.decode(req.output_token_ids[: n - 1], skip_special_tokens=True)
        assert stop in completed and stop not in before


def _req(tok, stop: tuple[str, ...], max_tokens: int = 64):
    from laser.core.request import Request

    return Request(prompt_token_ids=tok.encode("Say:"), sampling_params=SamplingParams(max_tokens=max_tokens, stop=stop))


def _feed(proc, req, ids, last_reason=None, last_handed_off=False):
    """Feed ``ids`` one by one as an instance would (token appended, then processed)."""
    for i, t in enumerate(ids):
        req.output_token_ids.append(t)
        last = i == len(ids) - 1
        out, stop = proc.process(req, t, last_reason if last else None, last_handed_off and last)
    return out, stop


def test_output_processor_judges_stop_strings_for_every_front_end(tok):
    """The one output path (issue 27 item 1): a stop string ends a request as ``stop`` and tells
    the caller to stop it on its instance only while the instance still holds it; it wins over
    the instance's ``length`` on the same token (the cluster front end used to say ``length``);
    a request handed off on that token is not handed off; a handed-off one stays tracked."""
    from laser.frontend.outputs import OutputProcessor

    ids = tok.encode(" hello world and more")
    proc = OutputProcessor(tok)
    r = _req(tok, (" world",))
    proc.add_request(r)
    out, stop = _feed(proc, r, ids[:2])  # " hello", " world"
    assert (out.finished, out.finish_reason, stop, out.text) == (True, "stop", True, " hello")
    r = _req(tok, (" world",))
    proc.add_request(r)
    out, stop = _feed(proc, r, ids[:2], last_reason="length")
    assert (out.finish_reason, stop, out.text) == ("stop", False, " hello")
    r = _req(tok, (" world",))
    proc.add_request(r)
    out, stop = _feed(proc, r, ids[:2], last_handed_off=True)
    assert (out.finish_reason, out.handed_off, stop) == ("stop", False, True)
    r = _req(tok, ("zzz",))
    proc.add_request(r)
    out, stop = _feed(proc, r, ids[:1], last_handed_off=True)
    assert out.handed_off and not out.finished and not stop
    out, _ = _feed(proc, r, ids[1:2], last_reason="length")  # still tracked after the hand-off
    assert out.finished and out.text == " hello world"


def test_include_stop_str_in_output_keeps_the_matched_stop_string(tok):
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string that matched (the
    longest of those starting at the earliest match); it used to be ignored (the string cut)."""
    from laser.core.request import InvalidRequestError, Request
    from laser.frontend.outputs import OutputProcessor

    assert find_stop("abc STOP def", ("STOP", "ST"), 12, include=True) == 8
    assert find_stop("abc STOP def", ("STOP", "ST"), 12) == 4
    ids = tok.encode(" hello world and more")
    proc = OutputProcessor(tok)
    sp = SamplingParams(max_tokens=64, stop=(" world",), include_stop_str_in_output=True)
    r = Request(prompt_token_ids=tok.encode("Say:"), sampling_params=sp)
    proc.add_request(r)
    out, stop = _feed(proc, r, ids[:2])
    assert (out.finished, out.finish_reason, stop, out.text) == (True, "stop", True, " hello world")
    with pytest.raises(InvalidRequestError, match="include_stop_str_in_output"):
        Request(prompt_token_ids=[1], sampling_params=SamplingParams(include_stop_str_in_output="yes"))
