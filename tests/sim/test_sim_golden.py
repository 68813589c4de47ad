"""The cluster simulator's results are pinned: per-request first-token, token and finish times
of small cluster runs hash to digests recorded on the code before the simulator speed-up
step 3 of issue 12. A speed change must leave every decision -- and so every virtual time --
bit-identical; these tests fail on any difference, however small.

A deliberate decision change (a scheduler or controller rule) changes the digests too: re-record
them with ``python tests/sim/test_sim_golden.py`` and say so in the commit message.

Scenarios: the paper-scale 2P2D Laser cluster (Qwen2.5-14B shapes on the A100 analytic model,
Table 1 length means, 1:1:1 mix), the decode->decode migration scenarios of
``tests/controller/test_migration.py`` (memory migrations and the recompute preemptions after them), Laser
under TBT targets near the iteration time (Alg. 1 plans with L < N, hand-off re-assignments,
preemptions), and the DistServe / colocated baselines on a small model.
"""

from __future__ import annotations

import hashlib
import random
import sys

import pytest

from laser.bench.cluster import table1_requests
from laser.controller.laser import LaserController
from laser.latency import SimpleLatencyModel
from laser.core.request import SLO, Request, SamplingParams
from laser.sim.cluster import ClusterConfig, ClusterSim, ClusterSpec, paper_config

SMALL = SimpleLatencyModel(num_layers=4, per_layer=2e-4, per_token=2e-6, per_context=1e-8)


class _Pinned(LaserController):
    """Every request to the first decode instance (pushes it past its KV pool: migrations)."""

    name = "pinned-golden"

    def assign_decode(self, info, exclude=()):
        return self.decode[0].instance_id

    def at_handoff(self, info, chosen, now):
        return self.decode[0].instance_id


def _pinned_requests(n: int) -> list[Request]:
    return [Request([1] * 100, SamplingParams(max_tokens=300, ignore_eos=True), SLO(1.0, 0.05, "chat"),
                    arrival_time=0.001 * i, req_id=f"m{i}") for i in range(n)]


def _tight(n: int, rate: float, seed: int) -> list[Request]:
    """TBT targets near the small model's iteration time: Alg. 1 cuts the looser requests to
    L < N layers per iteration; at the higher rate requests are also re-assigned at the hand-off
    and preempted."""
    rng = random.Random(seed)
    slos = [SLO(0.01, 0.0011, "strict"), SLO(0.05, 0.004, "loose"), SLO(0.2, None, "best-effort")]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(Request([1] * rng.randint(8, 200), SamplingParams(max_tokens=rng.randint(4, 60), ignore_eos=True),
                           slos[i % 3], arrival_time=t, req_id=f"t{i}"))
    return out


def _small(num_blocks: int) -> ClusterConfig:
    return ClusterConfig(latency_model=SMALL, kv_bytes_per_token_layer=4096, num_blocks=num_blocks, gpus_per_node=2)


SCENARIOS = {
    "paper-2P2D-laser": lambda: (ClusterSim("laser", ClusterSpec.parse("2P2D"), paper_config("qwen2.5-14b", "a100")),
                                 table1_requests(60, 12.0, seed=3)),
    "migration-memory": lambda: (ClusterSim(_Pinned(), ClusterSpec.parse("1P2D"), _small(64)), _pinned_requests(3)),
    "migration-and-recompute": lambda: (ClusterSim(_Pinned(), ClusterSpec.parse("1P2D"), _small(40)),
                                        _pinned_requests(4)),
    "small-2P2D-laser": lambda: (ClusterSim("laser", ClusterSpec.parse("2P2D"), _small(160)),
                                 table1_requests(80, 150.0, seed=5, scale=0.1)),
    "small-2P2D-distserve": lambda: (ClusterSim("distserve", ClusterSpec.parse("2P2D"), _small(160)),
                                     table1_requests(60, 150.0, seed=6, scale=0.1)),
    "tight-2P2D-laser-800": lambda: (ClusterSim("laser", ClusterSpec.parse("2P2D"), _small(160)),
                                     _tight(80, 800.0, seed=9)),
    "tight-2P2D-laser-2000": lambda: (ClusterSim("laser", ClusterSpec.parse("2P2D"), _small(160)),
                                      _tight(80, 2000.0, seed=9)),
    "small-3M-colocated": lambda: (ClusterSim("colocated", ClusterSpec.parse("3M"), _small(160)),
                                   table1_requests(60, 150.0, seed=7, scale=0.1)),
}

#: SHA-256 (first 16 hex digits) of every request's times, recorded before speed-up step 3.
GOLDEN = {
    "migration-and-recompute": "c0b0a24ee8af23c9",
    "migration-memory": "28523728201b4296",
    "paper-2P2D-laser": "45507ef1494bf60c",
    "small-2P2D-distserve": "9697e0b63f128459",
    "small-2P2D-laser": "61799cc73e869d91",
    "small-3M-colocated": "a31f6d6f730862f5",
    "tight-2P2D-laser-2000": "7961744c235908f6",
    "tight-2P2D-laser-800": "e4cf319765861f14",
}


def digest(name: str) -> str:
    """Run scenario ``name``; hash (req_id, TTFT time, token times, finish time and reason, demoted)
    of every request, in input order, with ``repr`` (every bit of every float)."""
    sim, reqs = SCENARIOS[name]()
    res = sim.run(reqs)  # also checks conservation and every instance's integrity
    h = hashlib.sha256()
    for r in res.requests:
        h.update(repr((r.req_id, r.first_token_time, tuple(r.token_times), r.finish_time, r.finish_reason,
                       r.demoted)).encode())
    h.update(repr((res.events, res.transfers, res.migrations, res.reassigned)).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_cluster_results_are_bit_identical_to_the_recorded_ones(name):
    assert digest(name) == GOLDEN[name]


if __name__ == "__main__":  # re-record (a deliberate decision change only)
    for name in sorted(SCENARIOS) if len(sys.argv) < 2 else sys.argv[1:]:
        print(f'    "{name}": "{digest(name)}",')
