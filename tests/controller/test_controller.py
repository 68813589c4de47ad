"""The global controller's decisions (PPoPP'26 §7) on real simulated instances with
hand-built states: Alg. 2 decode assignment, the increment formula, prefill selection by
slack with the best-effort fallback, and group sizing by lambda/mu."""

from __future__ import annotations

import math

import pytest

from laser.controller import get_controller
from laser.controller.groups import GroupManager, largest_remainder
from laser.scheduler.ttft import finish_times
from laser.instance.messages import RequestInfo
from laser.latency import SimpleLatencyModel
from laser.instance.core import Handoff
from laser.core.request import SLO, Phase, Request, SamplingParams
from laser.scheduler.laser.decode import DecodeCandidate
from laser.scheduler.laser.increment import latency_increment
from laser.sim.cluster_instance import SimClusterInstance

N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-4)


def decode_req(rid: str, prompt: int, tbt: float, out: int = 50) -> Request:
    """A request whose prefill ran elsewhere: one output token, KV for the prompt."""
    r = Request([1] * prompt, SamplingParams(max_tokens=out, ignore_eos=True), SLO(ttft=1.0, tbt=tbt),
                req_id=rid)
    r.output_token_ids = [0]
    r.token_times = [0.0]
    r.num_computed_tokens = prompt
    r.phase = Phase.DECODE
    return r


def decode_instance(iid: int, loads: list[tuple[int, float]], num_blocks: int = 1024) -> SimClusterInstance:
    """A decode instance already decoding ``loads`` = [(prompt, tbt)] (adopted at t=0)."""
    inst = SimClusterInstance(iid, "decode", "laser", LM, num_blocks, block_size=16, icache_tokens=2048)
    for k, (p, tbt) in enumerate(loads):
        inst.add_request(Handoff(decode_req(f"i{iid}-{k}", p, tbt), None), at=0.0)
    if loads:
        inst.begin(0.0)
        inst.complete()
    return inst


def info(rid="new", prompt=16, tbt=0.05, ttft=1.0, out=8, arrival=0.0) -> RequestInfo:
    return RequestInfo(rid, arrival, prompt, ttft, tbt, "x", out)


def laser_controller(decodes, groups: dict[float, list[int]]):
    prefill = SimClusterInstance(100, "prefill", "laser", LM, 1024)
    ctl = get_controller("laser")(tbt_targets=tuple(groups))
    ctl.attach([prefill] + decodes)
    for t, members in groups.items():
        ctl.groups.groups[t].members = list(members)
    return ctl


# -- increment formula -----------------------------------------------------------------------


def test_increment_worked_example_full_depth():
    # one relaxed request at full depth; the newcomer keeps everyone at L = N:
    # Iter = 4·(1e-3 + 1e-4) = 4.4 ms; Iter* = 4·(1e-3 + 2e-4) = 4.8 ms; I = 2·4.8 − 4.4 = 5.2 ms
    cur = [DecodeCandidate("a", 10, SLO(tbt=1.0))]
    inc = latency_increment(LM, N, 0, cur, {}, DecodeCandidate("b", 10, SLO(tbt=1.0)))
    assert inc.iter_before == pytest.approx(4.4e-3)
    assert inc.iter_after == pytest.approx(4.8e-3)
    assert inc.value == pytest.approx(5.2e-3)


def test_increment_worked_example_with_alg1_relaxing():
    # the newcomer's 4.6 ms TBT is below 4.8 ms: Alg. 1 drops the relaxed request to
    # L = ceil(4·4.6e-3/1.0) = 1 layer per iteration (4 iterations per token), Iter* = 4·1.1 + 0.1 = 4.5 ms;
    # restoring it would break 4.6 ms. I = 4.5·1 + 4.5·4 − 4.4·1 = 18.1 ms.
    cur = [DecodeCandidate("a", 10, SLO(tbt=1.0))]
    inc = latency_increment(LM, N, 0, cur, {}, DecodeCandidate("b", 10, SLO(tbt=4.6e-3)))
    assert inc.iter_after == pytest.approx(4.5e-3)
    assert inc.value == pytest.approx(18.1e-3)


def test_increment_inf_when_strictest_tbt_breaks():
    cur = [DecodeCandidate("a", 10, SLO(tbt=1.0))]
    inc = latency_increment(LM, N, 0, cur, {}, DecodeCandidate("b", 10, SLO(tbt=4.0e-3)))
    assert inc.value == math.inf


# -- Alg. 2 -----------------------------------------------------------------------------------


def test_alg2_nearest_group_then_smallest_increment():
    # group 50 ms: instance 0 (busy), 1 (light); group 200 ms: instance 2 (idle, smallest increment overall)
    d0 = decode_instance(0, [(16, 1.0)] * 6)
    d1 = decode_instance(1, [(16, 1.0)] * 1)
    d2 = decode_instance(2, [])
    ctl = laser_controller([d0, d1, d2], {0.05: [0, 1], 0.2: [2]})
    incs = {d.instance_id: d.latency_increment(info()).value for d in (d0, d1, d2)}
    assert incs[2] < incs[1] < incs[0]
    assert ctl.assign_decode(info(tbt=0.05)) == 1  # nearest group, smallest increment in it
    assert ctl.assign_decode(info(tbt=0.2)) == 2
    assert ctl.assign_decode(info(tbt=0.1)) == 1  # |0.05-0.1| < |0.2-0.1|


def test_alg2_other_group_when_own_is_inf_and_least_loaded_when_all_are():
    full = [(16 * 60, 1.0)]  # 60 of 64 blocks in use: no room for another request (5 % reserve)
    d0 = decode_instance(0, full, num_blocks=64)
    d1 = decode_instance(1, [(16, 1.0)] * 3, num_blocks=64)
    ctl = laser_controller([d0, d1], {0.05: [0], 0.2: [1]})
    assert d0.latency_increment(info()).reason == "memory"
    assert ctl.assign_decode(info(tbt=0.05)) == 1  # its own group answers inf
    # all inf: a TBT no instance can meet -> least-loaded (fewest KV blocks in use) = instance 1
    assert d1.latency_increment(info(tbt=1e-4)).value == math.inf
    assert ctl.assign_decode(info(tbt=1e-4)) == 1
    assert ctl.num_fallback_decode == 1


def test_reservation_counts_in_later_increments():
    d0 = decode_instance(0, [(16, 1.0)])
    before = d0.latency_increment(info("x")).value
    d0.reserve(info("y"))
    assert d0.latency_increment(info("x")).value > before
    d0.release("y")
    assert d0.latency_increment(info("x")).value == pytest.approx(before)


# -- prefill selection ------------------------------------------------------------------------


def prefill_instance(iid: int, prompts: list[tuple[int, float]]) -> SimClusterInstance:
    inst = SimClusterInstance(iid, "prefill", "laser", LM, 4096)
    for k, (p, ttft) in enumerate(prompts):
        inst.add_request(Request([1] * p, SamplingParams(max_tokens=4, ignore_eos=True), SLO(ttft=ttft, tbt=1.0),
                                 req_id=f"p{iid}-{k}"), at=0.0)
    return inst


def test_prefill_largest_slack_wins():
    a = prefill_instance(0, [(2000, 1.0)] * 3)
    b = prefill_instance(1, [(200, 1.0)])
    d = decode_instance(2, [])
    ctl = get_controller("laser")()
    ctl.attach([a, b, d])
    pid, demoted = ctl.select_prefill(info(prompt=100, ttft=0.5), 0.0)
    assert (pid, demoted) == (1, False)


def test_infeasible_request_goes_to_fewest_tokens_and_keeps_admitted_deadlines():
    # Admitted: requests whose deadlines hold only if nothing jumps ahead of them.
    # (a 200-token prefill alone takes 4 x (1 ms + 200 x 0.1 ms) = 84 ms)
    admitted = [(200, 0.1), (200, 0.2)]
    a = prefill_instance(0, admitted)
    b = prefill_instance(1, admitted + [(500, 0.5)])
    ctl = get_controller("laser")()
    ctl.attach([a, b, decode_instance(2, [])])
    rep = a.report()
    assert all(f <= e.deadline for e, f in finish_times(rep.scheduler, LM, 0.0, num_layers=N))
    urgent = info("urgent", prompt=200, ttft=0.03)  # cannot make 30 ms anywhere
    pid, demoted = ctl.select_prefill(urgent, 0.0)
    assert (pid, demoted) == (0, True)  # fewest queued prefill tokens

    def serve(demote: bool) -> dict[str, Request]:
        inst = prefill_instance(0, admitted)
        r = Request([1] * 200, SamplingParams(max_tokens=1, ignore_eos=True), SLO(ttft=0.03, tbt=1.0),
                    req_id="urgent", demoted=demote)
        reqs = {x[2].req_id: x[2] for x in inst.sim.deliveries}
        reqs["urgent"] = r
        inst.add_request(r, at=0.0)
        while inst.begin(inst.clock) is not None:
            inst.complete()
        inst.check_integrity(expect_empty=True)
        return reqs

    kept = serve(True)
    assert all(r.first_token_time <= r.ttft_deadline for k, r in kept.items() if k != "urgent")
    # Undemoted, the instance's Laser scheduler itself puts the hopeless request behind the
    # prefills that can still make their deadlines (no EDF domino): the admitted ones hold
    # too, and the urgent one is still served.
    undemoted = serve(False)
    assert all(r.first_token_time <= r.ttft_deadline for k, r in undemoted.items() if k != "urgent")
    assert undemoted["urgent"].first_token_time is not None


# -- groups -----------------------------------------------------------------------------------


def test_largest_remainder():
    assert largest_remainder([3.0, 1.0], 4) == [3, 1]
    assert sum(largest_remainder([0.2, 0.3, 0.5], 7)) == 7
    assert largest_remainder([10.0, 0.01], 3, [True, True]) == [2, 1]
    assert largest_remainder([0.0, 0.0], 4) == [2, 2]


def test_group_sizes_follow_lambda_over_mu():
    gm = GroupManager(list(range(8)), LM, 4096, 16, [0.05, 0.2], window_s=30.0, interval_s=1e9)
    for k in range(300):  # 3:1 arrivals of the 50 ms target
        gm.observe(0.05 if k % 4 else 0.2, 64, k * 0.1)
    dem = gm.demand()
    gm.resize(30.0)
    n = {t: len(g.members) for t, g in gm.groups.items()}
    assert sum(n.values()) == 8 and all(v >= 1 for v in n.values())
    assert n == dict(zip(sorted(dem), largest_remainder([dem[t] for t in sorted(dem)], 8, [True, True])))
    assert n[0.05] > n[0.2]
    for k in range(3000):  # the mix flips: groups follow
        gm.observe(0.2 if k % 8 else 0.05, 64, 30.0 + k * 0.05)
    gm.resize(200.0)
    m = {t: len(g.members) for t, g in gm.groups.items()}
    assert m[0.2] > m[0.05] and sum(m.values()) == 8
    members = sorted(i for g in gm.groups.values() for i in g.members)
    assert members == list(range(8))  # every instance in exactly one group


# -- a burst over several instances (issue 28 item 7) -------------------------------------------------


def _burst(ctl, prefills, n: int, ttft: float | None) -> list[int]:
    """Route ``n`` requests arriving together, sending each to its prefill instance as the front end
    does; the number each prefill instance got."""
    got = {p.instance_id: 0 for p in prefills}
    for k in range(n):
        i = info(f"b{k}", prompt=200, ttft=ttft, tbt=None)
        route = ctl.route(i, 0.0)
        ctl.instances[route.prefill].add_request(
            Request([1] * i.prompt_len, SamplingParams(max_tokens=4, ignore_eos=True), SLO(ttft=ttft),
                    req_id=i.req_id), at=0.0)
        got[route.prefill] += 1
    return sorted(got.values())


@pytest.mark.parametrize("ttft", [None, 30.0])
def test_burst_spreads_over_prefill_instances(ttft):
    """24 requests at once on 2P1D: one prefill instance queued 19 and the other none -- without
    a TTFT deadline every instance ties on slack (+inf) and the first won every time. Ties now go
    to the fewest pending prefill tokens, which count the requests just sent."""
    prefills = [prefill_instance(0, []), prefill_instance(1, [])]
    ctl = get_controller("laser")()
    ctl.attach(prefills + [decode_instance(2, [])])
    assert _burst(ctl, prefills, 24, ttft) == [12, 12]


def test_distserve_handoffs_of_a_wave_spread_over_decode_instances():
    """Hand-offs decided back to back (a wave of prefills ending together) all went to the same
    decode instance: its report did not show the ones on their way. The choice is reserved there
    until adopted, so the next choice counts it."""
    prefill = SimClusterInstance(100, "prefill", "vllm", LM, 1024)
    decodes = [decode_instance(0, []), decode_instance(1, [])]
    ctl = get_controller("distserve")()
    ctl.attach([prefill] + decodes)
    picks = [ctl.at_handoff(info(f"h{k}", tbt=None), None, 0.0) for k in range(6)]
    assert sorted(picks.count(d) for d in (0, 1)) == [3, 3]


# -- cache-aware prefill selection (issue 29) ---------------------------------------------------------


class ReportedPrefill:
    """A prefill instance known only by a hand-built report (what the controller routes by)."""

    role = "prefill"
    latency_model = LM
    num_layers = N

    def __init__(self, iid: int, rep, lm=LM):
        self.instance_id, self._rep, self.latency_model = iid, rep, lm

    def report(self):
        return self._rep


def hand_report(iid: int, queue=(), cached=frozenset()):
    from laser.instance.messages import InstanceReport
    from laser.scheduler.report import SchedulerReport

    return InstanceReport(iid, "prefill", 0.0, 0.0, SchedulerReport(role="prefill", queue=tuple(queue)), 0, 0, 0, 4096, 4096, 16, 0,
                          16384, cached_blocks=frozenset(cached))


def queued(req_id: str, deadline: float, tokens: int):
    """A queued prompt of ``tokens`` tokens with TTFT deadline ``deadline`` (seconds)."""
    from laser.scheduler.report import QueueEntry

    return QueueEntry((deadline, 0.0), tokens, tokens, None, "chat", req_id, deadline, tokens)


def test_prefill_prefers_the_instance_holding_the_prefix_unless_a_deadline_breaks():
    from laser.core.block_manager import hash_blocks, prefix_root

    prompt = list(range(1000))
    hashes = tuple(hash_blocks([], prompt, 16, prefix_root("")))
    req = RequestInfo("new", 0.0, 1000, 0.5, 0.05, "chat", 8, hashes)
    # instance 0 is idle, instance 1 has one short prompt queued but holds the 992-token prefix
    light = queued("q", 1.0, 100)
    idle, holder = hand_report(0), hand_report(1, [light], hashes)
    assert holder.cached_prefix_tokens(req) == 992 and idle.cached_prefix_tokens(req) == 0
    ctl = get_controller("laser")()
    ctl.attach([ReportedPrefill(0, idle), ReportedPrefill(1, holder), decode_instance(2, [])])
    assert ctl.select_prefill(req, 0.0) == (1, False)  # the hit, though the other has more slack
    assert ctl.num_routed_cached_tokens == 992
    # prefix-blind (no hashes), the idle instance's larger slack wins
    blind = RequestInfo("blind", 0.0, 1000, 0.5, 0.05, "chat", 8)
    assert ctl.select_prefill(blind, 0.0) == (0, False)
    # Now the holder's queue has a long prompt whose deadline holds with 0.2 ms to spare; the
    # newcomer's deadline is earlier (EDF: it goes first). Priced with per-token 10 us: the
    # newcomer alone on the idle instance takes 4 x (1 + 10) ms = 44 ms, in time for 80 ms; on
    # the holder only its 8 uncached tokens run, but they delay the long prompt by 4 x 0.08 ms:
    # 84.32 ms past its 84.2 ms deadline. The hit is not taken.
    lm = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5)
    tight = queued("tight", 0.0842, 2000)
    busy_holder = hand_report(1, [tight], hashes)
    ctl = get_controller("laser")()
    ctl.attach([ReportedPrefill(0, idle, lm), ReportedPrefill(1, busy_holder, lm), decode_instance(2, [])])
    early = RequestInfo("early", 0.0, 1000, 0.08, 0.05, "chat", 8, hashes)
    assert ctl.select_prefill(early, 0.0) == (0, False)
    # with room for it, the holder is chosen again
    roomy = hand_report(1, [queued("roomy", 0.09, 2000)], hashes)
    ctl = get_controller("laser")()
    ctl.attach([ReportedPrefill(0, idle, lm), ReportedPrefill(1, roomy, lm), decode_instance(2, [])])
    assert ctl.select_prefill(early, 0.0) == (1, False)
    # only the last whole block before the final token counts (the last token is computed)
    short = RequestInfo("s", 0.0, 32, 0.5, 0.05, "chat", 8, hashes[:2])
    assert holder.cached_prefix_tokens(short) == 16


def test_least_loaded_baselines_route_to_the_prefix_unless_its_queue_outweighs_the_cached_work():
    """distserve's prefill choice and colocated's mixed choice count the request's own uncached
    work: the instance holding the prefix wins while its extra queue is smaller than the cached
    work (SGLang's cache-aware router's balance rule, in the load's unit), not beyond; without
    hashes the choice is the plain least-loaded one."""
    from laser.core.block_manager import hash_blocks, prefix_root

    prompt = list(range(1000))
    hashes = tuple(hash_blocks([], prompt, 16, prefix_root("")))
    req = RequestInfo("new", 0.0, 1000, 0.5, 0.05, "chat", 8, hashes)
    blind = RequestInfo("blind", 0.0, 1000, 0.5, 0.05, "chat", 8)
    for name in ("distserve", "colocated", "colocated-laser"):
        for extra, want in ((500, 1), (2000, 0)):  # holder's queue: shorter / longer than the 992 cached tokens
            idle = hand_report(0)
            holder = hand_report(1, [queued("q", 1.0, extra)], hashes)
            ctl = get_controller(name)()
            insts = [ReportedPrefill(0, idle), ReportedPrefill(1, holder)]
            if ctl.disaggregated:
                insts.append(decode_instance(2, []))
            else:
                for i in insts:
                    i.role = "mixed"
            ctl.attach(insts)
            assert ctl.route(req, 0.0).prefill == want, (name, extra)
            assert ctl.num_routed_cached_tokens == (992 if want == 1 else 0)
            assert ctl.route(blind, 0.0).prefill == 0, (name, extra)  # no hashes: least loaded
