"""Our layer-by-layer engine reproduces HF transformers exactly (greedy tokens, logits)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from laser.frontend.engine import Engine
from laser.core.request import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a ten-year-old.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with HF's own forward and KV cache (what ``generate`` does), never stopping at EOS."""
    out = []
    with torch.no_grad():
        o = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            t = int(o.logits[0, -1].argmax())
            out.append(t)
            o = model(torch.tensor([[t]]), past_key_values=o.past_key_values, use_cache=True)
    return out


def engine_greedy(engine: Engine, prompts: list[list[int]], n: int, **kw):
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(p, sp, **kw) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity(expect_empty=True)
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    engine = Engine(str(smollm2_dir), policy="vllm", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    hf.eval()
    return engine, hf


def test_smollm2_greedy_matches_hf(smol):
    engine, hf = smol
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = engine_greedy(engine, prompts, 32)  # all five batched together
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 32)


def test_smollm2_last_logits_match_hf(smol):
    engine, hf = smol
    ids = engine.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    req = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    plan = engine.scheduler.schedule(0.0)
    res = engine.runner.execute(plan, engine.scheduler.requests, return_logits=True)
    engine.scheduler.update(plan, res.stopped_layer, res.sampled, 0.0)
    engine.abort(req.req_id)
    got = res.logits[req.req_id]
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()
    engine.check_integrity(expect_empty=True)


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3"])
def test_tiny_models_match_hf(kind, tiny_model_dirs):
    d = tiny_model_dirs[kind]
    engine = Engine(str(d), policy="sarathi", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    ours = engine_greedy(engine, prompts, 24)
    for p, o in zip(prompts, ours):
        assert o == hf_greedy(hf, p, 24)
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[1]])).logits[0, -1]
    req = engine.add_request(prompts[1], SamplingParams(max_tokens=1, temperature=0))
    plan = engine.scheduler.schedule(0.0)
    res = engine.runner.execute(plan, engine.scheduler.requests, return_logits=True)
    engine.abort(req.req_id)
    assert torch.allclose(res.logits[req.req_id], ref, atol=1e-4, rtol=0)
    engine.check_integrity(expect_empty=True)
