"""Batching never changes a request's result (tiny Llama, fp32).

Covers the model runner directly (hand-built StepPlans: layer ranges, pauses, merges,
``stop_at``) and through the engine (prefill batches, chunked prefill mixed with decode
tokens, seeded sampling).
"""

from __future__ import annotations

import pytest
import torch

from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.engine import Engine
from laser.model.runner import ModelRunner
from laser.core.plan import StepPlan, Work
from laser.core.request import Request, SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
# Logits of one request alone and in a batch agree to fp32 rounding, not bit for bit: the layer
# matmuls read their weights in a layout chosen by row count (laser.model.llama.Linear: one row an
# axpy stream, 2-64 rows oneDNN's packed kernel, more rows sgemm), which sum in different orders
# (seen: 1.1e-5 on logits of magnitude ~3 after the tiny model's layers). Greedy tokens stay equal
# (tests/test_invariance.py).
ATOL = 5e-5


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (n,), generator=g).tolist()


PROMPTS = {n: prompt(100 + n, n) for n in (3, 5, 9, 13, 17, 22, 31)}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CacheConfig(num_blocks=256))


@pytest.fixture(scope="module")
def sarathi(tiny_llama):
    cfg = SchedulerConfig(policy="sarathi", max_num_batched_tokens=8)
    return Engine(str(tiny_llama), policy="sarathi", dtype="float32", scheduler=cfg, cache=CacheConfig(num_blocks=256))


@pytest.fixture(autouse=True)
def clean(engine):
    yield
    engine.check_integrity(expect_empty=True)


def record_plans(engine: Engine) -> list[StepPlan]:
    """Record every plan the engine's scheduler makes from now on."""
    plans = []
    orig = engine.scheduler.schedule

    def schedule(now):
        p = orig(now)
        plans.append(p)
        return p

    engine.scheduler.schedule = schedule
    return plans


def unrecord(engine: Engine) -> None:
    engine.scheduler.__dict__.pop("schedule", None)


def generate(engine: Engine, prompts: list[list[int]], sp=None, n: int = 8, add_later=()) -> list[list[int]]:
    """Run ``prompts`` to completion together; ``add_later`` = (step, prompt) pairs added mid-run."""
    sp = sp or SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    sps = sp if isinstance(sp, list) else [sp] * (len(prompts) + len(add_later))
    reqs = [engine.add_request(p, s) for p, s in zip(prompts, sps)]
    later = sorted(add_later)
    step = 0
    while engine.has_unfinished() or later:
        while later and later[0][0] <= step:
            reqs.append(engine.add_request(later.pop(0)[1], sps[len(reqs)]))
        engine.step()
        step += 1
    engine.check_integrity(expect_empty=True)
    for r in reqs:
        assert r.finish_reason == "length"
    return [r.output_token_ids for r in reqs]


_ALONE: dict = {}


def alone(engine: Engine, p: list[int], n: int = 8) -> list[int]:
    key = (tuple(p), n)
    if key not in _ALONE:
        _ALONE[key] = generate(engine, [p], n=n)[0]
    return _ALONE[key]


# -- runner-level helpers ----------------------------------------------------------------------


class Direct:
    """Drives ``engine.runner`` with hand-built plans, allocating blocks itself."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.runner = engine.runner
        self.bm = engine.kv_cache.block_manager
        self.N = engine.model_config.num_layers
        self.reqs: dict[str, Request] = {}

    def add(self, rid: str, ids: list[int], sp: SamplingParams = GREEDY) -> Request:
        self.reqs[rid] = r = Request(list(ids), sp, req_id=rid)
        return r

    def run(self, works: list[Work], **kw):
        for w in works:
            self.bm.allocate(w.req_id, w.context_len, range(w.layer_start, w.layer_end))
        return self.runner.execute(StepPlan(self.N, works), self.reqs, return_logits=True, **kw)

    def full(self, rid: str, num_tokens: int | None = None) -> Work:
        """Next tokens of ``rid`` (whole remaining prompt, or one decode token) through all layers."""
        r = self.reqs[rid]
        start = r.num_computed_tokens
        n = num_tokens if num_tokens is not None else r.num_tokens - start
        return Work(rid, start, n, 0, self.N, sample=start + n == r.num_tokens)

    def complete(self, rid: str, work: Work, token: int) -> None:
        r = self.reqs[rid]
        r.num_computed_tokens = work.context_len
        r.output_token_ids.append(token)

    def close(self) -> None:
        """End of test: nothing is left paused; release every block."""
        assert len(self.engine.icache) == 0, self.engine.icache.ids()
        self.release()
        self.engine.check_integrity(expect_empty=True)

    def release(self) -> None:
        for rid in self.reqs:
            self.bm.free(rid)
            self.engine.icache.discard(rid)


@pytest.fixture
def direct(engine):
    d = Direct(engine)
    yield d
    d.release()  # also after a failure, so later tests start clean


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=ATOL, rtol=0), float((a - b).abs().max())


# -- (a) prompts of different lengths in one prefill batch ---------------------------------------


def test_mixed_length_prefill_batch_equals_alone(engine, direct):
    lens = [3, 17, 9, 31]
    ps = [PROMPTS[n] for n in lens]
    d = direct
    for i, p in enumerate(ps):
        d.add(f"b{i}", p)
        d.add(f"a{i}", p)
    batched = d.run([d.full(f"b{i}") for i in range(len(ps))])
    assert set(batched.sampled) == {f"b{i}" for i in range(len(ps))}
    for i in range(len(ps)):
        single = d.run([d.full(f"a{i}")])
        assert_close(batched.logits[f"b{i}"], single.logits[f"a{i}"])
        assert batched.sampled[f"b{i}"] == single.sampled[f"a{i}"]
    d.close()

    # end to end: the vllm policy prefills all four in one step, then decodes them together
    plans = record_plans(engine)
    try:
        outs = generate(engine, ps, n=8)
    finally:
        unrecord(engine)
    assert sorted(w.num_tokens for w in plans[0].works) == sorted(lens)
    assert any(len(p.works) == len(ps) and all(w.is_decode for w in p.works) for p in plans)
    for p, o in zip(ps, outs):
        assert o == alone(engine, p)


@pytest.mark.parametrize("max_gather_bytes", [16 << 20, 1])
def test_decode_batch_with_different_context_lengths_equals_alone(engine, direct, max_gather_bytes):
    """Decode tokens of requests at different positions in one layer call (also when the decode
    batch is split into several padded attention groups)."""
    d = direct
    engine.runner.max_gather_bytes = max_gather_bytes
    lens = [5, 22, 13]
    for i, n in enumerate(lens):
        d.add(f"b{i}", PROMPTS[n])
        d.add(f"a{i}", PROMPTS[n])
    for prefix in ("b", "a"):  # prefill each alone
        for i in range(len(lens)):
            w = d.full(f"{prefix}{i}")
            d.complete(w.req_id, w, d.run([w]).sampled[w.req_id])
    for _ in range(4):
        ws = [d.full(f"b{i}") for i in range(len(lens))]
        assert all(w.is_decode for w in ws)
        batched = d.run(ws)
        for i, w in enumerate(ws):
            wa = d.full(f"a{i}")
            single = d.run([wa])
            assert_close(batched.logits[w.req_id], single.logits[wa.req_id])
            assert batched.sampled[w.req_id] == single.sampled[wa.req_id]
            d.complete(w.req_id, w, batched.sampled[w.req_id])
            d.complete(wa.req_id, wa, single.sampled[wa.req_id])
    d.close()
    engine.runner.max_gather_bytes = ModelRunner.max_gather_bytes


# -- (b) chunked prefill mixed with decode tokens ------------------------------------------------


def test_chunks_mixed_with_decodes_equal_alone(engine, sarathi):
    ps = [PROMPTS[5], PROMPTS[13], PROMPTS[22]]
    late = PROMPTS[17]
    plans = record_plans(sarathi)
    try:
        outs = generate(sarathi, ps, n=8, add_later=[(4, late)])
    finally:
        unrecord(sarathi)
    # the schedule really mixed a continuing prefill chunk with decode tokens
    mixed = [
        p for p in plans
        if any(w.is_decode for w in p.works) and any(w.num_tokens > 1 and w.token_start > 0 for w in p.works)
    ]
    assert mixed, [[(w.token_start, w.num_tokens) for w in p.works] for p in plans]
    assert all(sum(w.num_tokens for w in p.works) <= 8 for p in plans)
    for p, o in zip(ps + [late], outs):
        assert o == alone(engine, p)


def test_chunk_with_decode_in_one_layer_call_logits(engine, direct):
    """Runner level: a middle prefill chunk (attending to its earlier chunk's KV) and a decode
    token in one plan give the same logits as each run alone."""
    d = direct
    for prefix in ("b", "a"):
        d.add(prefix + "dec", PROMPTS[9])
        d.add(prefix + "pf", PROMPTS[31])
        w = d.full(prefix + "dec")
        d.complete(w.req_id, w, d.run([w]).sampled[w.req_id])
        w = d.full(prefix + "pf", 12)  # first chunk: no token
        res = d.run([w])
        assert not res.sampled
        d.reqs[w.req_id].num_computed_tokens = 12
    ws = [d.full("bpf", 10), d.full("bdec")]
    batched = d.run(ws)
    assert list(batched.sampled) == ["bdec"]
    for wb, wa in zip(ws, [d.full("apf", 10), d.full("adec")]):
        single = d.run([wa])
        assert_close(batched.logits[wb.req_id], single.logits[wa.req_id])
    d.close()


# -- (c) a request paused after layer l, resumed later (hidden state in the intermediate cache) --


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_paused_request_resumes_exactly(engine, direct, layer):
    d = direct
    N = d.N
    ids = PROMPTS[13]
    d.add("full", ids)
    d.add("split", ids)
    d.add("other", PROMPTS[9])
    d.add("other_ref", PROMPTS[9])
    n = len(ids)
    # prefill: split runs layers [0, layer) and stops; it holds nothing at layers >= layer
    res = d.run([Work("split", 0, n, 0, layer)])
    assert res.stopped_layer == layer and not res.sampled and not res.logits
    assert "split" in engine.icache
    assert [d.bm.num_held("split", j) for j in range(N)] == [1] * layer + [0] * (N - layer)
    ref = d.run([d.full("full")])
    # ...and resumes from the intermediate cache, merged at `layer` with a newcomer that
    # runs every layer
    res = d.run([Work("split", 0, n, layer, N, sample=True), d.full("other")])
    assert "split" not in engine.icache
    assert_close(res.logits["split"], ref.logits["full"])
    assert res.sampled["split"] == ref.sampled["full"]
    other_ref = d.run([d.full("other_ref")])
    assert_close(res.logits["other"], other_ref.logits["other_ref"])
    d.complete("split", Work("split", 0, n, 0, N), res.sampled["split"])
    d.complete("full", Work("full", 0, n, 0, N), ref.sampled["full"])
    # decode: every token also split at `layer`, in two plans
    for _ in range(5):
        pos = d.reqs["split"].num_computed_tokens
        first = d.run([Work("split", pos, 1, 0, layer)])
        assert first.stopped_layer == layer and not first.sampled
        second = d.run([Work("split", pos, 1, layer, N, sample=True)])
        ref = d.run([d.full("full")])
        assert_close(second.logits["split"], ref.logits["full"])
        assert second.sampled["split"] == ref.sampled["full"]
        d.complete("split", Work("split", pos, 1, 0, N), second.sampled["split"])
        d.complete("full", Work("full", pos, 1, 0, N), ref.sampled["full"])
    d.close()
    assert d.reqs["split"].output_token_ids == alone(engine, ids, 6)


# -- (d) a runner step interrupted by stop_at and resumed ---------------------------------------


@pytest.mark.parametrize("stop", [1, 3])
def test_stop_at_then_resume(engine, direct, stop):
    d = direct
    N = d.N
    for prefix in ("s", "r"):  # s: stopped then resumed; r: uninterrupted reference
        d.add(prefix + "dec", PROMPTS[22])
        w = d.full(prefix + "dec")
        d.complete(w.req_id, w, d.run([w]).sampled[w.req_id])
        d.add(prefix + "pf", PROMPTS[17])
    asked = []

    def stop_at(j):
        asked.append(j)
        return j == stop

    pf, dec = d.full("spf"), d.full("sdec")
    res = d.run([pf, dec], stop_at=stop_at)
    assert asked == list(range(1, stop + 1))  # asked until it said stop, then no more
    assert res.stopped_layer == stop
    # The stop paused the prefill chunk; the decode token ran on alone and was sampled.
    assert set(res.sampled) == {"sdec"} and set(engine.icache.ids()) == {"spf"}
    assert res.num_layer_calls == N
    assert pf.reached(res.stopped_layer) == stop and dec.reached(res.stopped_layer) == N
    resumed = d.run([Work(pf.req_id, pf.token_start, pf.num_tokens, stop, N, pf.sample)])
    assert len(engine.icache) == 0
    ref = d.run([d.full("rpf"), d.full("rdec")])
    assert_close(resumed.logits["spf"], ref.logits["rpf"])
    assert resumed.sampled["spf"] == ref.sampled["rpf"]
    assert_close(res.logits["sdec"], ref.logits["rdec"])
    assert res.sampled["sdec"] == ref.sampled["rdec"]
    d.close()


@pytest.mark.parametrize("stop", [None, 1, 3])
def test_prepared_compositions(engine, direct, stop, monkeypatch):
    """The runner builds a step's attention metadata before its first layer call (``prepare``:
    cache-warm, one burst); a stop changes the batch and the later compositions are built anew,
    so results match an unstopped reference either way."""
    d = direct
    N = d.N
    for prefix in ("s", "r"):  # s: the step under test; r: references run one composition at a time
        for name, n in (("d1", 22), ("d2", 13)):
            d.add(prefix + name, PROMPTS[n])
            w = d.full(prefix + name)
            d.complete(w.req_id, w, d.run([w]).sampled[w.req_id])
        d.add(prefix + "pf", PROMPTS[17])
    events = []
    build, layer = d.runner._build_metadata, engine.model.forward_layer
    monkeypatch.setattr(d.runner, "_build_metadata", lambda *a: events.append("build") or build(*a))
    monkeypatch.setattr(engine.model, "forward_layer", lambda *a: events.append("layer") or layer(*a))
    pos = d.reqs["sd2"].num_computed_tokens
    # two compositions: {d1, d2, pf} on [0, 2), {d1, pf} from 2 (d2 parks there)
    works = [d.full("spf"), d.full("sd1"), Work("sd2", pos, 1, 0, 2)]
    for w in works:
        d.bm.allocate(w.req_id, w.context_len, range(w.layer_start, w.layer_end))
    res = d.runner.execute(StepPlan(N, works), d.reqs, stop_at=(lambda j: j == stop) if stop else None,
                           return_logits=True)
    assert res.stopped_layer == (stop or N)
    if stop is None:  # every build before the first layer call
        assert events.index("layer") > max(i for i, e in enumerate(events) if e == "build")
        assert events.count("build") == 2
    monkeypatch.undo()
    rest = [Work("spf", 0, 17, stop, N, True)] if stop else []
    res2 = d.run(rest + [Work("sd2", pos, 1, 2, N, True)])
    ref = d.run([d.full("rpf"), d.full("rd1"), d.full("rd2")])
    for rid, r in (("spf", res2 if stop else res), ("sd1", res), ("sd2", res2)):
        assert r.sampled[rid] == ref.sampled["r" + rid[1:]]
        assert_close(r.logits[rid], ref.logits["r" + rid[1:]])
    d.close()


# -- seeded sampling ------------------------------------------------------------------------------


def test_seeded_sampling_is_batch_independent(engine, sarathi):
    def seeded(seed=7):
        return SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)

    p = PROMPTS[13]
    solo = generate(engine, [p], sp=seeded())[0]
    assert generate(engine, [p], sp=seeded(8))[0] != solo  # the seed matters: it really samples
    assert solo != alone(engine, p, 10)
    others = [PROMPTS[5], PROMPTS[31], PROMPTS[9]]
    unseeded = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sps = [unseeded, unseeded, seeded(), greedy]
    # batched with unseeded sampling requests (which draw from the shared generator) ...
    outs = generate(engine, [others[0], others[1], p, others[2]], sp=sps)
    assert outs[2] == solo
    # ... and under chunked prefill with different batch compositions at every step
    outs = generate(sarathi, [others[0], p, others[1]], sp=[unseeded, seeded(), unseeded])
    assert outs[1] == solo
    sarathi.check_integrity(expect_empty=True)
