"""Automatic prefix caching under layer-level scheduling (laser.core.block_manager, issue 29).

With greedy sampling in fp32 a request's output does not depend on a cache hit: it is the same
with the cache on and off, for every policy, whatever its prompt shares with earlier ones (0, 1,
many, all blocks; ending on a block boundary or one token past it) and wherever it is paused. A
block is shared only once every layer wrote it; eviction never takes a block in use; a preempted
request re-finds its own blocks without counting a hit."""

from __future__ import annotations

import pytest

from laser.core.block_manager import BlockManager, BlockManagerIntegrityError, OutOfBlocksError
from laser.core.config import CacheConfig, SchedulerConfig
from laser.frontend.engine import Engine
from laser.latency import SimpleLatencyModel
from laser.core.request import SLO, SamplingParams
from simutil import FakeClock

BS = 16  # block size of the engines below
GREEDY = dict(temperature=0, ignore_eos=True)




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


@pytest.mark.parametrize("k", [1, 2, 3])
def test_paused_request_keeps_its_blocks_private(cached_engine, ref_engine, k):
    """A prefill paused at layer k has KV at layers < k only: a second request with the same
    prompt arriving then finds nothing cached -- it computes its own KV, or (held back while the
    first completes) reuses the first's blocks only once every layer has written them -- and both
    get the output they get alone."""
    bm = cached_engine.kv_cache.block_manager
    bm.reset_prefix_cache()
    cached_engine.reconfigure(SchedulerConfig(policy="laser", max_num_batched_tokens=4096), LM, clock=FakeClock())
    sched = cached_engine.scheduler
    orig, stops = sched.stop_at, []

    def stop_once(j):
        if not stops and j == k:
            stops.append(j)
            return True
        return orig(j)

    sched.stop_at = stop_once
    prompt = BASE[: 3 * BS + 4]
    sp = SamplingParams(max_tokens=5, **GREEDY)
    a = cached_engine.add_request(prompt, sp)
    cached_engine.step()
    assert stops == [k] and a.in_flight and a.next_layer == k and a.num_computed_tokens == 0
    assert bm.num_cached_blocks == 0  # nothing published before every layer wrote it
    b = cached_engine.add_request(list(prompt), sp)
    assert b.num_computed_tokens == 0
    while cached_engine.has_unfinished():
        cached_engine.step()
        cached_engine.check_integrity()
        if b.num_cached_tokens:  # a hit: only on blocks a published after its last layer wrote them
            assert a.num_computed_tokens >= len(prompt), (a.num_computed_tokens, b.num_cached_tokens)
    assert b.num_cached_tokens in (0, 3 * BS) and sched.prefix_cache_hits == b.num_cached_tokens
    want = alone(ref_engine, prompt, 5)
    assert a.output_token_ids == want and b.output_token_ids == want
    c = cached_engine.add_request(list(prompt), sp)  # now every layer has them
    while cached_engine.has_unfinished():
        cached_engine.step()
    assert c.num_cached_tokens == 3 * BS and c.output_token_ids == want
    cached_engine.check_integrity(expect_empty=True)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pause_at_every_layer_on_a_cached_prefix(cached_engine, ref_engine, k):
    """A request that attached a cached prefix and is paused at layer k resumes correctly (its
    chunk starts past the prefix: the masked attention path over shared blocks)."""
    bm = cached_engine.kv_cache.block_manager
    bm.reset_prefix_cache()
    first = BASE[: 2 * BS + 3]
    run(cached_engine, [first], 3, "laser", lm=LM)
    cached_engine.reconfigure(SchedulerConfig(policy="laser", max_num_batched_tokens=4096), LM, clock=FakeClock())
    sched = cached_engine.scheduler
    orig = sched.stop_at
    sched.stop_at = lambda j: j == k or orig(j)  # every step with a prefill pauses at k
    prompt = BASE[: 4 * BS + 7]
    r = cached_engine.add_request(prompt, SamplingParams(max_tokens=4, **GREEDY))
    while cached_engine.has_unfinished():
        cached_engine.step()
        cached_engine.check_integrity()
    assert r.num_cached_tokens == 2 * BS
    assert r.output_token_ids == alone(ref_engine, prompt, 4)
    cached_engine.check_integrity(expect_empty=True)


def test_eviction_under_pressure_recomputes_and_spares_blocks_in_use(tiny_llama, ref_engine):
    """A pool of 12 blocks per layer: a long prompt evicts cached blocks no one holds (never one in
    use), and the prompt whose prefix was evicted is recomputed to the same output."""
    eng = Engine(str(tiny_llama), policy="sarathi", dtype="float32", cache=CacheConfig(num_blocks=12, block_size=BS))
    bm = eng.kv_cache.block_manager
    x = BASE[: 4 * BS + 2]
    y = [(i * 29 + 5) % 500 + 3 for i in range(8 * BS)]
    for policy in ("sarathi", "vllm", "laser"):
        bm.reset_prefix_cache()
        (rx,) = run(eng, [x], 4, policy, budget=32, lm=LM)  # publishes 4 blocks (5 held while decoding)
        assert bm.num_cached_blocks >= 4 and bm.num_evictable == bm.num_cached_blocks
        # x again beside y: x attaches its 4 cached blocks; y needs 9, only 12 - 4 - 1 = 7 are
        # free or evictable besides them, so y waits until x finishes -- no block in use evicted
        eng.reconfigure(SchedulerConfig(policy=policy, max_num_batched_tokens=32), LM, clock=FakeClock())
        sp = SamplingParams(max_tokens=4, **GREEDY)
        rx2 = eng.add_request(list(x), sp)
        ry = eng.add_request(y, sp)
        while eng.has_unfinished():
            before = {rid: (list(bm.canonical_table(rid)), [b for b in bm.canonical_table(rid) if b in bm._hash_of])
                      for rid in eng.scheduler.requests if bm.has(rid)}
            eng.step()
            for rid, (table, shared) in before.items():  # a block in use is never taken away
                if bm.has(rid):
                    assert bm.canonical_table(rid)[: len(table)] == table
                    assert all(b in bm._hash_of for b in shared)
            eng.check_integrity()
        assert rx2.num_cached_tokens == 4 * BS
        assert bm.num_evictions > 0  # y took the evictable blocks
        # x's prefix was evicted (y's blocks took the pool): recomputed, same output
        (rx3,) = run(eng, [list(x)], 4, policy, budget=32, lm=LM)
        assert rx3.num_cached_tokens < 4 * BS  # the tail of x's chain went first
        want = alone(ref_engine, x, 4)
        assert rx.output_token_ids == rx2.output_token_ids == rx3.output_token_ids == want
        assert ry.output_token_ids == alone(ref_engine, y, 4)
        eng.check_integrity(expect_empty=True)


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
def test_preempted_request_refinds_its_own_blocks_without_a_hit(cached_engine, ref_engine, policy):
    bm = cached_engine.kv_cache.block_manager
    bm.reset_prefix_cache()
    cached_engine.reconfigure(SchedulerConfig(policy=policy, max_num_batched_tokens=4096), LM, clock=FakeClock())
    sched = cached_engine.scheduler
    prompt = BASE[: 3 * BS + 5]
    r = cached_engine.add_request(prompt, SamplingParams(max_tokens=20, **GREEDY))
    while r.num_output_tokens < 14:  # 3 * 16 + 5 + 13 = 66 tokens computed: 4 full blocks
        cached_engine.step()
    assert r.num_cached_tokens == 0 and sched.prefix_cache_hits == 0
    sched.preempt(r)
    assert r.num_computed_tokens == 4 * BS  # found again at once (priced as such)
    while cached_engine.has_unfinished():
        cached_engine.step()
        cached_engine.check_integrity()
    assert sched.prefix_cache_hits == 0 and r.num_cached_tokens == 0
    assert sched.prefix_cache_refound == 4 * BS
    assert sched.prefix_cache_queries == len(prompt)
    assert r.output_token_ids == alone(ref_engine, prompt, 20)
    cached_engine.check_integrity(expect_empty=True)


# -- the block manager alone (no model) ---------------------------------------------------------------
def _hashes(bm: BlockManager, tokens: list[int]) -> list[bytes]:
    return bm.block_hashes([], tokens)


def test_hash_chain_names_the_whole_prefix_and_the_salt():
    a, b = BlockManager(2, 8, 4, enable_prefix_caching=True), BlockManager(2, 8, 4, enable_prefix_caching=True, cache_salt="other model")
    t = list(range(12))
    h = _hashes(a, t)
    assert len(h) == 3 and len(set(h)) == 3
    assert _hashes(a, t[:8] + [99, 99, 99, 99])[:2] == h[:2]  # same prefix, same hashes
    assert _hashes(a, [7] + t[1:])[1:] != h[1:]  # a change in block 0 changes every later hash
    assert _hashes(b, t)[0] != h[0]  # another salt: another chain
    assert _hashes(a, t[:11]) == h[:2]  # only full blocks


def test_publish_attach_release_evict_and_integrity():
    bm = BlockManager(3, 6, 4, enable_prefix_caching=True)
    t = list(range(10))
    h = _hashes(bm, t)
    bm.allocate("a", 10)
    bm.cache_blocks("a", h, 3)  # less than a block at every layer: nothing
    assert bm.num_cached_blocks == 0
    bm.cache_blocks("a", h, 8)
    assert bm.num_cached_blocks == 2 and bm.cached_prefix_blocks(h, 9) == 2
    assert bm.cached_prefix_blocks(h, 7) == 1  # at most max_tokens
    bm.check_integrity()
    assert bm.can_allocate("b", 10, prefix=h[:2])
    bm.allocate("b", 10, prefix=h[:2])  # shares a's 2 blocks, 1 of its own
    assert bm.table("b", 0)[:2] == bm.table("a", 0)[:2] and bm.num_free(0) == 2
    bm.check_integrity()
    bm.free("a")
    bm.check_integrity()
    assert bm.num_evictable == 0  # b still holds them
    bm.free("b")
    assert bm.num_evictable == 2 and bm.num_free(1) == 6
    bm.check_integrity(expect_empty=True)
    # a full pool evicts them, the chain's tail first
    tail = bm._by_hash[h[1]]
    bm.allocate("c", 4 * 4 + 1)
    assert bm.num_evictions == 1 and bm.cached_prefix_blocks(h, 9) == 1 and tail in bm.table("c", 2)
    bm.check_integrity()
    assert not bm.can_allocate("d", 8, prefix=h[:2])  # its prefix is gone
    with pytest.raises(OutOfBlocksError):
        bm.allocate("d", 8, prefix=h[:2])
    bm.check_integrity()


def test_blocks_in_use_are_never_evicted():
    bm = BlockManager(2, 4, 4, enable_prefix_caching=True)
    h = _hashes(bm, list(range(8)))
    bm.allocate("a", 8)
    bm.cache_blocks("a", h, 8)
    bm.free("a")
    bm.allocate("b", 8, prefix=h)  # holds both published blocks
    assert bm.num_free(0) == 2 and not bm.can_allocate("c", 12)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("c", 12)
    bm.allocate("c", 8)  # the two free ones
    assert set(bm.table("b", 0)) == {bm._by_hash[x] for x in h} and bm.num_evictions == 0
    bm.check_integrity()


def test_per_layer_blocks_stay_private():
    """A request holding different ids at some layer, or one that released a layer, publishes
    nothing: a shared block holds the same id, written, at every layer."""
    bm = BlockManager(2, 3, 4, enable_prefix_caching=True)
    h = _hashes(bm, list(range(8)))
    bm.allocate("z", 4)
    bm.allocate("a", 8, range(0, 1))
    bm.allocate("y", 4, range(1, 2))  # takes one of a's layer-0 ids at layer 1
    bm.free("z")
    bm.allocate("a", 8)  # so a's ids at layer 1 differ from layer 0
    assert bm.overridden_layers("a")
    bm.cache_blocks("a", h, 8)
    assert bm.num_cached_blocks == 0
    bm.free("a")
    bm.free("y")
    bm.allocate("b", 8)
    bm.free_layer("b", 1)
    bm.cache_blocks("b", h, 8)
    assert bm.num_cached_blocks == 0
    bm.check_integrity()


def test_integrity_catches_refcount_and_hash_map_corruption():
    bm = BlockManager(2, 4, 4, enable_prefix_caching=True)
    h = _hashes(bm, list(range(8)))
    bm.allocate("a", 8)
    bm.cache_blocks("a", h, 8)
    bm.check_integrity()
    b0 = bm._by_hash[h[0]]
    bm._ref[b0] += 1
    with pytest.raises(BlockManagerIntegrityError, match="references"):
        bm.check_integrity()
    bm._ref[b0] -= 1
    bm._by_hash[h[1]] = b0
    with pytest.raises(BlockManagerIntegrityError, match="hash map"):
        bm.check_integrity()


def test_caching_off_publishes_nothing():
    bm = BlockManager(2, 4, 4, enable_prefix_caching=False)
    h = _hashes(bm, list(range(8)))
    bm.allocate("a", 8)
    bm.cache_blocks("a", h, 8)
    assert bm.num_cached_blocks == 0 and bm.cached_prefix_blocks(h, 8) == 0
    bm.free("a")
    bm.check_integrity(expect_empty=True)


@pytest.mark.parametrize("policy", ["vllm", "sarathi", "laser"])
def test_queue_is_priced_by_tokens_left_to_compute(cached_engine, policy):
    """A waiting request with a cached prefix is priced by the tokens it still has to compute:
    in the admission snapshot's queue, and by Laser's slack (``prefill_alone``)."""

    bm = cached_engine.kv_cache.block_manager
    bm.reset_prefix_cache()
    run(cached_engine, [BASE], 2, policy, lm=LM)
    cached_engine.reconfigure(SchedulerConfig(policy=policy), LM, clock=FakeClock())
    sched = cached_engine.scheduler
    prompt = BASE[: 4 * BS] + [5, 6, 7]
    r = cached_engine.add_request(prompt, SamplingParams(max_tokens=2, **GREEDY), SLO(ttft=1.0, tbt=0.5))
    assert r.num_computed_tokens == 4 * BS  # found on arrival, before any step
    (entry,) = sched.report(0.0).queue
    assert entry.prefill_tokens == 3 and entry.context_len == len(prompt)
    if policy == "laser":
        assert sched.prefill_alone(r) == LM.predict_prefill(3, context_start=4 * BS)
    while cached_engine.has_unfinished():
        cached_engine.step()
    assert r.num_cached_tokens == 4 * BS
    cached_engine.check_integrity(expect_empty=True)
