"""Decode->decode migration (PPoPP'26 §8, CONTROLLER.md A8.4, D9) in the cluster simulator:
a decode instance pushed past its KV pool moves requests out and loses none; the trigger
and victim rules on hand-built decode instances."""

from __future__ import annotations

from laser.controller.laser import LaserController
from laser.instance.core import Handoff
from laser.scheduler.migration import migration_victim
from laser.latency import SimpleLatencyModel
from laser.core.request import SLO, Request, SamplingParams
from laser.sim.cluster import ClusterConfig, ClusterSim, ClusterSpec
from laser.sim.cluster_instance import SimClusterInstance

N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=2e-4, per_token=2e-6, per_context=1e-8)


class PinnedDecode(LaserController):
    """Laser, but every request is assigned to the first decode instance at arrival and at the
    hand-off (a skewed placement that pushes that instance past its KV pool); migration keeps
    Alg. 2's real choice."""

    name = "pinned-test"

    def assign_decode(self, info, exclude=()):
        return self.decode[0].instance_id

    def at_handoff(self, info, chosen, now):
        return self.decode[0].instance_id


def _requests(n: int, prompt: int, output: int, slo: SLO) -> list[Request]:
    return [Request([1] * prompt, SamplingParams(max_tokens=output, ignore_eos=True), slo,
                    arrival_time=0.001 * i, req_id=f"m{i}") for i in range(n)]


def test_decode_instance_past_its_kv_pool_moves_requests_out_and_loses_none():
    # 64 blocks of 16 tokens per decode instance; three requests of 100 + 300 tokens end at
    # 25 blocks each: 75 blocks on one instance do not fit, 50 + 25 do
    cfg = ClusterConfig(latency_model=LM, kv_bytes_per_token_layer=4096, num_blocks=64, gpus_per_node=2)
    sim = ClusterSim(PinnedDecode(), ClusterSpec.parse("1P2D"), cfg)
    src, dst = sim.controller.decode
    reqs = _requests(3, 100, 300, SLO(1.0, 0.05, "chat"))
    res = sim.run(reqs)  # checks: every request finished exactly once, every instance empty + consistent
    assert res.migrations >= 1 and src.migrated_out == res.migrations
    assert sum(sim.controller.num_migrated.values()) == res.migrations
    assert sim.controller.num_migrated.get("memory", 0) >= 1
    assert src.scheduler.num_preemptions == 0  # moved out before the pool ran dry: nothing recomputed
    assert dst.scheduler.step_index > 0  # the destination decoded the migrated tokens
    for r in res.requests:
        assert r.finish_reason == "length"
        assert r.num_output_tokens == 300 == len(r.token_times)
        assert all(a < b for a, b in zip(r.token_times, r.token_times[1:]))
    for i in sim.instances:
        i.check_integrity(expect_empty=True)


def test_when_every_decode_instance_fills_migration_and_recompute_lose_nothing():
    # four requests of 25 blocks on two pools of 40: migration moves what fits elsewhere, then
    # Alg. 2 finds no finite destination and the schedulers' recompute preemption is the last resort
    cfg = ClusterConfig(latency_model=LM, kv_bytes_per_token_layer=4096, num_blocks=40, gpus_per_node=2)
    sim = ClusterSim(PinnedDecode(), ClusterSpec.parse("1P2D"), cfg)
    res = sim.run(_requests(4, 100, 300, SLO(1.0, 0.05, "chat")))
    assert res.migrations >= 1
    assert sum(d.scheduler.num_preemptions for d in sim.controller.decode) >= 1
    assert all(r.num_output_tokens == 300 == len(r.token_times) for r in res.requests)
    for i in sim.instances:
        i.check_integrity(expect_empty=True)


def _decode_instance(num_blocks: int, contexts: list[int], tbt: float | None = None) -> SimClusterInstance:
    inst = SimClusterInstance(0, "decode", "laser", LM, num_blocks, block_size=16, icache_tokens=2048)
    core = inst.sim
    for k, ctx in enumerate(contexts):
        r = Request([1] * (ctx - 1), SamplingParams(max_tokens=1000, ignore_eos=True), SLO(1.0, tbt, "c"),
                    req_id=f"d{k}")
        r.output_token_ids = [0]
        r.token_times = [0.0]
        r.num_computed_tokens = ctx - 1
        core.adopt(Handoff(r, None))
    return inst


def test_victim_is_the_request_with_fewest_blocks_that_covers_the_shortfall():
    # 12 blocks of 16 tokens; computed 31, 39, 63 tokens hold 2 + 3 + 4 = 9 blocks (3 free);
    # the token after the next needs a new block for d0 (33 tokens) and d2 (65): 2 <= 3, no move
    inst = _decode_instance(12, [32, 40, 64])
    sched = inst.scheduler
    assert [sched.bm.num_held(f"d{k}", 0) for k in range(3)] == [2, 3, 4]
    assert migration_victim(sched, LM, N) is None
    # two blocks taken by another request: 1 free, short by 1 -> the fewest blocks, d0
    sched.bm.allocate("other", 32)
    v = migration_victim(sched, LM, N)
    assert v is not None and v[0].req_id == "d0" and v[1] == "memory"
    # d0 already leaving: the others' growth (d2's block) fits in the free block
    assert migration_victim(sched, LM, N, exclude={"d0"}) is None
    sched.bm.allocate("other", 48)  # one more block taken: short by 1 again, d1 (3 blocks) is the smallest
    assert migration_victim(sched, LM, N, exclude={"d0"})[0].req_id == "d1"
    assert migration_victim(sched, LM, N, exclude={"d0", "d2"}) is None  # one request left: nowhere better
    sched.bm.free("other")


def test_no_trigger_with_room_and_met_tbt():
    inst = _decode_instance(1000, [100, 200, 300], tbt=1.0)
    assert migration_victim(inst.scheduler, LM, N) is None


def test_slo_trigger_prices_a_request_adopted_since_the_last_replan():
    """A decode request adopted between two steps has no Alg. 1 plan yet (the next step's
    replan gives it one, at full depth). The SLO trigger priced the instance's plans with it
    and raised KeyError out of the cluster's migration pass (a 1P1D cluster of summarization
    streams, AVX2 profile); it is priced at full depth, as Alg. 1 would start it."""
    inst = _decode_instance(1000, [100, 200, 300], tbt=0.01)
    sched = inst.scheduler
    assert not sched.plans  # adopted, not planned yet
    sched.t_g, sched.last_iteration_s = 0.01, 0.02  # the last iteration ran over T_g
    v = migration_victim(sched, LM, N)  # the three at full depth: 0.85 ms, within T_g, no move
    assert v is None
    sched.t_g = 0.0008  # predicted over it: the victim search runs (Alg. 1 holds the rest to 10 ms)
    v = migration_victim(sched, LM, N)
    assert v is not None and v[1] == "slo" and v[0].req_id == "d0"  # two left fit their 10 ms


def test_a_backlog_of_one_class_migrates():
    """Issue 28 item 8: ten requests of one TBT class, each reachable alone, overload the
    instance together; Alg. 1 gives their level up (T_g = inf: no looser level) and the trigger
    read that as "no target": nothing ever moved (as after a thaw with a backlog). One move does
    not restore the level, several do: the first (fewest blocks) leaves now."""
    inst = _decode_instance(1000, [1000] * 9 + [900], tbt=0.001)
    sched = inst.scheduler
    for _ in range(3):
        inst.sim.step()
    rep = sched.report()
    assert rep.t_g == float("inf") and rep.last_iteration_s > 0.001
    v = migration_victim(sched, LM, N)
    assert v is not None and v[1] == "slo" and v[0].req_id == "d9"  # the fewest blocks
    # targets out of reach even alone: moving saves nobody
    lost = _decode_instance(1000, [1000] * 10, tbt=0.0005)
    for _ in range(3):
        lost.sim.step()
    assert migration_victim(lost.scheduler, LM, N) is None


def test_a_decode_instance_given_a_backlog_at_once_sheds_it():
    """Twelve chat streams (0.95 ms TBT, each reachable alone, about five together) prefilled
    together and all handed to one decode instance at once: its level is given up (T_g = inf)
    and migration moves the backlog out one request per step until it holds its target. Before,
    two moved while T_g was still finite, then none: 23 % of all gaps missed the target (now 3 %)."""
    cfg = ClusterConfig(latency_model=LM, kv_bytes_per_token_layer=4096, num_blocks=1000, gpus_per_node=2)
    sim = ClusterSim(PinnedDecode(), ClusterSpec.parse("1P2D"), cfg)
    src, dst = sim.controller.decode
    reqs = [Request([1] * 100, SamplingParams(max_tokens=100, ignore_eos=True), SLO(1.0, 0.00095, "chat"),
                    arrival_time=0.0, req_id=f"m{i}") for i in range(12)]
    res = sim.run(reqs)
    assert sim.controller.num_migrated.get("slo", 0) >= 3 and src.migrated_out == res.migrations
    gaps = [b - a for r in res.requests for a, b in zip(r.token_times, r.token_times[1:])]
    assert sum(g > 0.00095 for g in gaps) < 0.1 * len(gaps)
    assert all(r.finish_reason == "length" and r.num_output_tokens == 100 == len(r.token_times) for r in res.requests)
    for i in sim.instances:
        i.check_integrity(expect_empty=True)
