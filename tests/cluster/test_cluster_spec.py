"""Self-speculative decoding and lossy dynamic depth on prefill/decode clusters (issue 31 items 2
and 3): the decode instances build the same executor as a single engine
(:class:`laser.instance.model_instance.ModelInstance`), a request handed off from prefill to
decode then decodes speculatively, and its greedy fp32 output equals the same cluster's without
speculation -- also when the decode instance dies mid-stream. Tiny random model, tiny exits
trained in seconds; in-process instances, plus one 1P1D cluster on real Ray.
"""

from __future__ import annotations

import pytest

from laser.cluster.launch import start_cluster
from laser.core.config import CacheConfig, ConfigError, SchedulerConfig
from laser.core.request import InvalidRequestError, SamplingParams
from laser.frontend.engine import Engine
from laser.model.exits import train_exits
from laser.spec import SpeculativeConfig

SCHED = SchedulerConfig(max_num_batched_tokens=64)
CACHE = CacheConfig(num_blocks=128)
PROMPTS = [[5, 17, 300, 42, 9], [77, 3, 1000, 2048, 11, 12, 13, 14, 15, 16, 17, 18, 19], [401, 402],
           list(range(100, 140))]
GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 11, 20, 7)]


@pytest.fixture(scope="module")
def exits_file(tiny_llama, tmp_path_factory):
    """Exits after layers 1 and 2 (of 4), trained for a few seconds on two prompts, in a file."""
    eng = Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CACHE, latency_calibration=False)
    heads = train_exits(eng, [1, 2], gen_tokens=8, vocab_size=256, rank=8, epochs=4, batch=16, lr=1e-2,
                        progress=False, prompts=([PROMPTS[0], PROMPTS[1]], [PROMPTS[2]]))
    path = tmp_path_factory.mktemp("exits") / "tiny.pt"
    heads.save(path, "tiny")
    return str(path)


def _cluster(tiny_llama, speculative=None, exits=None, use_ray=False, **kw):
    return start_cluster("distserve", 1, 1, model=str(tiny_llama), dtype="float32", cache=CACHE, scheduler=SCHED,
                         latency_calibration=False, use_ray=use_ray, call_timeout_s=30.0, speculative=speculative,
                         exits=exits, **kw)


def _run(cl, sps=GREEDY, prompts=PROMPTS, kill_decode_at: int | None = None):
    """Serve ``prompts``; each request's tokens as streamed (a token streamed twice shows)."""
    reqs = [cl.add_request(p, sp, req_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, sps))]
    streams: dict[str, list[int]] = {}
    finals = {}
    steps = 0
    while cl.has_unfinished():
        steps += 1
        if steps == kill_decode_at:
            next(h for h in cl.handles.values() if h.role == "decode").kill()
        for o in cl.step():
            streams.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.req_id] = o
    cl.check_integrity(expect_empty=True)
    for r in reqs:
        assert streams[r.req_id] == finals[r.req_id].token_ids
    return [finals[r.req_id] for r in reqs]


def _spec(exits_file):
    return SpeculativeConfig("self", exit_layer=2, draft_tokens=3, exits_path=exits_file)


def test_decode_instance_speculates_and_output_is_unchanged(tiny_llama, exits_file):
    """1P1D in process: the decode instance drafts and verifies (several tokens per step), the
    prefill instance does not speculate, the tokens equal the cluster's without speculation."""
    plain = _cluster(tiny_llama)
    want = [o.token_ids for o in _run(plain)]
    cl = _cluster(tiny_llama, _spec(exits_file))
    workers = {h.role: h.worker for h in cl.handles.values()}
    assert workers["prefill"].mi.speculator is None
    spec = workers["decode"].mi.speculator
    assert spec is not None and workers["decode"].core.executor is spec
    got = [o.token_ids for o in _run(cl)]
    assert got == want
    assert spec.stats.steps > 0 and spec.stats.emitted > spec.stats.steps  # drafts were accepted
    assert cl.stats.transfers == len(PROMPTS)  # every request was handed off, then speculated


@pytest.mark.parametrize("kill_at", [3, 6])
def test_decode_instance_dies_while_speculating(tiny_llama, exits_file, kill_at):
    """The decode instance dies mid-stream: the prefill instance serves as mixed and every
    request completes with the tokens of the cluster without speculation, none streamed twice."""
    want = [o.token_ids for o in _run(_cluster(tiny_llama))]
    cl = _cluster(tiny_llama, _spec(exits_file))
    got = [o.token_ids for o in _run(cl, kill_decode_at=kill_at)]
    assert got == want
    assert cl.stats.instance_failures == 1


def test_dynamic_depth_on_a_cluster(tiny_llama, exits_file):
    """Exits given to the cluster: a request opting in exits early on the decode instance, the
    front end reports its depth as a single engine does (same tokens, same depth), a request not
    opting in is unchanged; without exits the cluster refuses the field (400 naming it)."""
    dd = {"threshold": 0.05, "min_depth": 1}
    sps = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, dynamic_depth=dd),
           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    prompts = PROMPTS[:2]
    single = Engine(str(tiny_llama), policy="vllm", dtype="float32", cache=CACHE, scheduler=SCHED,
                    latency_calibration=False, exits=exits_file)
    reqs = [single.add_request(p, sp) for p, sp in zip(prompts, sps)]
    while single.has_unfinished():
        single.step()
    cost = single.latency_model.exit_cost  # the plans price exits with these heads' checks
    assert cost.exit_layers == {1, 2} and 0 < cost.head_fraction < 1 and 0 < cost.fill_fraction < 1
    cl = _cluster(tiny_llama, exits=exits_file)
    assert all(h.latency_model.exit_cost == cost for h in cl.handles.values())
    outs = _run(cl, sps, prompts)
    assert [o.token_ids for o in outs] == [r.output_token_ids for r in reqs]
    deep = outs[0]
    assert deep.num_depth_tokens == reqs[0].num_depth_tokens == 11  # decode tokens (the first is prefill's)
    assert deep.mean_depth == pytest.approx(reqs[0].mean_depth) and deep.mean_depth < 4
    assert outs[1].num_depth_tokens == 0 and outs[1].mean_depth is None
    with pytest.raises(InvalidRequestError, match="dynamic_depth"):
        _cluster(tiny_llama).add_request(prompts[0], sps[0])


def test_cluster_refuses_speculation_it_cannot_run(tiny_llama, exits_file, tmp_path):
    """Refused before any instance starts: missing exits."""
    with pytest.raises(ConfigError, match="no trained exits"):
        _cluster(tiny_llama, SpeculativeConfig("self", 2, 3, str(tmp_path / "none.pt")))
    with pytest.raises(ConfigError, match="no trained exits"):
        _cluster(tiny_llama, exits=str(tmp_path / "none.pt"))


def test_ray_1p1d_speculates(tiny_llama, exits_file):
    """1P1D on real Ray actors with ``--speculative self``: the tokens equal the same cluster's
    without speculation (in process: the same workers), the decode actor speculated."""
    ray = pytest.importorskip("ray")
    from laser.cluster import ray_actors

    want = [o.token_ids for o in _run(_cluster(tiny_llama))]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, log_to_driver=False)
    try:
        cl = _cluster(tiny_llama, _spec(exits_file), use_ray=True, threads_per_instance=1)
        got = [o.token_ids for o in _run(cl)]
        dec = next(h for h in cl.handles.values() if h.role == "decode")
        stats = ray.get(dec.actor.__ray_call__.remote(lambda w: w.mi.speculator.stats), timeout=30)
    finally:
        ray_actors.shutdown()
    assert got == want
    assert stats.steps > 0 and stats.emitted > stats.steps
