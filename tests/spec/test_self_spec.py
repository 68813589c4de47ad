"""Self-speculative decoding (laser.spec) is lossless: greedy fp32 output equals plain decoding
for batched requests, every draft length, a KV pool too small for every draft (fallback and
preemption), max_tokens and stop tokens inside an accepted run; and trained exits (laser.model.exits)
are saved, found and refused for another model."""

from __future__ import annotations

import pytest
import torch

from laser.core.config import CacheConfig, ConfigError, SchedulerConfig
from laser.frontend.engine import Engine
from laser.model.exits import ExitHeads, exits_path, model_key, train_exits
from laser.core.request import SamplingParams
from laser.spec import SpeculativeConfig, enable_self_speculation

SMALL = CacheConfig(num_blocks=128)  # 2,048 tokens: a small pool is quick to allocate
PROMPTS = [[5, 17, 300, 42, 9], [77, 3, 1000, 2048, 11, 12, 13, 14, 15, 16, 17, 18, 19], [401, 402],
           list(range(100, 140))]


def _tail_scaled_model(src, dst, scale: float, from_layer: int):
    """A copy of the checkpoint ``src`` whose layers >= ``from_layer`` write ``scale`` times their
    output into the residual stream (o_proj, down_proj scaled): 0 makes them the identity, so an
    untrained exit after ``from_layer`` layers is the full model (every draft accepted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            if i >= from_layer:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)
    m.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def _all_vocab_heads(engine, depth: int) -> ExitHeads:
    model = engine.model
    return ExitHeads.init(model, [depth], torch.arange(model.config.vocab_size))


def _run(engine, prompts, sps):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity(expect_empty=True)
    return [list(r.output_token_ids) for r in reqs]


@pytest.fixture(scope="module")
def ref(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False)


@pytest.fixture(scope="module")
def spec_engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False)


def _speculate(engine, depth, g, heads=None):
    heads = heads or _all_vocab_heads(engine, depth)
    engine.core.executor, engine.speculator = engine.runner, None  # a fresh speculator each time
    return enable_self_speculation(engine, SpeculativeConfig("self", depth, g), heads=heads)


@pytest.mark.parametrize("policy", ["vllm", "sarathi"])
@pytest.mark.parametrize("g", [1, 2, 3, 5])
def test_greedy_output_identical_batched(ref, spec_engine, policy, g):
    sps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 17, 30, 9)]
    ref.set_policy(policy)
    spec_engine.set_policy(policy)
    want = _run(ref, PROMPTS, sps)
    # an exit after 2 of 4 layers with the untrained adapter: some drafts accepted, many not
    spec = _speculate(spec_engine, 2, g)
    got = _run(spec_engine, PROMPTS, sps)
    assert got == want
    assert spec.stats.steps > 0 and spec.stats.drafted > 0


def test_every_draft_accepted_when_the_tail_is_identity(tiny_llama, tmp_path, ref):
    """Layers 2..3 of the copy are the identity: the exit after layer 2 is the full model, every
    draft is accepted and each step emits g + 1 tokens (the bonus token included)."""
    d = _tail_scaled_model(tiny_llama, tmp_path / "ident", 0.0, 2)
    plain = Engine(str(d), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False)
    sps = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (25, 13, 9, 31)]
    want = _run(plain, PROMPTS, sps)
    spec = _speculate(plain, 2, 3)
    got = _run(plain, PROMPTS, sps)
    assert got == want
    assert [len(x) for x in got] == [25, 13, 9, 31]  # max_tokens hit exactly inside accepted runs
    st = spec.stats
    assert st.accepted == st.drafted > 0
    assert st.emitted == st.accepted + st.steps


def test_partial_acceptance_and_stop_token_inside_a_run(tiny_llama, tmp_path):
    """A slightly perturbed tail: drafts are partly accepted (0 < acceptance < 1); a stop token id
    that the output reaches inside an accepted run ends the request there, as without drafts."""
    d = _tail_scaled_model(tiny_llama, tmp_path / "near", 0.05, 2)
    e = Engine(str(d), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False)
    sps = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
    want = _run(e, PROMPTS, sps)
    stop = want[1][20]
    sps_stop = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
                for _ in PROMPTS]
    want_stop = _run(e, PROMPTS, sps_stop)
    spec = _speculate(e, 2, 4)
    assert _run(e, PROMPTS, sps) == want
    assert 0.0 < spec.stats.acceptance < 1.0
    assert _run(e, PROMPTS, sps_stop) == want_stop
    assert len(want_stop[1]) <= 21


def test_small_kv_pool_fallback_and_preemption(tiny_llama, ref):
    """A pool too small for every request's drafts: drafts shrink or fall back to plain decoding,
    requests are preempted and recomputed, and the output is still the plain one."""
    sps = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in range(4)]
    prompts = [PROMPTS[i] + [i + 1] for i in range(4)]
    cache = CacheConfig(block_size=4, num_blocks=24)
    e = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=cache, latency_calibration=False)
    want = _run(e, prompts, sps)
    pre0 = e.scheduler.num_preemptions
    spec = _speculate(e, 2, 5)
    e.set_policy("sarathi")
    got = _run(e, prompts, sps)
    assert got == want
    assert e.scheduler.num_preemptions > 0 or pre0 > 0
    assert spec.stats.fallbacks > 0


def test_logprob_requests_decode_normally(ref, spec_engine):
    """Requests asking for logprobs are not speculated: their seeded draws match the plain engine's."""
    sps = [SamplingParams(max_tokens=12, temperature=0.8, seed=7 + i, logprobs=1) for i in range(3)]
    ref.set_policy("vllm")
    spec_engine.set_policy("vllm")
    want = _run(ref, PROMPTS[:3], sps)
    spec = _speculate(spec_engine, 2, 3)
    got = _run(spec_engine, PROMPTS[:3], sps)
    assert got == want
    assert spec.stats.steps == 0


def test_unsupported_setups_are_refused(tiny_llama, spec_engine, tmp_path, monkeypatch):
    spec_engine.set_policy("vllm")
    spec = _speculate(spec_engine, 2, 2)
    spec_engine.set_policy("laser")  # the laser policy prices speculation (tests/spec/test_spec_laser.py)
    assert spec_engine.scheduler.speculation == spec.shape
    spec_engine.set_policy("vllm")
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="laser train-exits"):
        Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False,
               speculative=SpeculativeConfig())
    with pytest.raises(ConfigError, match="no trained exit after layer 3"):
        _speculate(spec_engine, 3, 2, heads=_all_vocab_heads(spec_engine, 2))
    bad = tmp_path / "garbage.pt"
    bad.write_text("garbage")  # not a torch file: a clear error, not torch's unpickling traceback
    with pytest.raises(ConfigError, match="not a trained exits file"):
        Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=SMALL, latency_calibration=False,
               speculative=SpeculativeConfig(exits_path=str(bad)))


def test_train_exits_saves_and_loads(spec_engine, tiny_llama, tmp_path, monkeypatch):
    """Training lowers the distillation loss below the untrained exit's; the file is found
    beside the model cache by --speculative self and refused for another model."""
    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path))
    spec_engine.core.executor, spec_engine.speculator = spec_engine.runner, None
    spec_engine.set_policy("vllm")
    train = [PROMPTS[0], PROMPTS[1]]
    heads = train_exits(spec_engine, [1, 2], gen_tokens=8, vocab_size=256, rank=8, epochs=4, batch=16, lr=1e-2,
                        progress=False, prompts=(train, [PROMPTS[2]]))
    rep = heads.report
    assert set(rep["depths"]) == {1, 2}
    for k in (1, 2):
        r = rep["depths"][k]
        assert r["distill_loss"] < r["untrained_loss"]
    path = exits_path(spec_engine.model_path)
    heads.save(path, model_key(spec_engine.model_path))
    spec = enable_self_speculation(spec_engine, SpeculativeConfig("self", 2, 2))  # found by the model's key
    assert spec.k == 2 and spec.heads.vocab.numel() == 256
    with pytest.raises(ValueError, match="trained for"):
        ExitHeads.load(path, "another-model")


@pytest.mark.parametrize("flag,value", [("--speculative-exits", "exits.pt"), ("--speculative-exit-layer", "4"),
                                        ("--speculative-draft-tokens", "2")])
def test_speculative_options_without_the_flag_are_refused(capsys, flag, value):
    """A ``--speculative-*`` option without ``--speculative self`` is refused before the model
    loads (a fresh user's server ignored it silently)."""
    from laser import cli

    assert cli.main(["generate", "--prompt", "x", "--model", "/nonexistent-model", flag, value]) == 2
    assert f"{flag} needs --speculative self" in capsys.readouterr().err
