"""Automatic prefix caching under layer-level scheduling (laser.block_manager, issue 29).

With greedy sampling in fp32 a request's output does not depend on a cache hit: it is the same
with the cache on and off, for every policy, whatever its prompt shares with earlier ones (0, 1,
many, all blocks; ending on a block boundary or one token past it) and wherever it is paused. A
block is shared only once every layer wrote it; eviction never takes a block in use; a preempted
request re-finds its own blocks without counting a hit."""

from __future__ import annotations

import pytest

from laser.block_manager import BlockManager, BlockManagerIntegrityError, OutOfBlocksError
from laser.config import CacheConfig, SchedulerConfig
from laser.engine import Engine
from laser.latency import SimpleLatencyModel
from laser.request import SLO, SamplingParams

BS = 16  # block size of the engines below
GREEDY = dict(temperature=0, ignore_eos=True)


class FakeClock:
    def __init__(self, tick: float = 2e-4):
        self.t = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached_engine(tiny_llama):
    return Engine(str(tiny_llama), policy="vllm", dtype="float32")


REF: dict = {}


def alone(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Greedy output of ``prompt`` run alone with the cache off."""
    key = (tuple(prompt), n)
    if key not in REF:
        engine.reconfigure(SchedulerConfig(policy="vllm", max_num_batched_tokens=4096), None, clock=FakeClock())
        req = engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))
        while engine.has_unfinished():
            engine.step()
        REF[key] = req.output_token_ids
    return REF[key]


def run(engine: Engine, prompts: list[list[int]], n: int, policy: str, budget: int = 4096, lm=None,
        stop_at=None, stagger: bool = False) -> list:
    """Run ``prompts`` on ``engine`` (arrivals one step apart with ``stagger``); returns the requests."""
    engine.reconfigure(SchedulerConfig(policy=policy, max_num_batched_tokens=budget), lm, clock=FakeClock())
    if stop_at is not None:
        engine.scheduler.stop_at = stop_at
    reqs, pending = [], list(prompts)
    while pending or engine.has_unfinished():
        if pending:
            reqs.append(engine.add_request(pending.pop(0), SamplingParams(max_tokens=n, **GREEDY),
                                           SLO(ttft=0.05, tbt=0.02, name="chat")))
            if stagger:
                engine.step()
                continue
        engine.step()
    engine.check_integrity(expect_empty=True)
    return reqs


LM = SimpleLatencyModel(num_layers=4, per_layer=1e-3, per_token=2e-5, per_context=1e-6)
BASE = [(i * 37 + 11) % 500 + 3 for i in range(5 * BS)]  # 5 blocks


def family():
    """Prompts sharing 0, 1, many and all blocks with BASE, ending on a block boundary and one past."""
    other = [(i * 53 + 7) % 500 + 3 for i in range(3 * BS + 5)]
    return [
        BASE,  # 5 full blocks: publishes them
        other,  # shares nothing
        BASE[:BS] + other[:20],  # shares 1 block
        BASE[: 4 * BS] + other[:9],  # shares many
        list(BASE),  # all blocks; ends on a boundary (the last token is recomputed)
        BASE + [5],  # all blocks and one token past
        BASE[: 3 * BS],  # a prefix of BASE ending on a boundary
        BASE[: 3 * BS + 1],  # ... and one past it
    ]


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
@pytest.mark.parametrize("stagger", [False, True])
def test_outputs_identical_with_and_without_cache(cached_engine, ref_engine, policy, stagger):
    cached_engine.kv_cache.block_manager.reset_prefix_cache()
    prompts = family()
    reqs = run(cached_engine, prompts, 6, policy, budget=24, lm=LM, stagger=stagger)
    for p, r in zip(prompts, reqs):
        assert r.output_token_ids == alone(ref_engine, p, 6), (policy, len(p))
    sched = cached_engine.scheduler
    assert sched.prefix_cache_queries == sum(map(len, prompts))
    if stagger:  # each request arrives after the ones before it published their blocks
        hits = [r.num_cached_tokens for r in reqs]
        assert hits == [0, 0, BS, 4 * BS, 4 * BS, 5 * BS, 2 * BS, 3 * BS], hits
        assert sched.prefix_cache_hits == sum(hits)
