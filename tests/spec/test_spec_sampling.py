"""Sampled self-speculation (laser.spec): the rejection rule keeps the target distribution
(chi-square on a small vocabulary, fixed seed), seeded requests are reproducible alone and
batched, and a draft distribution equal to the target's (an identity tail) is always accepted
under every sampling transform."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from laser.core.config import CacheConfig
from laser.core.request import SamplingParams
from laser.frontend.engine import Engine
from laser.spec.rejection import rejection_sample

from test_self_spec import PROMPTS, SMALL, _run, _speculate, _tail_scaled_model

# A small vocabulary: token 4 cannot be drafted (q = 0), token 5 is drafted but never a target (p = 0).
P0 = torch.tensor([0.30, 0.25, 0.05, 0.15, 0.25, 0.00])
P1 = torch.tensor([0.05, 0.05, 0.40, 0.30, 0.20, 0.00])
P2 = torch.tensor([0.60, 0.10, 0.10, 0.10, 0.10, 0.00])
Q0 = torch.tensor([0.10, 0.40, 0.20, 0.20, 0.00, 0.10])
Q1 = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.00, 0.20])


def _trials(n: int, seed: int = 1234):
    """``n`` speculative steps with 2 drafts (d_0 ~ Q0, d_1 ~ Q1; the targets do not depend on the
    drafts, so the token at position j, when emitted, must be distributed as P_j)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.stack([Q0, Q1])
    p = torch.stack([P0, P1, P2])
    drafts = torch.stack([torch.multinomial(Q0, n, replacement=True, generator=gen),
                          torch.multinomial(Q1, n, replacement=True, generator=gen)], dim=1)
    return [rejection_sample(drafts[t], q, p, [gen, gen, gen]) for t in range(n)]


def _chi2(tokens: list[int], p: torch.Tensor) -> float:
    support = [i for i in range(len(p)) if p[i] > 0]
    assert all(t in support for t in tokens)  # a token of target probability 0 is never emitted
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()[support]
    expected = p[support].double()
    return chisquare(counts.numpy(), (expected / expected.sum() * counts.sum()).numpy()).pvalue


def test_rejection_rule_keeps_the_target_distribution():
    runs = _trials(12_000)
    first = [r[0] for r in runs]
    second = [r[1] for r in runs if len(r) >= 2]
    third = [r[2] for r in runs if len(r) == 3]
    assert _chi2(first, P0) > 1e-3
    assert _chi2(second, P1) > 1e-3
    assert _chi2(third, P2) > 1e-3
    # acceptance of d_0 is sum(min(p, q)) = 0.55 (binomial sd ~0.0045 over 12k trials)
    assert abs(len(second) / len(runs) - float(torch.minimum(P0, Q0).sum())) < 0.02
    # the test can fail: keeping every draft (no rule) gives the draft distribution, not P0
    drafted = torch.multinomial(Q0, 12_000, replacement=True, generator=torch.Generator().manual_seed(5)).tolist()
    counts = torch.bincount(torch.tensor(drafted), minlength=6).double()[:4]
    expected = P0[:4].double()
    assert chisquare(counts.numpy(), (expected / expected.sum() * counts.sum()).numpy()).pvalue < 1e-6


def test_rejection_rule_greedy_special_case_and_shapes():
    """One-hot p and q: accept while the draft is the target's argmax, then emit that argmax."""
    V = 8
    target = [3, 1, 6, 2]
    p = torch.nn.functional.one_hot(torch.tensor(target), V).float()
    drafts = torch.tensor([3, 1, 5])
    q = torch.nn.functional.one_hot(drafts, V).float()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    assert rejection_sample(drafts, q, p, gens) == [3, 1, 6]
    assert rejection_sample(torch.tensor([3, 1, 6]), torch.nn.functional.one_hot(torch.tensor([3, 1, 6]), V).float(),
                            p, gens) == [3, 1, 6, 2]  # all accepted: the bonus token
    assert rejection_sample(torch.zeros(0, dtype=torch.long), torch.zeros(0, V), p[:1], gens[:1]) == [3]
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(drafts, q, p[:3], gens)


def test_rejection_rule_is_reproducible_with_seeded_generators():
    q = torch.stack([Q0, Q1])
    p = torch.stack([P0, P1, P2])
    drafts = torch.tensor([1, 2])

    def once():
        return [rejection_sample(drafts, q, p, [torch.Generator().manual_seed(s * 3 + i) for i in range(3)])
                for s in range(50)]

    assert once() == once()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False)


SAMPLED = [
    SamplingParams(max_tokens=20, temperature=0.9, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.3, top_p=0.9, top_k=50, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=18, temperature=0.7, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.5,
                   frequency_penalty=0.3, seed=13, ignore_eos=True),
]


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
def test_seeded_sampled_requests_reproducible_alone_and_batched(engine, policy):
    engine.set_policy(policy)
    spec = _speculate(engine, 2, 3)
    engine.set_policy(policy)
    alone = [_run(engine, [p], [sp])[0] for p, sp in zip(PROMPTS, SAMPLED)]
    assert [_run(engine, [p], [sp])[0] for p, sp in zip(PROMPTS, SAMPLED)] == alone
    # beside greedy and unseeded sampled requests, in another order
    others = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)]
    got = _run(engine, [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
               [SAMPLED[2], SAMPLED[1], SAMPLED[0], *others])
    assert got[:3] == alone[::-1]
    assert [len(x) for x in alone] == [20, 16, 18]
    st = spec.stats
    assert st.sampled_steps > 0 and 0 < st.accepted < st.drafted  # drafts partly kept: the rule ran


def test_identical_draft_distribution_is_always_accepted(tiny_llama, tmp_path):
    """Layers 2..3 are the identity: the exit after layer 2 is the full model, so q == p under
    every transform (temperature, top-k/top-p, min-p, penalties counting the drafts): every draft
    is kept. A transform applied to one side only would reject some."""
    d = _tail_scaled_model(tiny_llama, tmp_path / "ident", 0.0, 2)
    e = Engine(str(d), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=64), latency_calibration=False)
    spec = _speculate(e, 2, 4)
    out = _run(e, PROMPTS[:3], SAMPLED)
    assert [len(x) for x in out] == [20, 16, 18]
    st = spec.stats
    assert st.sampled_steps == st.steps > 0
    assert st.accepted == st.drafted > 0
