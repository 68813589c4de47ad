"""laser/bench/prefix_workloads.py: the multi-turn and few-shot workloads of issue 29 (deliver 5),
built from the shipped ShareGPT and HumanEval data, and `laser bench`'s flags for them."""

import argparse

import pytest

from laser.bench.prefix_workloads import few_shot_code, multi_turn, turn_of
from laser.bench.workloads import ApproxTokenizer, sample_mix


@pytest.fixture(scope="module")
def tok():
    return ApproxTokenizer()


@pytest.fixture(scope="module")
def mix(tok):
    return sample_mix((3, 1, 1), 40, 5, 0.25, tok)


def test_multi_turn_turns_resend_the_conversation_so_far_in_order(tok, mix):
    out = multi_turn(mix, tok, seed=5, conversations=3, min_turns=3, max_turns=5, length_scale=0.25)
    assert len(out) == len(mix)
    assert [r.slo_class for r in out] == [r.slo_class for r in mix]  # other classes keep their places
    assert [r for r in out if r.slo_class != "chat"] == [r for r in mix if r.slo_class != "chat"]
    last: dict[str, tuple[int, str]] = {}
    for r in (r for r in out if r.slo_class == "chat"):
        conv, k = r.source.rsplit("#", 1)[0], turn_of(r.source)
        assert 1 <= k <= 5 and r.prompt.endswith("Assistant:") and r.output_len >= 1
        assert r.prompt_len == len(tok.encode(r.prompt))
        if k > 1:  # the previous turn's prompt (minus its closing "Assistant:") is a prefix of this one
            pk, prev = last[conv]
            assert pk == k - 1 and r.prompt.startswith(prev[: -len("Assistant:")])
            assert r.prompt_len > len(tok.encode(prev))
        last[conv] = (k, r.prompt)
    assert max(k for k, _ in last.values()) >= 3  # conversations really go on
    assert turn_of("HumanEval/3") is None


def test_multi_turn_is_deterministic_and_fits_the_context(tok, mix):
    a = multi_turn(mix, tok, seed=1, conversations=2, max_turns=6, max_model_len=300)
    assert a == multi_turn(mix, tok, seed=1, conversations=2, max_turns=6, max_model_len=300)
    assert a != multi_turn(mix, tok, seed=2, conversations=2, max_turns=6, max_model_len=300)
    assert all(r.prompt_len + r.output_len <= 300 for r in a if r.slo_class == "chat")
    with pytest.raises(ValueError, match="conversations"):
        multi_turn(mix, tok, conversations=0)
    with pytest.raises(ValueError, match="max_turns"):
        multi_turn(mix, tok, min_turns=3, max_turns=2)


def test_few_shot_code_prompts_share_the_same_examples_before_their_own_problem(tok, mix):
    out = few_shot_code(mix, tok, shots=4)
    code = [(m, o) for m, o in zip(mix, out) if m.slo_class == "code"]
    assert code and all(m == o for m, o in zip(mix, out) if m.slo_class != "code")
    header = code[0][1].prompt[: -len(code[0][0].prompt)]
    assert header.count("def ") >= 4
    asked = {m.source for m, _ in code}
    for m, o in code:
        assert o.prompt == header + m.prompt and o.output_len == m.output_len and o.source == m.source
        assert o.prompt_len == len(tok.encode(o.prompt))
    for m, _ in code:  # no request's own problem is among the examples
        assert m.prompt not in header
    small = few_shot_code(mix, tok, shots=4, max_model_len=code[0][1].prompt_len - 1 + code[0][0].output_len)
    assert all(r.prompt_len + r.output_len <= code[0][1].prompt_len - 1 + code[0][0].output_len
               for r in small if r.slo_class == "code")
    assert asked
    with pytest.raises(ValueError, match="shots"):
        few_shot_code(mix, tok, shots=0)


def test_bench_flags_build_the_prefix_workloads(tok):
    from laser.bench.args import register
    from laser.bench.cli import build_workload

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    args = sub.choices["bench"].parse_args(["--sim", "--num-prompts", "12", "--mix", "2:1:0", "--length-scale",
                                            "0.25", "--prefix-workload", "multi-turn", "--prefix-workload",
                                            "few-shot", "--conversations", "2", "--few-shot-examples", "3"])
    reqs, _, desc = build_workload(args, tok, 2048)
    assert desc["multi_turn"] == {"conversations": 2, "max_turns": 6} and desc["few_shot_examples"] == 3
    assert {turn_of(r.source) for r in reqs if r.slo_class == "chat"} >= {1, 2}
    assert len({r.prompt[:200] for r in reqs if r.slo_class == "code"}) == 1
