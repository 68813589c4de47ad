"""Lossy dynamic depth (issue 31 item 3; laser.core.depth): a request that opts in exits early at a
trained exit when the exit head is confident; the skipped layers' K/V of its position is filled
from the exit state (later tokens read K/V at every layer: check_integrity), its mean depth is
reported, its minimum depth is kept; a request that does not opt in is bit-identical to a run
without exits; Alg. 1 plans a request with a shallower expected depth with fewer layer slots."""

from __future__ import annotations

import math

import pytest
import torch

from laser.core.config import CacheConfig
from laser.core.depth import DynamicDepth, expected_layers
from laser.core.request import SLO, InvalidRequestError, SamplingParams
from laser.core.slo import SLOClasses
from laser.frontend.engine import Engine
from laser.model.exits import ExitHeads
from tests.spec.test_self_spec import _tail_scaled_model

SMALL = CacheConfig(num_blocks=128)
PROMPTS = [[5, 17, 300, 42, 9], [77, 3, 1000, 2048, 11, 12, 13, 14, 15, 16, 17, 18, 19], [401, 402],
           list(range(100, 140))]


def _heads(engine, depths) -> ExitHeads:
    """Untrained exits over the whole vocabulary: each is the final norm + LM head after ``k`` layers."""
    model = engine.model
    return ExitHeads.init(model, list(depths), torch.arange(model.config.vocab_size))


def _engine(path, exits=None, policy="vllm", **kw):
    return Engine(str(path), policy=policy, dtype="float32", cache=SMALL, latency_calibration=False, exits=exits, **kw)


def _run(engine, prompts, sps):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    engine.check_integrity(expect_empty=True)
    return reqs


def _greedy(n, dd=None):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, dynamic_depth=dd)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return _engine(tiny_llama)


@pytest.fixture(scope="module")
def exiting(tiny_llama):
    e = _engine(tiny_llama)
    e.runner.set_exits(_heads(e, [1, 2, 3]))
    e.inputs.serves_exits = True
    return e


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
def test_non_opting_requests_bit_identical(plain, exiting, policy):
    """Beside requests that exit early, requests that do not opt in get exactly the tokens of a
    server without exits (greedy fp32)."""
    plain.set_policy(policy)
    exiting.set_policy(policy)
    lens = (20, 13, 25, 9)
    want = [r.output_token_ids for r in _run(plain, PROMPTS, [_greedy(n) for n in lens])]
    dd = DynamicDepth(threshold=1e-6)
    sps = [_greedy(n, dd if i % 2 else None) for i, n in enumerate(lens)]
    reqs = _run(exiting, PROMPTS, sps)
    assert [r.output_token_ids for i, r in enumerate(reqs) if i % 2 == 0] == [want[0], want[2]]
    # the opted-in ones did exit (at the first allowed exit: depth 1 of 4)
    for r in reqs[1::2]:
        assert r.mean_depth == 1.0 and r.num_depth_tokens == r.num_output_tokens - 1
    assert all(r.mean_depth is None for r in reqs[0::2])


@pytest.mark.parametrize("policy", ["vllm", "laser"])
@pytest.mark.parametrize("min_depth", [None, 2, 3])
def test_min_depth_respected_and_reported(exiting, policy, min_depth):
    exiting.set_policy(policy)
    dd = DynamicDepth(threshold=1e-6, min_depth=min_depth)
    reqs = _run(exiting, PROMPTS, [_greedy(12, dd) for _ in PROMPTS])
    want = dd.min_layers(4)
    assert want == (min_depth or 1)
    for r in reqs:
        assert r.num_output_tokens == 12
        assert r.num_depth_tokens == 11 and r.mean_depth == want
    # the scheduler's expectation for the class follows the depth used
    assert exiting.scheduler.depth_means.expected("best_effort") == want


def test_threshold_one_keeps_full_depth_unless_certain(exiting, plain):
    """threshold 1.0: a token exits only at probability 1 (never, with these random exits): the
    output is the full model's and every token is counted at full depth."""
    exiting.set_policy("vllm")
    plain.set_policy("vllm")
    want = [r.output_token_ids for r in _run(plain, PROMPTS[:2], [_greedy(10)] * 2)]
    reqs = _run(exiting, PROMPTS[:2], [_greedy(10, DynamicDepth(threshold=1.0))] * 2)
    assert [r.output_token_ids for r in reqs] == want
    assert all(r.mean_depth == 4.0 for r in reqs)


@pytest.fixture(scope="module")
def identity_tail(tiny_llama, tmp_path_factory):
    """A model whose layers 2 and 3 add nothing to the residual stream: an exit after 2 layers
    (final norm + LM head) is the full model, and the K/V those layers write is the K/V of the
    exit state, exactly what an early exit fills them with."""
    return _tail_scaled_model(str(tiny_llama), tmp_path_factory.mktemp("tail0"), 0.0, 2)


def _kv_of(engine, req_id, n):
    kvc = engine.kv_cache
    return torch.stack([torch.stack(kvc.export_layer(req_id, l, n)) for l in range(engine.model.config.num_layers)])


@pytest.mark.parametrize("policy", ["vllm", "laser"])
def test_exit_fills_the_skipped_layers_kv(identity_tail, policy):
    """Later tokens read the filled K/V: on a model whose last two layers are the identity, tokens
    that exit after layer 2 produce the full model's output, and the paged K/V of every layer
    (the filled ones included) equals the full model's."""
    ref = _engine(identity_tail, policy=policy)
    ex = _engine(identity_tail, policy=policy)
    ex.runner.set_exits(_heads(ex, [2]))
    ex.inputs.serves_exits = True
    kv = {}

    def run(engine, dd):
        reqs = [engine.add_request(p, _greedy(14, dd), req_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        while engine.has_unfinished():
            for r in reqs:  # the K/V of the computed positions, just before the request finishes
                if r.num_output_tokens == 13 and r.num_computed_tokens == r.num_tokens - 1:
                    kv[(engine is ex, r.req_id)] = _kv_of(engine, r.req_id, r.num_computed_tokens)
            engine.step()
            engine.check_integrity()
        return reqs

    want = run(ref, None)
    got = run(ex, DynamicDepth(threshold=1e-6, min_depth=2))
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert all(r.mean_depth == 2.0 for r in got)
    for r in want:
        a, b = kv[(False, r.req_id)], kv[(True, r.req_id)]
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (r.req_id, (a - b).abs().max())


def test_check_integrity_finds_an_unwritten_slot(exiting):
    """The check can fail: a layer whose K/V of a position was never written is reported as soon
    as a later token reads it."""
    exiting.set_policy("vllm")
    req = exiting.add_request(PROMPTS[0], _greedy(6))
    exiting.step()  # prefill + first token
    exiting.runner._kv_written[req.req_id][3] -= 1  # as if layer 3 of the last position was skipped unfilled
    exiting.step()
    with pytest.raises(AssertionError, match="uninitialised KV slot"):
        exiting.check_integrity()
    exiting.runner.kv_gaps.clear()
    while exiting.has_unfinished():
        exiting.step()


def test_opt_in_validation_and_slo_class(tiny_llama, plain):
    with pytest.raises(InvalidRequestError, match="dynamic_depth.threshold"):
        SamplingParams(temperature=0.0, dynamic_depth={"threshold": 0})
    with pytest.raises(InvalidRequestError, match="dynamic_depth.min_depth"):
        SamplingParams(temperature=0.0, dynamic_depth={"min_depth": 0})
    with pytest.raises(InvalidRequestError, match="dynamic_depth: unknown"):
        SamplingParams(temperature=0.0, dynamic_depth={"treshold": 0.5})
    with pytest.raises(InvalidRequestError, match="greedy"):
        SamplingParams(temperature=0.7, dynamic_depth=True)
    assert SamplingParams(temperature=0.0, dynamic_depth=True).dynamic_depth == DynamicDepth()
    # a server without exit heads refuses the field, naming it
    with pytest.raises(InvalidRequestError, match="dynamic_depth"):
        plain.add_request(PROMPTS[0], _greedy(4, DynamicDepth()))
    # an SLO class the operator opts in: its plain-greedy requests get the class's rule
    classes = SLOClasses({"fast": {"ttft": None, "tbt": None, "tier": "best_effort",
                                   "dynamic_depth": {"threshold": 1e-6, "min_depth": 3}}})
    e = _engine(tiny_llama, slo_classes=classes)
    e.runner.set_exits(_heads(e, [1, 2, 3]))
    e.inputs.serves_exits = True
    reqs = [e.add_request(PROMPTS[0], _greedy(8), slo="fast"),
            e.add_request(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.8, seed=1), slo="fast"),
            e.add_request(PROMPTS[2], _greedy(8), slo="best_effort")]
    while e.has_unfinished():
        e.step()
    e.check_integrity(expect_empty=True)
    assert reqs[0].mean_depth == 3.0
    assert reqs[1].sampling_params.dynamic_depth is None and reqs[1].mean_depth is None  # sampled: full depth
    assert reqs[2].mean_depth is None
    with pytest.raises(ValueError, match="dynamic_depth"):
        SLOClasses({"x": {"ttft": None, "tbt": None, "dynamic_depth": {"threshold": 2}}})


def test_alg1_fewer_layer_slots_for_a_shallow_request():
    """Alg. 1's load model (the layer slots a plan occupies) counts a request with an expected
    depth below N at that depth, and so relaxes fewer requests to hold T_g."""
    from laser.latency import SimpleLatencyModel
    from laser.scheduler.laser.decode import DecodePlan, _LayerLoad, exec_plan

    class R:
        def __init__(self, rid, tbt, depth=None):
            self.req_id, self.num_tokens, self.slo = rid, 200, SLO(ttft=None, tbt=tbt)
            self.expected_layers, self.masked = depth, False

    lm = SimpleLatencyModel(num_layers=30, per_layer=1e-4, per_token=1e-3)
    n = 30
    full = [R("a", 0.05), R("b", 1.0), R("c", 1.0)]
    plans = {r.req_id: DecodePlan(n, 0) for r in full}
    load_full = _LayerLoad(lm, n, 0, full, plans)
    shallow = [R("a", 0.05), R("b", 1.0, depth=12.4), R("c", 1.0)]
    load_shallow = _LayerLoad(lm, n, 0, shallow, plans)
    assert expected_layers(shallow[1], n) == 13
    assert load_full.slots() == 3 * n * load_full.HORIZON
    assert load_shallow.slots() == (2 * n + 13) * load_full.HORIZON
    assert load_shallow.predict() < load_full.predict()
    # Alg. 1: T_g just below what three full-depth requests take: the full-depth set must cut
    # a relaxed request's layers; with one expected at 13 layers the iteration fits uncut
    t3 = load_full.predict()
    t_shallow = load_shallow.predict()
    for r in full + shallow:
        r.slo = SLO(ttft=None, tbt=(t3 + t_shallow) / 2 if r.req_id == "a" else 1.0)
    got_full, tg, _ = exec_plan(lm, n, 0, full, {})
    got_shallow, _, load = exec_plan(lm, n, 0, shallow, {})
    assert math.isfinite(tg)
    assert any(p.layers < n for p in got_full.values())
    assert all(p.layers == n for p in got_shallow.values())
    assert load.slots() == (2 * n + 13) * load.HORIZON


def test_http_field_usage_and_errors(tiny_llama):
    """Through the OpenAI-compatible server: ``dynamic_depth`` in the body, the mean layers in
    ``usage.dynamic_depth``; a bad value is a 400 naming the field, and the server still serves."""
    import httpx

    from laser.frontend.async_engine import AsyncEngine
    from laser.server.app import build_app
    from laser.server.cli import LiveServer

    e = _engine(tiny_llama, max_model_len=256)
    e.runner.set_exits(_heads(e, [1, 2, 3]))
    e.inputs.serves_exits = True
    srv = LiveServer(build_app(AsyncEngine(e), served_model_names=["tiny"]))
    try:
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json={**body, "dynamic_depth": {"threshold": 1e-6, "min_depth": 2}},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["dynamic_depth"] == {"decode_tokens": 5, "mean_layers": 2.0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and "dynamic_depth" not in r.json()["usage"]
        for bad in ({"threshold": 1.5}, {"min_depth": -1}, "yes"):
            r = httpx.post(srv.url + "/v1/completions", json={**body, "dynamic_depth": bad}, timeout=60)
            assert r.status_code == 400, (bad, r.text)
            assert "dynamic_depth" in r.text
        r = httpx.post(srv.url + "/v1/completions", json={**body, "temperature": 0.5, "dynamic_depth": True},
                       timeout=60)
        assert r.status_code == 400 and "greedy" in r.text
        r = httpx.post(srv.url + "/v1/completions", json={**body, "dynamic_depth": True}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    e.check_integrity(expect_empty=True)


@pytest.mark.parametrize("policy", ["vllm", "laser"])
def test_simulator_exits_and_plans_with_expected_depth(policy):
    """The simulator runs the engine's walker and scheduler with exits drawn from a depth
    histogram: opted-in tokens run the drawn layers (mean depth reported), cost less virtual time,
    and the scheduler's expectation (the class's running mean) follows; the others are unchanged."""
    from laser.latency import SimpleLatencyModel
    from laser.sim.instance import SimDepth, SimInstance

    n = 12
    lm = SimpleLatencyModel(num_layers=n, per_layer=1e-3, per_token=1e-5)
    dm = SimDepth(((4, 1.0), (8, 1.0), (n, 1.0)), frozenset({4, 8}), head_fraction=0.1, fill_fraction=0.05)

    def run(opt: bool, depth_model):
        sim = SimInstance(policy, n, lm, depth_model=depth_model)
        reqs = []
        for i in range(6):
            dd = DynamicDepth(threshold=0.5, min_depth=3) if opt and i % 2 else None
            reqs.append(Request([1] * (10 + i), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                              dynamic_depth=dd),
                                SLO(ttft=None, tbt=0.05 if i % 2 == 0 else 0.5, name="c%d" % (i % 2)),
                                arrival_time=0.01 * i, req_id=f"r{i}"))
        for r in reqs:
            sim.submit(r)
        sim.run()
        sim.check_integrity(expect_empty=True)
        return sim, reqs

    from laser.core.request import Request

    base, plain = run(False, dm)
    sim, reqs = run(True, dm)
    none_sim, none_reqs = run(False, None)
    assert [r.token_times for r in plain] == [r.token_times for r in none_reqs]  # no opt-in: as before
    opted = reqs[1::2]
    for r in opted:
        assert r.num_depth_tokens == 39 and 4 <= r.mean_depth < n
    mean = sum(r.depth_layers for r in opted) / sum(r.num_depth_tokens for r in opted)
    assert abs(mean - 8) < 1.5  # draws of 4, 8, 12 with equal weight
    assert sim.scheduler.depth_means.expected("c1") == pytest.approx(mean)
    assert sim.stats.busy_s < base.stats.busy_s


def test_laser_reduced_plans_with_exits_simulated():
    """Laser with a strict class that makes Alg. 1 cut the relaxed class to fewer layers per
    iteration: relaxed requests that opt in exit mid-cycle, restart their next token at once
    (their plan's offset moves) and so get their tokens in fewer iterations than without exits;
    the strict class is served as before or better."""
    from laser.core.request import Request
    from laser.latency import SimpleLatencyModel
    from laser.sim.instance import SimDepth, SimInstance

    n = 12
    lm = SimpleLatencyModel(num_layers=n, per_layer=2e-3, per_token=2e-4)
    dm = SimDepth(((4, 1.0),), frozenset({4, 8}))

    def run(opt: bool):
        sim = SimInstance("laser", n, lm, depth_model=dm, record_plans=True)
        reqs = []
        for i in range(8):
            strict = i < 2
            dd = DynamicDepth(threshold=0.5, min_depth=3) if opt and not strict else None
            reqs.append(Request([1] * 20, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                         dynamic_depth=dd),
                                SLO(ttft=None, tbt=0.035 if strict else 1.0, name="strict" if strict else "loose"),
                                arrival_time=0.0, req_id=f"r{i}"))
        for r in reqs:
            sim.submit(r)
        sim.run()
        sim.check_integrity(expect_empty=True)
        return sim, reqs

    def gap(rs):
        return sum(r.token_times[-1] - r.token_times[0] for r in rs) / sum(len(r.token_times) - 1 for r in rs)

    base, plain = run(False)
    sim, reqs = run(True)
    # Alg. 1 cut the loose requests in the run without exits
    assert any(w.layer_end - w.layer_start < n and w.num_tokens == 1 for p in base.stats.plans for w in p.works)
    assert all(r.mean_depth == 4.0 for r in reqs[2:])
    assert any(w.layer_end - w.layer_start < n and w.num_tokens == 1 for p in sim.stats.plans for w in p.works)
    # every token exits after 4 layers, inside its first group: the next token starts in the very
    # next iteration (the plan restarts), so a loose request decodes in consecutive steps
    for r in reqs[2:]:
        steps = [i for i, p in enumerate(sim.stats.plans)
                 if any(w.req_id == r.req_id and w.num_tokens == 1 and w.token_start >= 20 for w in p.works)]
        assert steps == list(range(steps[0], steps[-1] + 1)), r.req_id
    assert gap(reqs[2:]) < 0.8 * gap(plain[2:])
    assert gap(reqs[:2]) <= gap(plain[:2]) * 1.001
