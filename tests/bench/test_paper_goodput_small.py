"""laser.bench.paper_goodput (benchmarks/paper_goodput_small.py, issue 12's §9 reproduction runs): the pure parts -- the
goodput search (grid, extension past a passing grid top, bisection), the per-entry P:D split
option and the summary cells. One real simulated probe checks that ``@prefill_share`` reaches
the cluster layout. The sweeps themselves take many minutes of CPU; they are benchmarks."""

import argparse

import pytest

from laser.bench import paper_goodput as pg
from laser.bench.plan import parse_mix
from laser.bench.runner import tbt_token_budget
from laser.controller import get_controller
from laser.sim.cluster import paper_config


def _knee(k: float, probed: list):
    """A controller whose attainment is 1 up to ``k`` req/s and 0.6 above; records the probes."""
    def run(rate):
        probed.append(rate)
        return 1.0 if rate <= k else 0.6
    return run


def test_search_extends_past_a_passing_grid_top_until_a_probe_fails_then_bisects():
    probed = []
    good, lower = pg.search_knee(_knee(57, probed), [8, 16, 24, 32], extend=5, bisect=2)
    # grid, then 40, 48, 56 pass and 64 fails; bisect 56..64 -> 60 fails, 58 fails
    assert probed == [8, 16, 24, 32, 40, 48, 56, 64, 60, 58]
    assert (good, lower) == (56, False)


def test_search_without_extension_reports_the_grid_top_as_a_lower_bound():
    probed = []
    assert pg.search_knee(_knee(100, probed), [8, 16], extend=0, bisect=2) == (16, True)
    assert probed == [8, 16]
    probed.clear()  # the extension runs out before a failure: still a lower bound
    assert pg.search_knee(_knee(100, probed), [8, 16], extend=2, bisect=2) == (32, True)
    assert probed == [8, 16, 24, 32]


def test_search_stops_the_grid_below_stop_below_and_bisects_inside_it():
    probed = []
    good, lower = pg.search_knee(_knee(20, probed), [8, 16, 24, 32], extend=3, bisect=1, stop_below=0.8)
    assert probed == [8, 16, 24, 20]  # 24 fails under 0.8: 32 is never probed, no extension
    assert (good, lower) == (20, False)
    probed.clear()  # fails already at the lowest rate: bisect toward 0
    assert pg.search_knee(_knee(5, probed), [8, 16], bisect=1, stop_below=0.8) == (4, False)
    assert probed == [8, 4]


def test_pd_split_and_the_scripts_own_controller_option():
    assert [pg.pd_split(8, s) for s in (0.25, 0.375, 0.5, 0.625, 0.75)] == [(2, 6), (3, 5), (4, 4), (5, 3), (6, 2)]
    assert pg.pd_split(8, 0.01) == (1, 7) and pg.pd_split(8, 0.99) == (7, 1)
    with pytest.raises(ValueError, match="prefill share"):
        pg.pd_split(8, 1.0)
    with pytest.raises(ValueError, match=">= 2 instances"):
        pg.pd_split(1, 0.5)
    assert pg.split_options("distserve@prefill_share=0.25", 0.5) == ("distserve", {}, 0.25)
    assert pg.split_options("laser@decode_policy=vllm", 0.5) == ("laser", {"decode_policy": "vllm"}, 0.5)
    with pytest.raises(ValueError, match="key=value"):
        pg.split_options("laser@oops", 0.5)
    with pytest.raises(ValueError, match="must increase"):
        pg.extended_rates([8, 8], 1)


def test_summary_cells_mark_lower_bounds():
    assert pg.goodput_cell(40, False) == "40" and pg.goodput_cell(48, True) == ">= 48"
    assert pg.ratio_cell((40, False), (20, False)) == "2.00"
    assert pg.ratio_cell((48, True), (24, False)) == ">= 2.00"
    assert pg.ratio_cell((40, False), (48, True)) == "<= 0.83"
    assert pg.ratio_cell((48, True), (48, True)) == "? 1.00"
    assert pg.ratio_cell((4, False), (0, False)) == "inf"


def test_prefill_share_option_sets_the_simulated_layout(monkeypatch):
    layouts = []
    real = pg.ClusterSpec

    def spy(p, d):
        layouts.append((p, d))
        return real(p, d)

    monkeypatch.setattr(pg, "ClusterSpec", spy)
    args = argparse.Namespace(requests=12, seed=0, prefill_share=0.5, sarathi_budget="tbt")
    cfg = paper_config("qwen2.5-14b", "a100")
    out = pg.probe("distserve@prefill_share=0.25", 8, cfg, 4.0, args, parse_mix("1:1:1"), 1.0)
    pg.probe("distserve", 8, cfg, 4.0, args, parse_mix("1:1:1"), 1.0)
    assert layouts == [(2, 6), (4, 4)]
    assert 0.0 <= out["att"] <= 1.0 and out["ttft"] > 0


def test_colocated_sarathi_gets_a_tbt_sized_budget_and_others_none():
    cfg = paper_config("qwen2.5-14b", "a100")
    lm = cfg.latency_model
    colocated, distserve, laser = (get_controller(n) for n in ("colocated", "distserve", "laser"))
    b50 = pg.mixed_budget(colocated, lm, (0.05, 0.1, 0.2), "tbt")
    assert b50 == tbt_token_budget(lm, 0.05)
    assert 16 <= pg.mixed_budget(colocated, lm, (0.04, 0.08), "tbt") < b50 < 2048  # tighter TBT, smaller chunks
    assert pg.mixed_budget(colocated, lm, (0.05,), "2048") == 2048
    assert pg.mixed_budget(distserve, lm, (0.05,), "tbt") is None
    assert pg.mixed_budget(laser, lm, (0.05,), "tbt") is None
    for bad in ("0", "big", "-5"):
        with pytest.raises(ValueError, match="sarathi-budget"):
            pg.mixed_budget(colocated, lm, (0.05,), bad)
    args = argparse.Namespace(requests=12, seed=0, prefill_share=0.5, sarathi_budget="tbt")
    out = pg.probe("colocated", 4, cfg, 2.0, args, parse_mix("1:1:1"), 1.0)
    assert out["budget"] == b50 and 0.0 <= out["att"] <= 1.0
