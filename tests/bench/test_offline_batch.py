"""benchmarks/offline_batch.py (issue 16's offline case): one real batch per policy on a tiny
random-weight model, counted per class (the figures themselves are a benchmark)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "offline_batch", Path(__file__).resolve().parents[2] / "benchmarks" / "offline_batch.py")
ob = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ob)


def test_a_batch_is_counted_per_class_for_every_policy(tiny_llama):
    prompts = [f"note {i} about the sea" for i in range(6)]
    for policy in ("sarathi", "laser"):
        r = ob.run(policy, prompts, 3, model=str(tiny_llama))
        assert r["wall_s"] > 0 and r["steps"] >= 3  # at least one step per output token
        assert sum(r["ttft_met"].values()) <= len(prompts) and set(r["ttft_met"]) == set(ob.CLASSES)
        for c in ob.CLASSES:  # an SLO met needs its TTFT met
            assert 0 <= r["slo_met"][c] <= r["ttft_met"][c] <= 2
